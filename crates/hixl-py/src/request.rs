//! `MemHandle` and `TransferReq`, and the GIL-free waits in slices that let Ctrl-C through.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::errors::{self, to_py};
use crate::types::{MemType, TransferStatus};

/// How long one GIL-free wait slice lasts before Python signals (Ctrl-C) are checked.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

pub(crate) fn ms(name: &str, v: Option<crate::args::Millis>) -> PyResult<Option<Duration>> {
    match v.map(|m| m.0) {
        None => Ok(None),
        // Longer than hixl_core::MAX_WAIT (a year) means that long.
        Some(x) if x.is_finite() && x >= 0.0 => {
            Ok(Some(Duration::from_secs_f64((x / 1000.0).min(hixl_core::MAX_WAIT.as_secs_f64()))))
        }
        Some(x) => Err(errors::param(format!("{name}={x} must be a non-negative number of milliseconds"))),
    }
}

/// A region registered on this engine, as `Hixl.register_mem`, `Hixl.register` return it; pass
/// it to `Hixl.deregister_mem`. Read-only attributes: `addr`, `len`, `id`, `mem_type`, `name`,
/// `domain`.
#[pyclass(frozen, module = "hixl._hixl")]
pub struct MemHandle {
    /// Start address of the region in this process.
    #[pyo3(get)]
    pub(crate) addr: u64,
    /// Length of the region in bytes.
    #[pyo3(get)]
    pub(crate) len: u64,
    /// The region's id in this engine's registry (the same range registered again: the same id).
    #[pyo3(get)]
    pub(crate) id: u64,
    /// Where the memory lives (`MemType`).
    #[pyo3(get)]
    pub(crate) mem_type: MemType,
    /// The name it was registered under ("": none).
    #[pyo3(get)]
    pub(crate) name: String,
    /// The memory domain ("host", "cuda:N").
    pub(crate) domain: hixl_core::Domain,
}

#[pymethods]
impl MemHandle {
    /// The memory domain: "host", or "cuda:N" for memory of CUDA device N.
    #[getter]
    fn domain(&self) -> String {
        self.domain.to_string()
    }

    fn __repr__(&self) -> String {
        match self.name.as_str() {
            "" => format!("MemHandle(id={}, addr=0x{:x}, length={})", self.id, self.addr, self.len),
            name => {
                format!(
                    "MemHandle(id={}, addr=0x{:x}, length={}, name={name:?})",
                    self.id, self.addr, self.len
                )
            }
        }
    }
}

/// The process's completion queue for asyncio (`hixl.aio`): one eventfd for every awaited
/// request of every engine.
pub(crate) fn completions() -> PyResult<&'static Arc<hixl_core::CompletionQueue>> {
    static QUEUE: std::sync::OnceLock<Arc<hixl_core::CompletionQueue>> = std::sync::OnceLock::new();
    if let Some(q) = QUEUE.get() {
        return Ok(q);
    }
    let q = Arc::new(hixl_core::CompletionQueue::new().map_err(to_py)?);
    Ok(QUEUE.get_or_init(|| q))
}

/// An asynchronous transfer, as `Hixl.transfer_async`, `put_async`, `get_async` and the strided
/// async calls return it.
///
/// `wait()` blocks (GIL released, Ctrl-C checked) until it ends; `await req` waits on an
/// asyncio event loop instead (see `hixl.aio`); `status()` looks without waiting; `result()`
/// raises its error; `telemetry()` tells how it went. Attributes: `user_data`, `id`, `nbytes`.
/// A request ends COMPLETED, FAILED or TIMEOUT (past its deadline) and never changes after
/// that.
#[pyclass(frozen, module = "hixl._hixl")]
pub struct TransferReq {
    pub(crate) req: hixl_core::TransferReq,
    pub(crate) user_data: Py<PyAny>,
}

/// Waits in GIL-free slices so that Ctrl-C (KeyboardInterrupt) gets through.
pub(crate) fn wait_req(
    py: Python<'_>,
    req: &hixl_core::TransferReq,
    timeout: Option<Duration>,
) -> PyResult<TransferStatus> {
    // Already ended (a same-host copy made on the submitting thread): no second GIL release.
    let now = req.status();
    if now != hixl_core::TransferStatus::Waiting {
        return Ok(now.into());
    }
    let until = timeout.map(|t| Instant::now() + t);
    loop {
        let slice = match until {
            Some(u) => u.saturating_duration_since(Instant::now()).min(SLICE),
            None => SLICE,
        };
        let s = py.allow_threads(|| req.wait(Some(slice)));
        if s != hixl_core::TransferStatus::Waiting {
            return Ok(s.into());
        }
        py.check_signals()?;
        if until.is_some_and(|u| Instant::now() >= u) {
            return Ok(TransferStatus::WAITING);
        }
    }
}

#[pymethods]
impl TransferReq {
    /// Waits until the request has ended, `timeout_ms` has passed, or its deadline has passed,
    /// whichever comes first, and returns its `TransferStatus` then.
    ///
    /// Arguments:
    /// - `timeout_ms` (float or None, default None): how long to wait at most, in milliseconds.
    ///   None: until the request's own deadline (the `timeout_ms` it was submitted with). 0: the
    ///   status now, without waiting.
    ///
    /// Returns WAITING only when `timeout_ms` ran out first; a request past its deadline is
    /// TIMEOUT. Does not raise the request's error (see `result`). Raises `ParamInvalid` for a
    /// negative or non-finite `timeout_ms`. Waits with the GIL released; Ctrl-C raises
    /// `KeyboardInterrupt` within 50 ms (the transfer goes on).
    #[pyo3(signature = (timeout_ms = None))]
    fn wait(&self, py: Python<'_>, timeout_ms: Option<crate::args::Millis>) -> PyResult<TransferStatus> {
        wait_req(py, &self.req, ms("timeout_ms", timeout_ms)?)
    }
    /// `await req`: waits on the running asyncio event loop (no thread, no polling: see
    /// `hixl.aio`); returns None when COMPLETED, raises the request's error otherwise.
    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        py.import("hixl.aio")?.call_method1("wait", (slf,))?.call_method0("__await__")
    }
    /// Internal (hixl.aio): queue `token` on the completion queue when the request settles.
    /// Returns the token that will be queued (the first one asked for, when asked twice), or
    /// None when it had settled already (do not wait for a token).
    fn _report(&self, token: u64) -> PyResult<Option<u64>> {
        Ok(self.req.report_to(completions()?, token))
    }
    /// Internal (hixl.aio): seconds until the request's deadline (0 when it has passed).
    fn _seconds_left(&self) -> f64 {
        self.req.deadline().saturating_duration_since(Instant::now()).as_secs_f64()
    }
    /// What happened to the request, once its I/O has ended (None while in flight): a dict
    /// with `backend` (the one that carried it), `start_unix_us` (when it was submitted, wall
    /// clock), `post_us` (how long the submitting call took to hand it to the backend; more
    /// than `duration_us` when the backend finished it inside that call),
    /// `duration_us` (from submission until its I/O ended), `bytes`, `descs` (descriptors as
    /// given), `status` and `retries` (always 0: hixl does not retry a request).
    fn telemetry<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        let Some(t) = self.req.telemetry() else { return Ok(None) };
        let d = pyo3::types::PyDict::new(py);
        // Wall-clock start: now minus the time since the request was created.
        let age = t.started.elapsed();
        let unix_now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        d.set_item("backend", t.backend)?;
        d.set_item("start_unix_us", unix_now.saturating_sub(age).as_micros() as u64)?;
        d.set_item("post_us", t.post.as_secs_f64() * 1e6)?;
        d.set_item("duration_us", t.duration.as_secs_f64() * 1e6)?;
        d.set_item("bytes", self.req.bytes)?;
        d.set_item("descs", self.req.descs)?;
        d.set_item("status", TransferStatus::from(self.req.status()))?;
        d.set_item("retries", 0)?;
        Ok(Some(d))
    }
    /// The request's `TransferStatus` now, without waiting: WAITING, COMPLETED, FAILED, or
    /// TIMEOUT (a request still WAITING past its deadline turns TIMEOUT here). Takes no arguments.
    fn status(&self) -> TransferStatus {
        self.req.status().into()
    }
    /// Returns None when the request COMPLETED; otherwise raises, without waiting: the request's
    /// error when it FAILED (`ParamInvalid`, `NotConnected`, `Failed`, ...) or timed out
    /// (`Timeout`), and `Timeout` when it is still WAITING. Call `wait()` first. Takes no arguments.
    fn result(&self) -> PyResult<()> {
        self.req.result().map_err(to_py)
    }
    /// The object passed as `user_data` when the request was made (None when none was).
    #[getter]
    fn user_data(&self, py: Python<'_>) -> Py<PyAny> {
        self.user_data.clone_ref(py)
    }
    /// The request's id, unique within its engine.
    #[getter]
    fn id(&self) -> u64 {
        self.req.id
    }
    /// Bytes the request moves (the sum of its descriptors' lengths).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.req.bytes
    }
    fn __repr__(&self) -> String {
        format!("TransferReq(id={}, status={:?})", self.req.id, TransferStatus::from(self.req.status()))
    }
}

/// `Engine::connect` on a thread of its own, so that this one waits in GIL-free slices and
/// lets Ctrl-C through; a connect abandoned that way is disconnected when it ends.
pub(crate) fn connect_interruptibly(
    py: Python<'_>,
    e: &Arc<hixl_core::Engine>,
    remote: &str,
    t: Duration,
) -> PyResult<()> {
    let gate = Arc::new(Mutex::new(false)); // true: the caller gave up
    let (tx, rx) = std::sync::mpsc::channel();
    let (e2, gate2, peer) = (e.clone(), gate.clone(), remote.to_string());
    hixl_core::place::spawn("hixl-py-connect".into(), move || {
        let res = e2.connect(&peer, t);
        let abandoned = gate2.lock().unwrap();
        if *abandoned {
            if res.is_ok() {
                let _ = e2.disconnect(&peer, Duration::ZERO);
            }
        } else {
            let _ = tx.send(res);
        }
    })
    .map_err(|err| errors::failed(format!("cannot start the connect thread: {err}")))?;
    let rx = Mutex::new(rx); // allow_threads needs Sync
    loop {
        match py.allow_threads(|| rx.lock().unwrap().recv_timeout(SLICE)) {
            // A connect that failed while Ctrl-C was pending (on a loaded machine the signal
            // and the failure can land in one slice) raises KeyboardInterrupt, not the failure.
            Ok(Err(e)) => return Err(py.check_signals().err().unwrap_or_else(|| to_py(e))),
            Ok(Ok(())) => return Ok(()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Err(interrupt) = py.check_signals() {
                    let mut abandoned = gate.lock().unwrap();
                    *abandoned = true;
                    // It may have ended just now: then undo it here.
                    if let Ok(Ok(())) = rx.lock().unwrap().try_recv() {
                        let _ = e.disconnect(remote, Duration::ZERO);
                    }
                    return Err(interrupt);
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(errors::failed("the connect thread ended without an answer"))
            }
        }
    }
}
