//! `Hixl`, the engine (handles and requests: `request`; descriptor parsing: `descs`). The GIL is released around every call
//! into the core that can block, wait or copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use hixl_core::Engine;

use crate::buffer::{self, KeepAlive};
use crate::descs::parse_descs;
use crate::errors::{self, to_py};
use crate::request::{connect_interruptibly, ms, wait_req, MemHandle, TransferReq, SLICE};
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
/// `hixl.HixlError`. The repository's docs/API.md is the full reference.
#[pyclass(frozen, module = "hixl._hixl", subclass)]
pub struct Hixl {
    pub(crate) engine: Arc<Engine>,
    keep: Mutex<HashMap<(u64, u64), KeepAlive>>,
    /// Requests not yet reported final by the no-argument `get_transfer_status()`.
    unreported: Mutex<Vec<Py<TransferReq>>>,
}

/// Past this many unreported requests, finished ones are forgotten unreported.
const MAX_UNREPORTED: usize = 65536;

fn finish_sync(py: Python<'_>, req: &hixl_core::TransferReq) -> PyResult<()> {
    wait_req(py, req, None)?;
    req.result().map_err(to_py)
}

impl Hixl {
    /// `register_mem` with a parsed access mode.
    fn register_access(
        &self,
        py: Python<'_>,
        desc: MemDesc,
        mem_type: MemType,
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
                unsafe { e.register_named(d, mem_type.into(), access, &name) }
            })
            .map_err(to_py)?;
        Ok(MemHandle { addr: h.addr, len: h.len, id: h.id, mem_type, name })
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
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        timeout_ms: Option<f64>,
    ) -> PyResult<hixl_core::TransferReq> {
        let d = [hixl_core::TransferOpDesc {
            local_addr: types::uint("local_addr", local_addr)?,
            remote_addr: types::uint("remote_addr", remote_addr)?,
            len: types::uint("length", length)?,
        }];
        let t = ms("timeout_ms", timeout_ms)?;
        let e = self.engine.clone();
        py.allow_threads(|| e.transfer_async(remote, op.into(), &d, None, t)).map_err(to_py)
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
        timeout_ms: Option<f64>,
    ) -> PyResult<hixl_core::TransferReq> {
        let lb = types::uint("local_base", local_base)?;
        let rb = types::uint("remote_base", remote_base)?;
        let t = ms("timeout_ms", timeout_ms)?;
        let e = self.engine.clone();
        let d: hixl_core::StridedDesc = desc.into();
        let n = notify.map(Into::into);
        py.allow_threads(|| e.strided_async(remote, op.into(), lb, rb, &d, n, t)).map_err(to_py)
    }
}

#[pymethods]
impl Hixl {
    #[new]
    fn py_new() -> Self {
        Hixl {
            engine: Arc::new(Engine::new()),
            keep: Mutex::new(HashMap::new()),
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
    /// - `options` (dict or None, default None): engine options as `{key: value}`, values str, int
    ///   or bool (`{"hixl.tcp.streams": 4, "hixl.data_mac": True}`; True/False mean "1"/"0").
    ///   `hixl.option_keys()` lists every key with its default and meaning; Huawei HIXL's keys
    ///   (`hixl.hixl_option_keys()`) are accepted too, and `AutoConnect` starts `connect_async`
    ///   to each engine it lists. None: every default.
    ///
    /// Raises `ParamInvalid` for an unknown key, a value of another type or one that does not
    /// parse (the message names the key), or an address that does not parse or cannot be listened
    /// on (in use, for one); `Failed` when the engine is already initialized or was finalized (an
    /// engine does not restart: make a new `Hixl`).
    ///
    /// Returns None. Blocks only while it binds and starts threads, with the GIL released.
    #[pyo3(signature = (local_engine, options = None))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_engine: &str,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let mut opts = HashMap::new();
        for (k, v) in options.map(|d| d.iter()).into_iter().flatten() {
            let key: String =
                k.extract().map_err(|_| errors::param(format!("option key {k} is not a str")))?;
            opts.insert(key.clone(), types::option_text(&key, &v)?);
        }
        let e = self.engine.clone();
        py.allow_threads(|| e.initialize(local_engine, &opts)).map_err(to_py)
    }

    /// This engine's id, the address peers `connect` to: the bound "ip:port" of a listening
    /// engine (the real port when it was started on port 0), or "ip#pid" for a client-only one.
    ///
    /// Raises `Failed` before `initialize` and after `finalize`. Does not block.
    #[getter]
    fn local_engine(&self) -> PyResult<String> {
        self.engine.local_engine().map_err(to_py)
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
    /// connects still under way (no Ctrl-C check).
    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        let e = self.engine.clone();
        let r = py.allow_threads(|| e.finalize());
        if r.is_ok() {
            // On error a peer may still access the memory: the objects stay referenced.
            let released = std::mem::take(&mut *self.keep.lock().unwrap());
            drop(released);
        }
        r.map_err(to_py)
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
    /// - `mem_type` (MemType, default `MemType.HOST`): where the memory lives. `MemType.DEVICE`
    ///   raises `Unsupported`: no backend serves device memory yet.
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
    #[pyo3(signature = (desc, mem_type = MemType::HOST, access = "rw", name = None))]
    fn register_mem(
        &self,
        py: Python<'_>,
        desc: MemDesc,
        mem_type: MemType,
        access: &str,
        name: Option<String>,
    ) -> PyResult<MemHandle> {
        let access = hixl_core::Access::parse(access).map_err(to_py)?;
        self.register_access(py, desc, mem_type, access, name)
    }

    /// Registers the memory of a Python object, keeps the object alive until the region is
    /// deregistered (or the engine finalized), and returns its `MemHandle`.
    ///
    /// Arguments:
    /// - `obj`: an object with a C-contiguous buffer (numpy array, bytearray, memoryview, mmap,
    ///   ...) or a contiguous torch CPU tensor. It must be writable unless `access` is "r".
    /// - `mem_type` (MemType, default `MemType.HOST`): as in `register_mem`.
    /// - `access` (str, default "rw"): "rw": peers may READ and WRITE it. "r": peers may only READ
    ///   it. A read-only buffer (`bytes`, a read-only numpy array) needs "r", and then nothing
    ///   writes it at all: it is not the destination of one of this engine's READs (`get`) either.
    /// - `name` (str or None, default None): as in `register_mem`.
    ///
    /// Registering the same memory again (the same range) returns the same handle; to get the
    /// handle of an `alloc`'d array, register the array (with its `name`, if it has one).
    ///
    /// Raises `ParamInvalid` for an object without a C-contiguous buffer, an empty one, a
    /// read-only buffer with `access="rw"`, a non-contiguous tensor, and in every case where
    /// `register_mem` does; `Unsupported` for a tensor that is not on the CPU or for
    /// `MemType.DEVICE`; `ResourceExhausted` and `Failed` as `register_mem`.
    ///
    /// Does not wait for peers; the GIL is released while it registers.
    #[pyo3(signature = (obj, mem_type = MemType::HOST, access = "rw", name = None))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        mem_type: MemType,
        access: &str,
        name: Option<String>,
    ) -> PyResult<MemHandle> {
        let access = hixl_core::Access::parse(access).map_err(to_py)?;
        let (addr, len, keep, read_only) = buffer::export(obj, access == hixl_core::Access::ReadWrite)?;
        if len == 0 {
            return Err(errors::param("cannot register an empty buffer (length=0)"));
        }
        // Memory Python promised not to change: nothing hixl does may write it.
        let access = if read_only { hixl_core::Access::Immutable } else { access };
        let h = self.register_access(py, MemDesc { addr, len }, mem_type, access, name)?;
        self.keep.lock().unwrap().entry((addr, len)).or_insert(keep);
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
    fn alloc(&self, py: Python<'_>, size: &Bound<'_, PyAny>, name: Option<String>) -> PyResult<Py<PyAny>> {
        let size = types::uint("size", size)?;
        let name = name.unwrap_or_default();
        let e = self.engine.clone();
        let (h, mem) = py.allow_threads(|| e.alloc_named(size, &name)).map_err(to_py)?;
        let buf = Py::new(py, buffer::ShmBuffer { mem })?;
        self.keep.lock().unwrap().insert((h.addr, h.len), KeepAlive::Object(buf.clone_ref(py).into_any()));
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
    /// retry asks again. Also `Failed` before `initialize` or after `finalize`.
    ///
    /// Blocks with the GIL released, up to about `hixl.deregister_timeout_ms` (no Ctrl-C check).
    fn deregister_mem(&self, py: Python<'_>, handle: &MemHandle) -> PyResult<()> {
        let e = self.engine.clone();
        let core = hixl_core::MemHandle {
            id: handle.id,
            addr: handle.addr,
            len: handle.len,
            mem_type: handle.mem_type.into(),
        };
        py.allow_threads(|| e.deregister_mem(&core)).map_err(to_py)?;
        let released = self.keep.lock().unwrap().remove(&(handle.addr, handle.len));
        drop(released);
        Ok(())
    }

    /// Links this engine to the engine listening at `remote` and waits until the link is up.
    ///
    /// Arguments:
    /// - `remote` (str): the peer's "ip:port" (its `local_engine`). This exact string names the
    ///   peer in every later call.
    /// - `timeout_ms` (float or None, default None): how long to try, in milliseconds; refused
    ///   connections are retried until then, so the peer may still be starting. None: the engine's
    ///   `hixl.connect_timeout_ms` (default 3000). 0: no time at all (`Timeout`).
    ///
    /// A link is a TCP control channel (handshake, the peer's region table, notifications,
    /// heartbeats) plus a data path, from the first backend of `hixl.backends` that can serve the
    /// peer. A link that died is replaced by a new `connect`.
    ///
    /// Returns None. Raises `ParamInvalid` for an address that does not parse; `AlreadyConnected`
    /// when a live link or a connect to `remote` exists; `Timeout` when nobody answered in time;
    /// `NotConnected` for any other failure (a refused handshake, a missing or different cluster
    /// secret, ...); `Unsupported` when no backend of `hixl.backends` can reach the peer; `Failed`
    /// before `initialize`, after `finalize`, or when the engine was finalized meanwhile.
    ///
    /// Waits with the GIL released; Ctrl-C raises `KeyboardInterrupt` within 50 ms, and a connect
    /// given up that way is disconnected when it ends.
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn connect(&self, py: Python<'_>, remote: &str, timeout_ms: Option<f64>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.1,
        };
        connect_interruptibly(py, &e, remote, t)
    }

    /// Closes the link to `remote`.
    ///
    /// Arguments:
    /// - `remote` (str): the peer, as given to `connect`.
    /// - `timeout_ms` (float or None, default None): how long to wait for the transfers already
    ///   submitted to `remote` to end before closing. None: the engine's
    ///   `hixl.transfer_timeout_ms` (default 10000). 0: close at once.
    ///
    /// New transfers to `remote` are refused (`NotConnected`) from the start of the call; requests
    /// still pending when the link closes fail with `NotConnected`. Afterwards
    /// `get_async_connect_status(remote)` is NOT_CONNECT.
    ///
    /// Returns None, also for a link whose `connect_async` had failed. Raises `NotConnected` when
    /// there is no link to `remote`; `Failed` while a connect to it is in progress, and before
    /// `initialize` or after `finalize`.
    ///
    /// Blocks up to `timeout_ms` with the GIL released (no Ctrl-C check).
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn disconnect(&self, py: Python<'_>, remote: &str, timeout_ms: Option<f64>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.0,
        };
        py.allow_threads(|| e.disconnect(remote, t)).map_err(to_py)
    }

    /// Starts a connect to `remote` in the background and returns at once.
    ///
    /// Arguments:
    /// - `remote` (str): the peer's "ip:port", as for `connect`.
    ///
    /// The connect tries for the engine's `hixl.connect_timeout_ms`. Poll
    /// `get_async_connect_status(remote)`: CONNECTING, then CONNECTED or CONNECT_FAILED (the error
    /// is logged as a WARN). `finalize` waits for connects still under way.
    ///
    /// Returns None. Raises `ParamInvalid` for an address that does not parse; `AlreadyConnected`
    /// when a live link or a connect to `remote` exists; `Failed` before `initialize`, after
    /// `finalize`, or when no thread can be started. Does not block.
    fn connect_async(&self, remote: &str) -> PyResult<()> {
        self.engine.connect_async(remote).map_err(to_py)
    }

    /// The state of this engine's link to `remote`, as an `AsyncConnectStatus`.
    ///
    /// Arguments:
    /// - `remote` (str): the peer, as given to `connect` or `connect_async`.
    ///
    /// NOT_CONNECT: never connected, disconnected, or a synchronous `connect` that failed.
    /// CONNECTING: a connect is under way. CONNECTED: linked and alive. CONNECT_FAILED: a
    /// `connect_async` failed, or the link died.
    ///
    /// Raises `Failed` before `initialize` or after `finalize`. Does not block.
    fn get_async_connect_status(&self, remote: &str) -> PyResult<AsyncConnectStatus> {
        self.engine.get_async_connect_status(remote).map(Into::into).map_err(to_py)
    }

    /// The regions `remote` has registered, as a list of `MemDesc` sorted by address: the peer's
    /// regions as of the last region-table update this engine received.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    ///
    /// The peer sends its whole table when the link is made and an update after every
    /// registration and deregistration; a transfer or `remote_region` that misses a range or name
    /// asks for the current table once. A region the peer registered a moment ago may therefore be
    /// missing here. `remote_regions` gives the same regions with names and access.
    ///
    /// Raises `NotConnected` when `remote` is not connected or its link died; `Failed` before
    /// `initialize` or after `finalize`. No network round trip; does not block.
    fn remote_mems(&self, remote: &str) -> PyResult<Vec<MemDesc>> {
        let v = self.engine.remote_mems(remote).map_err(to_py)?;
        Ok(v.into_iter().map(|m| MemDesc { addr: m.addr, len: m.len }).collect())
    }

    /// The regions `remote` has registered, as a list of `RemoteRegion` (address, length, name,
    /// memory type, whether this engine may WRITE it) sorted by address: the peer's regions as of
    /// the last region-table update this engine received.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    ///
    /// See `remote_mems` for when updates arrive. Raises `NotConnected` when `remote` is not
    /// connected or its link died; `Failed` before `initialize` or after `finalize`. No network
    /// round trip; does not block.
    fn remote_regions(&self, remote: &str) -> PyResult<Vec<RemoteRegion>> {
        let v = self.engine.remote_regions(remote).map_err(to_py)?;
        Ok(v.into_iter().map(RemoteRegion::from).collect())
    }

    /// The `RemoteRegion` that `remote` registered under `name`.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `name` (str): the name the peer gave `register`, `register_mem` or `alloc`.
    ///
    /// It is looked up in the peer's regions as of the last region-table update this engine
    /// received; a name missing there is asked for once (one round trip, bounded by
    /// `hixl.handshake_timeout_ms`), so a region the peer registered a moment ago is found.
    ///
    /// Raises `ParamInvalid` naming it when the peer has no region of that name; `NotConnected`
    /// when `remote` is not connected or its link died; `Failed` before `initialize` or after
    /// `finalize`. The GIL is released while it asks (no Ctrl-C check).
    fn remote_region(&self, py: Python<'_>, remote: &str, name: &str) -> PyResult<RemoteRegion> {
        let e = self.engine.clone();
        py.allow_threads(|| e.remote_region(remote, name)).map(RemoteRegion::from).map_err(to_py)
    }

    /// Runs one batch of transfers with `remote` and waits until it has ended.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `op` (TransferOp): `TransferOp.WRITE` copies local -> remote, `TransferOp.READ` remote ->
    ///   local.
    /// - `descs`: the batch: a list or tuple of `TransferOpDesc` or of `(local_addr, remote_addr,
    ///   length)` triples of ints (numpy integer scalars too), or an (N, 3) numpy array of any
    ///   integer dtype (uint64 in C order is read without a copy). Each range must lie inside one
    ///   registered region: the local one in this engine's, the remote one in the peer's regions
    ///   as of the last region-table update this engine received (a miss asks the peer for its
    ///   current table once). Adjacent descriptors are merged.
    /// - `timeout_ms` (float or None, default None): the request's deadline in milliseconds.
    ///   None: the engine's `hixl.transfer_timeout_ms` (default 10000). 0: the deadline is the
    ///   moment of submission, so the request times out unless it completed while being submitted.
    ///
    /// Returns None once every byte is at its destination. Raises `ParamInvalid` for an empty
    /// batch, a malformed descriptor, a zero length, a range outside the registered regions, a
    /// WRITE into a read-only region, a READ into a read-only buffer, or a range the target
    /// refused; `NotConnected` when `remote` is not connected or the link died; `Timeout` when the
    /// deadline passed; `ResourceExhausted` when the link's request queue is full
    /// (`hixl.queue_depth`); `Failed` when the engine was finalized meanwhile, before `initialize`
    /// or after `finalize`.
    ///
    /// Waits with the GIL released; Ctrl-C raises `KeyboardInterrupt` within 50 ms, and the
    /// transfer goes on until it ends or its deadline passes.
    #[pyo3(signature = (remote, op, descs, timeout_ms = None))]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        remote: &str,
        op: TransferOp,
        descs: &Bound<'_, PyAny>,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let t = ms("timeout_ms", timeout_ms)?;
        let d = parse_descs(descs)?;
        let e = self.engine.clone();
        let req = py.allow_threads(|| e.transfer_async(remote, op.into(), &d, None, t)).map_err(to_py)?;
        finish_sync(py, &req)
    }

    /// Validates and queues one batch of transfers with `remote`, and returns its `TransferReq`
    /// at once.
    ///
    /// Arguments:
    /// - `remote` (str), `op` (TransferOp), `descs`: as in `transfer_sync`.
    /// - `user_data` (any object, default None): kept on the request (`req.user_data`) and
    ///   reported by the no-argument `get_transfer_status()`.
    /// - `notify` (NotifyDesc or None, default None): a notification the peer receives after every
    ///   byte of the batch is at its destination; the request is COMPLETED only once the peer has
    ///   it. A failed batch sends none.
    /// - `timeout_ms` (float or None, default None): the request's deadline, as in
    ///   `transfer_sync` (None: `hixl.transfer_timeout_ms`).
    ///
    /// Errors found while submitting are raised here: `ParamInvalid` (the batch, or a notify name
    /// over 1,024 bytes or msg over 1 MiB), `NotConnected`, `ResourceExhausted` (queue full) and
    /// `Failed`, as in `transfer_sync`. Later failures show in `req.status()` / `req.wait()`
    /// (FAILED or TIMEOUT), and `req.result()` raises them.
    ///
    /// Does not wait for the transfer; the GIL is released while it submits.
    #[pyo3(signature = (remote, op, descs, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_async(
        &self,
        py: Python<'_>,
        remote: &str,
        op: TransferOp,
        descs: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<f64>,
    ) -> PyResult<Py<TransferReq>> {
        let t = ms("timeout_ms", timeout_ms)?;
        let d = parse_descs(descs)?;
        let e = self.engine.clone();
        let n = notify.map(Into::into);
        let req = py.allow_threads(|| e.transfer_async(remote, op.into(), &d, n, t)).map_err(to_py)?;
        self.track(py, req, user_data)
    }

    /// One-sided WRITE of one contiguous range: `length` bytes from `local_addr` here to
    /// `remote_addr` at `remote`; waits until they are there.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_addr` (int): the source, inside a region registered on this engine.
    /// - `remote_addr` (int): the destination, inside a region the peer registered read-write.
    /// - `length` (int): bytes, at least 1.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// `transfer_sync(remote, TransferOp.WRITE, [(local_addr, remote_addr, length)], timeout_ms)`
    /// in one call: same return, errors and blocking (GIL released, Ctrl-C checked).
    #[pyo3(signature = (remote, local_addr, remote_addr, length, timeout_ms = None))]
    fn put(
        &self,
        py: Python<'_>,
        remote: &str,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let req = self.one(py, remote, TransferOp::WRITE, local_addr, remote_addr, length, timeout_ms)?;
        finish_sync(py, &req)
    }

    /// One-sided READ of one contiguous range: `length` bytes from `remote_addr` at `remote` to
    /// `local_addr` here; waits until they are here.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_addr` (int): the destination, inside a writable region registered on this engine.
    /// - `remote_addr` (int): the source, inside a region the peer registered.
    /// - `length` (int): bytes, at least 1.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// `transfer_sync(remote, TransferOp.READ, [(local_addr, remote_addr, length)], timeout_ms)`
    /// in one call: same return, errors and blocking (GIL released, Ctrl-C checked).
    #[pyo3(signature = (remote, local_addr, remote_addr, length, timeout_ms = None))]
    fn get(
        &self,
        py: Python<'_>,
        remote: &str,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let req = self.one(py, remote, TransferOp::READ, local_addr, remote_addr, length, timeout_ms)?;
        finish_sync(py, &req)
    }

    /// Asynchronous `put`: queues the WRITE and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_addr`, `remote_addr`, `length`, `timeout_ms`: as in `put`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async` with one descriptor.
    #[pyo3(signature = (remote, local_addr, remote_addr, length, user_data = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn put_async(
        &self,
        py: Python<'_>,
        remote: &str,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        timeout_ms: Option<f64>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.one(py, remote, TransferOp::WRITE, local_addr, remote_addr, length, timeout_ms)?;
        self.track(py, req, user_data)
    }

    /// Asynchronous `get`: queues the READ and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_addr`, `remote_addr`, `length`, `timeout_ms`: as in `get`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async` with one descriptor.
    #[pyo3(signature = (remote, local_addr, remote_addr, length, user_data = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn get_async(
        &self,
        py: Python<'_>,
        remote: &str,
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        user_data: Option<Py<PyAny>>,
        timeout_ms: Option<f64>,
    ) -> PyResult<Py<TransferReq>> {
        let req = self.one(py, remote, TransferOp::READ, local_addr, remote_addr, length, timeout_ms)?;
        self.track(py, req, user_data)
    }

    /// Strided WRITE: `desc.count` elements of `desc.size` bytes, element i from
    /// `local_base + i * desc.stride` here to `remote_base + i * remote_stride` at `remote`
    /// (`remote_stride` defaults to `desc.stride`); waits until they are there.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `local_base` (int): address of element 0 here.
    /// - `remote_base` (int): address of element 0 at the peer.
    /// - `desc` (StridedDesc): the elements. Rules: count >= 1, size >= 1, each stride >= size;
    ///   bases and strides multiples of 64 bytes unless `hixl.strict_alignment=0`; the whole
    ///   strided range inside one registered region on each side.
    /// - `timeout_ms` (float or None, default None): the deadline, as in `transfer_sync` (None:
    ///   `hixl.transfer_timeout_ms`).
    ///
    /// One request and one descriptor on the wire, whatever `desc.count` is. Returns None; raises
    /// `ParamInvalid` naming the field for a broken rule, otherwise as `transfer_sync`. Waits with
    /// the GIL released, Ctrl-C checked.
    #[pyo3(signature = (remote, local_base, remote_base, desc, timeout_ms = None))]
    fn put_strided(
        &self,
        py: Python<'_>,
        remote: &str,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let req =
            self.strided(py, remote, TransferOp::WRITE, local_base, remote_base, desc, None, timeout_ms)?;
        finish_sync(py, &req)
    }

    /// Strided READ: `desc.count` elements of `desc.size` bytes, element i from
    /// `remote_base + i * remote_stride` at `remote` to `local_base + i * desc.stride` here
    /// (`remote_stride` defaults to `desc.stride`); waits until they are here.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `put_strided` (the
    ///   local range must be writable).
    ///
    /// Returns None; errors and blocking as `put_strided`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, timeout_ms = None))]
    fn get_strided(
        &self,
        py: Python<'_>,
        remote: &str,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let req =
            self.strided(py, remote, TransferOp::READ, local_base, remote_base, desc, None, timeout_ms)?;
        finish_sync(py, &req)
    }

    /// Asynchronous `put_strided`: queues the strided WRITE and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `put_strided`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    /// - `notify` (NotifyDesc or None, default None): reaches the peer after every byte, as in
    ///   `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn put_strided_async(
        &self,
        py: Python<'_>,
        remote: &str,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<f64>,
    ) -> PyResult<Py<TransferReq>> {
        let req =
            self.strided(py, remote, TransferOp::WRITE, local_base, remote_base, desc, notify, timeout_ms)?;
        self.track(py, req, user_data)
    }

    /// Asynchronous `get_strided`: queues the strided READ and returns its `TransferReq` at once.
    ///
    /// Arguments:
    /// - `remote`, `local_base`, `remote_base`, `desc`, `timeout_ms`: as in `get_strided`.
    /// - `user_data` (any object, default None): as in `transfer_async`.
    /// - `notify` (NotifyDesc or None, default None): sent to the peer once the bytes are here,
    ///   as in `transfer_async`.
    ///
    /// Errors and behaviour as `transfer_async`.
    #[pyo3(signature = (remote, local_base, remote_base, desc, user_data = None, notify = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn get_strided_async(
        &self,
        py: Python<'_>,
        remote: &str,
        local_base: &Bound<'_, PyAny>,
        remote_base: &Bound<'_, PyAny>,
        desc: StridedDesc,
        user_data: Option<Py<PyAny>>,
        notify: Option<NotifyDesc>,
        timeout_ms: Option<f64>,
    ) -> PyResult<Py<TransferReq>> {
        let req =
            self.strided(py, remote, TransferOp::READ, local_base, remote_base, desc, notify, timeout_ms)?;
        self.track(py, req, user_data)
    }

    /// Statuses of asynchronous requests, without waiting.
    ///
    /// Arguments:
    /// - `req` (TransferReq, list of TransferReq, or None; default None): one request gives its
    ///   `TransferStatus`; a list (or other iterable) gives a list of statuses, in order. None
    ///   gives `[(user_data, status), ...]` for every request this engine's async calls made that
    ///   was still in flight at the previous no-argument call or is newer: each final status is
    ///   reported once, and WAITING ones again next time. (Past 65,536 such requests, finished ones
    ///   not yet reported are dropped.)
    ///
    /// A WAITING request past its deadline reports TIMEOUT. Raises `ParamInvalid` when a list
    /// holds something other than a `TransferReq` (`TypeError` for an argument that is neither
    /// a request nor iterable). Does not block.
    #[pyo3(signature = (req = None))]
    fn get_transfer_status(&self, py: Python<'_>, req: Option<&Bound<'_, PyAny>>) -> PyResult<Py<PyAny>> {
        let Some(req) = req else {
            let mut out = Vec::new();
            self.unreported.lock().unwrap().retain(|r| {
                let r = r.get();
                let s = r.req.status();
                out.push((r.user_data.clone_ref(py), TransferStatus::from(s)));
                s == hixl_core::TransferStatus::Waiting
            });
            return Ok(out.into_pyobject(py)?.into_any().unbind());
        };
        if let Ok(r) = req.downcast::<TransferReq>() {
            let s: TransferStatus = r.get().req.status().into();
            return Ok(s.into_pyobject(py)?.into_any().unbind());
        }
        let mut out = Vec::new();
        for item in req.try_iter()? {
            let item = item?;
            let r =
                item.downcast::<TransferReq>().map_err(|_| errors::param("expected TransferReq items"))?;
            out.push(TransferStatus::from(r.get().req.status()));
        }
        Ok(out.into_pyobject(py)?.into_any().unbind())
    }

    /// Sends a notification to `remote` once every transfer submitted to it before this call has
    /// ended (completed or failed), and waits until the peer has it.
    ///
    /// Arguments:
    /// - `remote` (str): a connected peer.
    /// - `notify` (NotifyDesc): `name` at most 1,024 bytes, `msg` at most 1 MiB. The peer gets it
    ///   from `get_notifies` or `wait_notifies`.
    /// - `timeout_ms` (float or None, default None): bounds both the wait for the earlier
    ///   transfers and the delivery. None: the engine's `hixl.transfer_timeout_ms` (default
    ///   10000). 0: `Timeout` if an earlier transfer is still in flight (the delivery itself
    ///   still gets 1 ms).
    ///
    /// Returns None. Raises `Timeout` when an earlier transfer was still in flight or the peer did
    /// not confirm in time; `NotifyFailed` when the link died or lost the notification;
    /// `NotConnected` when `remote` is not connected (never, or disconnected); `ResourceExhausted`
    /// when the peer already holds `hixl.max_notifies` of ours (or another of its notification
    /// limits is full); `ParamInvalid` for a name or msg over its limit; `Failed` before
    /// `initialize` or after `finalize`.
    ///
    /// Blocks with the GIL released, up to `timeout_ms` (no Ctrl-C check).
    #[pyo3(signature = (remote, notify, timeout_ms = None))]
    fn send_notify(
        &self,
        py: Python<'_>,
        remote: &str,
        notify: NotifyDesc,
        timeout_ms: Option<f64>,
    ) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.0,
        };
        py.allow_threads(|| e.send_notify(remote, notify.into(), t)).map_err(to_py)
    }

    /// Waits until a notification (named `name`, if given) is pending, then returns every pending
    /// one that matches, as a list of `NotifyDesc`; the others stay for `get_notifies`.
    ///
    /// Arguments:
    /// - `timeout_ms` (float, required): how long to wait, in milliseconds. 0: return what is
    ///   pending now, or raise `Timeout`.
    /// - `name` (str or None, default None): only notifications with this name; None: any.
    ///
    /// Raises `Timeout` when none came in time; `ParamInvalid` for a negative or non-finite
    /// `timeout_ms`; `Failed` before `initialize` or after `finalize`.
    ///
    /// Waits with the GIL released; Ctrl-C raises `KeyboardInterrupt` within 50 ms.
    #[pyo3(signature = (timeout_ms, name = None))]
    fn wait_notifies(
        &self,
        py: Python<'_>,
        timeout_ms: f64,
        name: Option<String>,
    ) -> PyResult<Vec<NotifyDesc>> {
        let total = ms("timeout_ms", Some(timeout_ms))?.unwrap();
        let until = Instant::now() + total;
        let e = self.engine.clone();
        loop {
            let slice = until.saturating_duration_since(Instant::now()).min(SLICE);
            match py.allow_threads(|| e.wait_notifies(slice, name.as_deref())) {
                Ok(got) => return Ok(got.into_iter().map(Into::into).collect()),
                Err(err) if err.status == hixl_core::Status::Timeout && Instant::now() < until => {
                    py.check_signals()?
                }
                Err(err) if err.status == hixl_core::Status::Timeout => {
                    let what = name
                        .as_deref()
                        .map_or("notification".to_string(), |n| format!("notification named {n:?}"));
                    return Err(to_py(hixl_core::Error::timeout(format!(
                        "no {what} arrived within timeout_ms={timeout_ms}"
                    ))));
                }
                Err(err) => return Err(to_py(err)),
            }
        }
    }

    /// Returns and clears the notifications this engine has received from all peers, as a list
    /// of `NotifyDesc` in arrival order (empty when none is pending).
    ///
    /// Takes no arguments. Raises `Failed` before `initialize` or after `finalize`. Does not block;
    /// `wait_notifies` waits for one.
    fn get_notifies(&self) -> PyResult<Vec<NotifyDesc>> {
        Ok(self.engine.get_notifies().map_err(to_py)?.into_iter().map(Into::into).collect())
    }

    /// Counters of every peer this engine has a link to, as `{peer: {...}}`.
    ///
    /// Takes no arguments. Each peer's dict holds `backend` (the data path: "self", "shm" or
    /// "tcp"), `not_chosen` (why the backends tried before it were not taken; "" when it was
    /// first), `alive`, `bytes_write`, `bytes_read`, `ops_write` and `ops_read` (completed
    /// requests), `errors` (failed or timed-out requests), `notifies` (sent), `direct_parts`
    /// (same-host copies through a mapping of the peer's `alloc`'d memory) and `latency_us`
    /// (`count`, `avg`, `p50`, `p99`, `max` of recent requests, in microseconds).
    ///
    /// Raises `Failed` before `initialize` or after `finalize`. Does not block.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for s in self.engine.stats().map_err(to_py)? {
            let d = PyDict::new(py);
            d.set_item("backend", s.backend)?;
            d.set_item("not_chosen", s.not_chosen)?;
            d.set_item("alive", s.alive)?;
            d.set_item("bytes_write", s.bytes_write)?;
            d.set_item("bytes_read", s.bytes_read)?;
            d.set_item("ops_write", s.ops_write)?;
            d.set_item("ops_read", s.ops_read)?;
            d.set_item("errors", s.errors)?;
            d.set_item("notifies", s.notifies)?;
            d.set_item("direct_parts", s.direct_parts)?;
            let l = PyDict::new(py);
            l.set_item("count", s.latency.count)?;
            l.set_item("avg", s.latency.avg_us)?;
            l.set_item("p50", s.latency.p50_us)?;
            l.set_item("p99", s.latency.p99_us)?;
            l.set_item("max", s.latency.max_us)?;
            d.set_item("latency_us", l)?;
            out.set_item(s.peer, d)?;
        }
        Ok(out)
    }
}
