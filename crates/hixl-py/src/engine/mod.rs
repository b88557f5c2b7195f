//! `Hixl`, the engine (handles and requests: `request`; descriptor parsing: `descs`). The GIL is released around every call
//! into the core that can block, wait or copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use hixl_core::{Engine, Waiting};

use crate::args::{Addr, Millis, Text};
use crate::buffer;
use crate::descs::parse_descs;
use crate::errors::{self, to_py};
use crate::keep::{self, KeepAlive};
use crate::request::{connect_interruptibly, ms, wait_req, MemHandle, TransferReq, SLICE};
use crate::types::OpArg;
use crate::types::{
    self, AsyncConnectStatus, MemDesc, MemType, NotifyDesc, RemoteRegion, StridedDesc, TransferOp,
    TransferStatus,
};

/// A transfer engine: it registers memory of this process, links to other engines, and READs or
/// WRITEs their registered memory one-sidedly (the peer runs no application code for it).
///
/// `Hixl()` makes an engine that does nothing until `initialize`; one per process is typical.
/// It is a context manager: `with hixl.Hixl() as e:` calls `finalize` on exit and lets
/// exceptions through. Every method may be called from any thread. The calls that can block,
/// wait or copy release the GIL; the waits of `connect`, `transfer_sync`, `put`/`get`, the
/// strided calls, `wait_notifies` and `TransferReq.wait` also check for Ctrl-C every 50 ms
/// (`KeyboardInterrupt`). A call that uses the engine before `initialize`, after `finalize`,
/// or in a `fork()`ed child of the process that initialized it raises `Failed`.
///
/// `timeout_ms` arguments are milliseconds (int or float, >= 0); more than a year means a year,
/// and a negative, NaN or infinite value raises `ParamInvalid`. Left out (None), a call takes
/// the engine's option, `hixl.transfer_timeout_ms` (default 10000) or
/// `hixl.connect_timeout_ms` (default 3000), as each method says. Errors are subclasses of
/// `hixl.HixlError`. The full reference: <https://github.com/hixl/hixl/blob/main/docs/API.md>.
#[pyclass(frozen, module = "hixl._hixl", subclass)]
pub struct Hixl {
    pub(crate) engine: Arc<Engine>,
    /// What each registration keeps alive, by range, with the id of the registration that
    /// holds it: only a handle with that id releases it (a stale handle releases nothing).
    keep: Mutex<HashMap<(u64, u64), (u64, KeepAlive)>>,
    /// Which of `keep` are torch tensors whose storage can be checked for a resize.
    tensors: tensors::TensorSpans,
    /// Requests not yet reported final by the no-argument `get_transfer_status()`.
    unreported: Mutex<Vec<Py<TransferReq>>>,
}

/// Past this many unreported requests, finished ones are forgotten unreported.
const MAX_UNREPORTED: usize = 65536;

fn finish_sync(py: Python<'_>, req: &hixl_core::TransferReq) -> PyResult<()> {
    if req.status() == hixl_core::TransferStatus::Waiting {
        // A first slice has passed in `submit_released`.
        py.check_signals()?;
    }
    wait_req(py, req, None)?;
    req.result().map_err(to_py)
}

/// One range's `(local_addr, remote_addr, length)` arguments, as Python passed them.
type Range3<'a, 'py> = (&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>);

/// How long a synchronous call waits for its request with the GIL held before it lets go: a
/// fifth of CPython's default switch interval (5 ms).
const HELD_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

/// Batches up to this many bytes try the held path first (a same-host batch of this size may
/// be copied on the calling thread, GIL held: about a millisecond).
const HELD_BYTES: u64 = 8 << 20;

/// Submits a request that its caller waits for at once. A small batch is first submitted with
/// the GIL held (`held`, which does nothing where it would have to wait on the network) and
/// waited for up to `HELD_WAIT` still holding it: a request that ends that soon then costs no
/// GIL release at all. Taking the GIL back from a thread that runs Python costs a switch
/// interval (5 ms), more on a core shared with busy threads, which is what a busy, pinned
/// engine such as vLLM's worker is. Otherwise (or when `held` declined) as `submit_released`.
fn submit_sync(
    py: Python<'_>,
    bytes: u64,
    held: impl FnOnce() -> hixl_core::Result<Option<hixl_core::TransferReq>>,
    released: impl FnOnce() -> hixl_core::Result<hixl_core::TransferReq> + Send,
) -> PyResult<hixl_core::TransferReq> {
    if bytes <= HELD_BYTES {
        if let Some(req) = held().map_err(to_py)? {
            req.wait(Some(HELD_WAIT));
            return Ok(req);
        }
    }
    submit_released(py, Waiting::Now, released)
}

/// Runs `submit` with the GIL released. A caller that waits at once (`Waiting::Now`) also waits
/// its first slice there, so that a request that ends within it costs one GIL release, not two
/// (`finish_sync` then finds it ended).
fn submit_released(
    py: Python<'_>,
    waiting: Waiting,
    submit: impl FnOnce() -> hixl_core::Result<hixl_core::TransferReq> + Send,
) -> PyResult<hixl_core::TransferReq> {
    py.allow_threads(|| {
        let req = submit()?;
        if waiting == Waiting::Now {
            req.wait(Some(SLICE));
        }
        Ok(req)
    })
    .map_err(to_py)
}

impl Hixl {
    /// `register_mem` with a parsed access mode.
    fn register_access(
        &self,
        py: Python<'_>,
        desc: MemDesc,
        domain: hixl_core::Domain,
        access: hixl_core::Access,
        name: Option<String>,
    ) -> PyResult<MemHandle> {
        let name = name.unwrap_or_default();
        let e = self.engine.clone();
        let h = py
            .allow_threads(|| {
                let d = hixl_core::MemDesc { addr: desc.addr, len: desc.len };
                // SAFETY: the contract of a raw range passes to the Python caller, as the
                // method's documentation says (like NIXL's register_memory); `register(obj)`
                // meets it by keeping the object alive until deregistration.
                unsafe { e.register_named(d, domain, access, &name) }
            })
            .map_err(to_py)?;
        Ok(MemHandle {
            addr: h.addr,
            len: h.len,
            id: h.id,
            mem_type: h.mem_type.into(),
            name,
            domain: h.mem_type,
        })
    }

    /// Wraps a request for Python and remembers it for the no-argument status query.
    fn track(
        &self,
        py: Python<'_>,
        req: hixl_core::TransferReq,
        user_data: Option<Py<PyAny>>,
    ) -> PyResult<Py<TransferReq>> {
        let obj = Py::new(py, TransferReq { req, user_data: user_data.unwrap_or_else(|| py.None()) })?;
        let mut un = self.unreported.lock().unwrap();
        if un.len() >= MAX_UNREPORTED {
            un.retain(|r| r.get().req.status() == hixl_core::TransferStatus::Waiting);
        }
        un.push(obj.clone_ref(py));
        Ok(obj)
    }

    #[allow(clippy::too_many_arguments)]
    fn one(
        &self,
        py: Python<'_>,
        remote: &str,
        op: TransferOp,
        (local_addr, remote_addr, length): Range3<'_, '_>,
        timeout_ms: Option<Millis>,
        waiting: Waiting,
    ) -> PyResult<hixl_core::TransferReq> {
        let d = [hixl_core::TransferOpDesc {
            local_addr: types::uint("local_addr", local_addr)?,
            remote_addr: types::uint("remote_addr", remote_addr)?,
            len: types::uint("length", length)?,
        }];
        self.check_tensors(py, [d[0].local_addr])?;
        let t = ms("timeout_ms", timeout_ms)?;
        let e = self.engine.clone();
        if waiting == Waiting::Now {
            let held = || e.try_submit_held(remote, op.into(), &d, t);
            return submit_sync(py, d[0].len, held, || {
                e.submit_transfer(remote, op.into(), &d, None, t, waiting)
            });
        }
        submit_released(py, waiting, || e.submit_transfer(remote, op.into(), &d, None, t, waiting))
    }

    #[allow(clippy::too_many_arguments)]
    fn strided(
        &self,
        py: Python<'_>,
        remote: &str,
        op: TransferOp,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<Millis>,
        waiting: Waiting,
    ) -> PyResult<hixl_core::TransferReq> {
        let lb = types::uint("local_base", local_base)?;
        self.check_tensors(py, [lb])?;
        let rb = types::uint("remote_base", remote_base)?;
        let t = ms("timeout_ms", timeout_ms)?;
        let e = self.engine.clone();
        let d: hixl_core::StridedDesc = desc.into();
        if waiting == Waiting::Now && notify.is_none() {
            let bytes = d.count.saturating_mul(d.size);
            let held = || e.try_strided_held(remote, op.into(), (lb, rb), &d, t);
            let n = notify.map(Into::into);
            let released = || e.submit_strided(remote, op.into(), (lb, rb), &d, n, t, waiting);
            return submit_sync(py, bytes, held, released);
        }
        let n = notify.map(Into::into);
        submit_released(py, waiting, || e.submit_strided(remote, op.into(), (lb, rb), &d, n, t, waiting))
    }
}

#[pymethods]
impl Hixl {
    #[new]
    fn py_new() -> Self {
        Hixl {
            engine: Arc::new(Engine::new()),
            keep: Mutex::new(HashMap::new()),
            tensors: tensors::TensorSpans::default(),
            unreported: Mutex::new(Vec::new()),
        }
    }

    /// Starts the engine: a listener for peers (unless client only) and its threads.
    ///
    /// Arguments:
    /// - `local_engine` (str): "ip:port" (also `"[v6]:port"` or "host:port") to listen there; port 0
    ///   takes a free port, which the `local_engine` property then reports. An IP address alone
    ///   ("10.0.0.5", "::1") makes a client-only engine: it connects to others, nobody connects to
    ///   it, and its id is "ip#pid".
    /// - `options` (dict or other mapping, or None, default None): engine options as
    ///   `{key: value}`, values str, int or bool (`{"hixl.tcp.streams": 4, "hixl.data_mac":
    ///   True}`; True/False mean "1"/"0").
    ///   `hixl.option_keys()` lists every key with its default and meaning; Huawei HIXL's keys
    ///   (`hixl.hixl_option_keys()`) are accepted too, and `AutoConnect` starts `connect_async`
    ///   to each engine it lists. None: every default.
    ///
    /// Raises `ParamInvalid` for `options` that are not a mapping, an unknown key (with the
    /// closest known one, when one is close), a value of another type or one that does not
    /// parse (the message names the key), or an address that does not parse or cannot be listened
    /// on (in use, for one); `Failed` when the engine is already initialized or was finalized (an
    /// engine does not restart: make a new `Hixl`).
    ///
    /// Returns None. Blocks only while it binds and starts threads, with the GIL released.
    #[pyo3(signature = (local_engine, options = None))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_engine: Addr,
        options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let mut opts = HashMap::new();
        for (k, v) in types::option_items(options)? {
            let key: String =
                k.extract().map_err(|_| errors::param(format!("option key {k} is not a str")))?;
            opts.insert(key.clone(), types::option_text(&key, &v)?);
        }
        let e = self.engine.clone();
        py.allow_threads(|| e.initialize(&local_engine, &opts)).map_err(to_py)?;
        // The log drainer (started at import, before any engine) moves to the engine's CPUs:
        // a nudge gives it one turn (wake would end every later wait: it would spin).
        hixl_core::log::init_queue().nudge();
        Ok(())
    }

    /// This engine's id, the address peers `connect` to: the bound "ip:port" of a listening
    /// engine (the real port when it was started on port 0), or "ip#pid" for a client-only one.
    ///
    /// Raises `Failed` before `initialize` and after `finalize`. Does not block.
    #[getter]
    fn local_engine(&self) -> PyResult<String> {
        self.engine.local_engine().map_err(to_py)
    }

    /// The CPUs every thread of the engine runs on (`hixl.cpus`, `HIXL_CPUS`, or the set the
    /// thread calling `initialize` could use), as a set: threads the caller starts for the
    /// engine (hixl's Python layers do) should pin themselves there.
    ///
    /// Raises `Failed` before `initialize` and after `finalize`. Does not block.
    fn cpus(&self) -> PyResult<std::collections::BTreeSet<usize>> {
        self.engine.cpus().map(|c| c.into_iter().collect()).map_err(to_py)
    }

    /// Stops the engine and releases what it holds.
    ///
    /// Every pending request fails (FAILED, error `Failed`), links and the listener close,
    /// background connects are waited for (each ends by its own deadline), and all memory is
    /// deregistered: the objects `register` kept alive are released, and `alloc`'d memory is
    /// unmapped once no array refers to it. Before memory may be freed, same-host peers that copy
    /// into it directly must confirm that they dropped it (up to `hixl.deregister_timeout_ms`).
    ///
    /// Takes no arguments and returns None. Idempotent: a second call, or a call on an engine
    /// never initialized, does nothing. Engine calls made afterwards raise `Failed`.
    ///
    /// Raises `Failed` when transfers on a region did not drain or a same-host peer did not
    /// confirm in time; that peer is disconnected and the memory stays allocated (a leak rather
    /// than memory freed under a copy), and the registered objects stay referenced.
    ///
    /// Blocks with the GIL released, bounded by `hixl.deregister_timeout_ms` and the deadlines of
    /// connects still under way (no Ctrl-C check). An engine collected without `finalize` does
    /// the same; a failure there is logged (WARN) and the registered objects are leaked.
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        self.finalize_released(py).map_err(to_py)
    }

    /// Returns the engine itself (`with hixl.Hixl() as e:`).
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Calls `finalize`; returns False, so an exception raised in the block goes on.
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.finalize(py)?;
        Ok(false)
    }

    /// Registers a raw address range of this process, so that peers can READ it (and WRITE it,
    /// unless it is read-only), and returns its `MemHandle`.
    ///
    /// Arguments:
    /// - `desc` (MemDesc): the range, `MemDesc(addr, length)`.
    /// - `mem_type` (MemType, default `MemType.HOST`): where the memory lives. `MemType.DEVICE`:
    ///   CUDA device memory, checked by the driver (it becomes `cuda:N`, `MemHandle.domain`);
    ///   without CUDA it raises `Unsupported` saying CUDA was not found
    ///   (<https://github.com/hixl/hixl/blob/main/docs/DEVICE.md>).
    /// - `access` (str, default "rw"): "rw": peers may READ and WRITE it. "r": peers may only READ
    ///   it; a peer's WRITE into it is refused (`ParamInvalid`).
    /// - `name` (str or None, default None): a name, at most 255 bytes and unique within this
    ///   engine, by which peers find the region (`remote_region`). None or "": unnamed.
    ///
    /// Registering exactly the same range again returns the same handle; it must then have the
    /// same access and name. Peers learn of a new region from the region-table update this engine
    /// sends them. The range must stay mapped memory of this process until it is deregistered (or
    /// the engine finalized), and peers may write it at any time until then: hixl cannot check
    /// that and keeps nothing alive. `register(obj)` does that for an object.
    ///
    /// Raises `ParamInvalid` for a null address, a zero length, a range that is not mapped memory
    /// of this process or that overlaps another region, a name that is taken or too long, the same
    /// range with another access or name, or `access` other than "rw"/"r"; `Unsupported` for a
    /// memory type no backend of `hixl.backends` serves; `ResourceExhausted` when the region table
    /// is full (65,536 regions, or 16 MiB - 64 KiB of entries); `Failed` before `initialize` or
    /// after `finalize`.
    ///
    /// Does not wait for peers; the GIL is released while it registers.
    #[pyo3(
        signature = (desc, mem_type = MemType::HOST, access = Text(String::from("rw")), name = None),
        text_signature = "($self, desc, mem_type=..., access=\"rw\", name=None)"
    )]
    fn register_mem(
        &self,
        py: Python<'_>,
        desc: MemDesc,
        mem_type: MemType,
        access: Text,
        name: Option<Text>,
    ) -> PyResult<MemHandle> {
        let access = hixl_core::Access::parse(&access).map_err(to_py)?;
        self.register_access(py, desc, mem_type.into(), access, name.map(|n| n.0))
    }

    /// Registers the memory of a Python object, keeps the object alive until the region is
    /// deregistered (or the engine finalized), and returns its `MemHandle`.
    ///
    /// Arguments:
    /// - `obj`: an object with a C-contiguous buffer (numpy array, bytearray, memoryview, mmap,
    ///   ...), a contiguous torch CPU tensor, or device memory (a torch CUDA tensor, a CuPy
    ///   array, anything with `__cuda_array_interface__` or a DLPack kDLCUDA capsule, a
    ///   `hixl.cuda_alloc` buffer), which registers as device memory whatever `mem_type` says.
    ///   It must be writable unless `access` is "r".
    /// - `mem_type` (MemType, default `MemType.HOST`): as in `register_mem`.
    /// - `access` (str, default "rw"): "rw": peers may READ and WRITE it. "r": peers may only READ
    ///   it. A read-only buffer (`bytes`, a read-only numpy array) needs "r", and then nothing
    ///   writes it at all: it is not the destination of one of this engine's READs (`get`) either.
    /// - `name` (str or None, default None): as in `register_mem`.
    ///
    /// Registering the same memory again (the same range) returns the same handle; to get the
    /// handle of an `alloc`'d array, register the array (with its `name`, if it has one).
    ///
    /// A buffer cannot be resized while registered (numpy and bytearray refuse while it is
    /// exported). A torch tensor's storage is held as well, so the memory stays when the tensor
    /// is dropped or re-pointed; torch cannot be stopped from resizing it, so never `resize_()`
    /// a registered tensor: once its storage moved, every transfer this engine starts raises
    /// `Failed` saying so, and `deregister_mem` deregisters it and raises `Failed` too.
    ///
    /// Raises `ParamInvalid` for an object without a C-contiguous buffer, an empty one, a
    /// read-only buffer with `access="rw"`, a non-contiguous tensor, and in every case where
    /// `register_mem` does; `Unsupported` for a tensor on a device other than the CPU or CUDA,
    /// and for device memory where CUDA is not found; `ResourceExhausted` and `Failed` as
    /// `register_mem`.
    ///
    /// Does not wait for peers; the GIL is released while it registers.
    #[pyo3(
        signature = (obj, mem_type = MemType::HOST, access = Text(String::from("rw")), name = None),
        text_signature = "($self, obj, mem_type=..., access=\"rw\", name=None)"
    )]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        mem_type: MemType,
        access: Text,
        name: Option<Text>,
    ) -> PyResult<MemHandle> {
        let access = hixl_core::Access::parse(&access).map_err(to_py)?;
        let keep::Exported { addr, len, keep, read_only, domain } =
            buffer::export(obj, access == hixl_core::Access::ReadWrite)?;
        // Device memory registers as such whatever `mem_type` says; host memory as `mem_type`.
        let domain = if domain.is_device() { domain } else { mem_type.into() };
        if len == 0 {
            return Err(errors::param("cannot register an empty buffer (length=0)"));
        }
        // Memory Python promised not to change: nothing hixl does may write it.
        let access = if read_only { hixl_core::Access::Immutable } else { access };
        let h = self.register_access(py, MemDesc { addr, len }, domain, access, name.map(|n| n.0))?;
        self.keep.lock().unwrap().entry((addr, len)).or_insert_with(|| {
            if matches!(&keep, KeepAlive::Tensor(t) if t.checked()) {
                self.tensors.add((addr, len));
            }
            (h.id, keep)
        });
        Ok(h)
    }

    /// Allocates shared memory, registers it read-write, and returns it as a numpy uint8 array.
    ///
    /// Arguments:
    /// - `size` (int): bytes wanted, at least 1. The allocation is rounded up to a multiple of
    ///   2 MiB and starts on a 2 MiB boundary; the array has the rounded length.
    /// - `name` (str or None, default None): as in `register_mem`.
    ///
    /// The memory is zero-filled and memfd-backed (nothing is left in /dev/shm, even after a
    /// crash); same-host peers map it and copy into it directly. Without numpy the result is a
    /// `ShmBuffer` (buffer protocol, `addr`, `len()`). The memory is unmapped once it is
    /// deregistered (or the engine finalized) and nothing refers to it any more. For its
    /// `MemHandle`, call `register(arr)` with the same `name`.
    ///
    /// Raises `ParamInvalid` when `size` is 0 or not an int below 2**64, and for a name as in
    /// `register_mem`; `Failed` when the system refuses the memory, before `initialize` or after
    /// `finalize`; `ResourceExhausted` when the region table is full.
    ///
    /// The GIL is released while it allocates and registers.
    #[pyo3(signature = (size, name = None))]
    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>, name: Option<Text>) -> PyResult<Py<PyAny>> {
        let size = types::uint("size", size)?;
        let name = name.map(|n| n.0).unwrap_or_default();
        let e = self.engine.clone();
        let (h, mem) = py.allow_threads(|| e.alloc_named(size, &name)).map_err(to_py)?;
        let buf = Py::new(py, buffer::ShmBuffer { mem })?;
        self.keep
            .lock()
            .unwrap()
            .insert((h.addr, h.len), (h.id, KeepAlive::Object(buf.clone_ref(py).into_any())));
        match py.import("numpy") {
            Ok(np) => Ok(np.call_method1("frombuffer", (buf, "uint8"))?.unbind()),
            Err(_) => Ok(buf.into_any()),
        }
    }

    /// Deregisters a region: peers' tables lose it, and `register`'s object is released.
    ///
    /// Arguments:
    /// - `handle` (MemHandle): what `register_mem`, `register` or `register(arr)` returned.
    ///
    /// Transfers still using the region are waited for, up to `hixl.deregister_timeout_ms`; then
    /// the links that hold them are aborted. A listening engine also waits (same bound) until every
    /// same-host peer that copies directly has confirmed the new table; only then may the memory be
    /// freed. Idempotent: a handle already deregistered, or unknown, does nothing.
    ///
    /// Returns None. Raises `Failed` when transfers did not drain, or when a same-host peer did not
    /// confirm in time: that peer is disconnected, the memory stays allocated and referenced, and a
    /// retry asks again. Also `Failed` before `initialize` or after `finalize`, and, once the region
    /// is deregistered, when it was a torch tensor resized while registered (see `register`).
    ///
    /// Blocks with the GIL released, up to about `hixl.deregister_timeout_ms` (no Ctrl-C check).
    fn deregister_mem(&self, py: Python<'_>, handle: &MemHandle) -> PyResult<()> {
        let e = self.engine.clone();
        let core = hixl_core::MemHandle {
            id: handle.id,
            addr: handle.addr,
            len: handle.len,
            mem_type: handle.domain,
        };
        py.allow_threads(|| e.deregister_mem(&core)).map_err(to_py)?;
        let released = {
            let mut keep = self.keep.lock().unwrap();
            match keep.get(&(handle.addr, handle.len)) {
                Some((id, _)) if *id == handle.id => keep.remove(&(handle.addr, handle.len)).map(|(_, k)| k),
                _ => None, // a stale handle: the range's keep belongs to a later registration
            }
        };
        let probe = match &released {
            Some(KeepAlive::Tensor(t)) if t.checked() => {
                self.tensors.remove((handle.addr, handle.len));
                t.probe(py)
            }
            _ => None,
        };
        drop(released);
        if let Some((storage, addr, len)) = probe {
            if let Some(why) = keep::moved(py, &storage, addr, len)? {
                return Err(errors::failed(format!("deregistered, but {why}")));
            }
        }
        Ok(())
    }
}

impl Hixl {
    /// Fails when a registered torch tensor that one of `locals` (the local start addresses
    /// of a transfer) falls in was resized (its storage reallocated): the transfer would use
    /// freed memory. Costs one atomic load while no checkable tensor is registered, and checks
    /// only the tensors the transfer touches.
    pub(crate) fn check_tensors(
        &self,
        py: Python<'_>,
        locals: impl IntoIterator<Item = u64>,
    ) -> PyResult<()> {
        let touched = self.tensors.touched(locals);
        if touched.is_empty() {
            return Ok(());
        }
        // Clones taken under the lock, checked without it (the checks call into Python).
        let probes: Vec<_> = {
            let keep = self.keep.lock().unwrap();
            touched
                .iter()
                .filter_map(|key| match keep.get(key) {
                    Some((_, KeepAlive::Tensor(t))) => t.probe(py),
                    _ => None,
                })
                .collect()
        };
        for (storage, addr, len) in &probes {
            if let Some(why) = keep::moved(py, storage, *addr, *len)? {
                return Err(errors::failed(format!("{why}; no transfer is started until it is")));
            }
        }
        Ok(())
    }
}

mod links;
mod notifies;
mod tensors;
mod transfers;

impl Hixl {
    /// What `finalize` does, and what dropping the engine does too (one code path): the core's
    /// finalize with the GIL released (it may wait up to `hixl.deregister_timeout_ms` for
    /// same-host peers to confirm), then, only on success, the registered objects are released.
    /// On error a peer may still access the memory: the objects stay referenced.
    fn finalize_released(&self, py: Python<'_>) -> hixl_core::Result<()> {
        let e = self.engine.clone();
        let r = py.allow_threads(|| e.finalize());
        if r.is_ok() {
            let released = std::mem::take(&mut *self.keep.lock().unwrap());
            self.tensors.clear();
            drop(released);
        }
        r
    }
}

impl Drop for Hixl {
    /// A `Hixl` collected without `finalize` finalizes as `finalize` does (GIL released while
    /// same-host peers confirm). A failure is logged, and the registered objects are then
    /// leaked, never released: a peer that did not confirm may still copy into them.
    fn drop(&mut self) {
        let name = self.engine.local_engine().unwrap_or_default();
        Python::with_gil(|py| {
            if let Err(err) = self.finalize_released(py) {
                // hixl's log takes targets `hixl*` only, and this crate is `_hixl`.
                tracing::warn!(
                    target: "hixl::bindings::engine",
                    engine = %name,
                    error = %err,
                    "a Hixl collected without finalize could not finalize; its registered \
                     memory is leaked (kept referenced), as a peer may still access it"
                );
                let kept = std::mem::take(&mut *self.keep.lock().unwrap());
                std::mem::forget(kept);
            }
        });
    }
}
