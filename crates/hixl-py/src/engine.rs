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

/// The engine: one per process is typical.
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

    /// Starts the engine: "ip:port" listens (port 0 = ephemeral), "ip" alone is client only.
    /// Option values may be str, int or bool (`{"hixl.tcp.streams": 4, "hixl.data_mac": True}`).
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

    /// The bound "ip:port".
    #[getter]
    fn local_engine(&self) -> PyResult<String> {
        self.engine.local_engine().map_err(to_py)
    }

    /// Stops the engine; pending requests fail, memory is deregistered. Idempotent.
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

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.finalize(py)?;
        Ok(false)
    }

    /// Registers a raw range. `access="r"` lets peers READ it but never WRITE it; `name`
    /// (unique within this engine) lets peers find it with `remote_region`. The range must
    /// stay valid memory of this process until it is deregistered: `register(obj)` keeps the
    /// object alive for you.
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

    /// Registers the memory of a buffer (numpy, bytearray, memoryview, mmap) or a torch CPU
    /// tensor, keeping the object alive until deregistration. `access="r"`: read-only for
    /// peers. A read-only buffer (`bytes`, a read-only numpy array) needs `access="r"`, and then
    /// nothing writes it: it is never the local destination of a READ/get either. `name`: see
    /// `register_mem`.
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

    /// Allocates `size` bytes of shared memory (memfd, 2 MiB aligned, rounded up to 2 MiB),
    /// registers it and returns it as a numpy uint8 array (a `ShmBuffer` if numpy is missing).
    /// Freed once deregistered (or finalized) and no longer referenced.
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

    /// Deregisters; waits for (then aborts) transfers using the region. Idempotent.
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

    /// Connects to the engine at `remote` ("ip:port"); `timeout_ms=None`: the engine's
    /// `hixl.connect_timeout_ms`.
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn connect(&self, py: Python<'_>, remote: &str, timeout_ms: Option<f64>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.1,
        };
        connect_interruptibly(py, &e, remote, t)
    }

    /// Closes the link to `remote` after waiting up to `timeout_ms` (None: the engine's
    /// `hixl.transfer_timeout_ms`; 0: not at all) for the transfers already submitted to it.
    #[pyo3(signature = (remote, timeout_ms = None))]
    fn disconnect(&self, py: Python<'_>, remote: &str, timeout_ms: Option<f64>) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.0,
        };
        py.allow_threads(|| e.disconnect(remote, t)).map_err(to_py)
    }

    /// Starts a connect in the background.
    fn connect_async(&self, remote: &str) -> PyResult<()> {
        self.engine.connect_async(remote).map_err(to_py)
    }

    /// State of the connect to `remote`.
    fn get_async_connect_status(&self, remote: &str) -> PyResult<AsyncConnectStatus> {
        self.engine.get_async_connect_status(remote).map(Into::into).map_err(to_py)
    }

    /// The peer's regions, as of its last region-table update.
    fn remote_mems(&self, remote: &str) -> PyResult<Vec<MemDesc>> {
        let v = self.engine.remote_mems(remote).map_err(to_py)?;
        Ok(v.into_iter().map(|m| MemDesc { addr: m.addr, len: m.len }).collect())
    }

    /// The peer's regions with their names, memory types and access.
    fn remote_regions(&self, remote: &str) -> PyResult<Vec<RemoteRegion>> {
        let v = self.engine.remote_regions(remote).map_err(to_py)?;
        Ok(v.into_iter().map(RemoteRegion::from).collect())
    }

    /// The peer's region registered under `name` (asks the peer once when it is not in the
    /// table yet); PARAM_INVALID when there is none.
    fn remote_region(&self, py: Python<'_>, remote: &str, name: &str) -> PyResult<RemoteRegion> {
        let e = self.engine.clone();
        py.allow_threads(|| e.remote_region(remote, name)).map(RemoteRegion::from).map_err(to_py)
    }

    /// Runs a batch and waits for it.
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

    /// Queues a batch and returns at once. `notify` reaches the peer after the bytes do.
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

    /// One-sided WRITE of `length` bytes.
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

    /// One-sided READ of `length` bytes.
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

    /// Asynchronous `put`.
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

    /// Asynchronous `get`.
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

    /// Strided WRITE: one request, one descriptor, whatever `desc.count` is.
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

    /// Strided READ.
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

    /// Asynchronous `put_strided`; `notify` arrives after the bytes.
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

    /// Asynchronous `get_strided`.
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

    /// Status of one request; a list of statuses for a list of requests; with no argument,
    /// `[(user_data, status), ...]` for every request still in flight or finished since the
    /// previous no-argument call (each final status is reported once).
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

    /// Sends a notification after every earlier transfer to the peer has landed.
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

    /// Waits (GIL released, Ctrl-C gets through) up to `timeout_ms` for a notification, named
    /// `name` when given, and returns every pending one that matches; the others stay for
    /// `get_notifies`. Raises Timeout when none came in time.
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
                        .map_or("a notification".to_string(), |n| format!("a notification named {n:?}"));
                    return Err(to_py(hixl_core::Error::timeout(format!(
                        "no {what} arrived within timeout_ms={timeout_ms}"
                    ))));
                }
                Err(err) => return Err(to_py(err)),
            }
        }
    }

    /// Returns and clears the notifications received.
    fn get_notifies(&self) -> PyResult<Vec<NotifyDesc>> {
        Ok(self.engine.get_notifies().map_err(to_py)?.into_iter().map(Into::into).collect())
    }

    /// Per-peer counters: {peer: {backend, alive, bytes_write, ..., latency_us: {...}}}.
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
