//! `Hixl`: notifications (send, wait, collect) and per-peer stats.

use super::*;
use crate::args::{Addr, Names};

#[pymethods]
impl Hixl {
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
        remote: Addr,
        notify: NotifyDesc,
        timeout_ms: Option<Millis>,
    ) -> PyResult<()> {
        let e = self.engine.clone();
        let t = match ms("timeout_ms", timeout_ms)? {
            Some(t) => t,
            None => e.default_timeouts().map_err(to_py)?.0,
        };
        py.allow_threads(|| e.send_notify(&remote, notify.into(), t)).map_err(to_py)
    }

    /// Waits until a notification (named `name`, if given) is pending, then returns every pending
    /// one that matches, as a list of `NotifyDesc` in arrival order; the others stay for
    /// `get_notifies`.
    ///
    /// Arguments:
    /// - `timeout_ms` (float, required): how long to wait, in milliseconds. 0: return what is
    ///   pending now, or raise `Timeout`.
    /// - `name` (str, list or tuple of str, or None, default None): only notifications with this
    ///   name (or one of these names); None: any.
    ///
    /// Raises `Timeout` when none came in time; `ParamInvalid` for a negative or non-finite
    /// `timeout_ms` or an empty list of names; `Failed` before `initialize` or after `finalize`.
    ///
    /// Waits with the GIL released; Ctrl-C raises `KeyboardInterrupt` within 50 ms.
    #[pyo3(signature = (timeout_ms, name = None))]
    fn wait_notifies(
        &self,
        py: Python<'_>,
        timeout_ms: Millis,
        name: Option<Names>,
    ) -> PyResult<Vec<NotifyDesc>> {
        let total = ms("timeout_ms", Some(timeout_ms))?.unwrap();
        let timeout_ms = timeout_ms.0;
        let names = match name {
            None => vec![],
            Some(Names::One(n)) => vec![n],
            Some(Names::Many(v)) if v.is_empty() => {
                return Err(to_py(hixl_core::Error::new(
                    hixl_core::Status::ParamInvalid,
                    "name=[] names no notification: give a name, several, or None for any",
                )))
            }
            Some(Names::Many(v)) => v,
        };
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let until = Instant::now() + total;
        let e = self.engine.clone();
        loop {
            let slice = until.saturating_duration_since(Instant::now()).min(SLICE);
            match py.allow_threads(|| e.wait_notifies_any(slice, &names)) {
                Ok(got) => return Ok(got.into_iter().map(Into::into).collect()),
                Err(err) if err.status == hixl_core::Status::Timeout && Instant::now() < until => {
                    py.check_signals()?
                }
                Err(err) if err.status == hixl_core::Status::Timeout => {
                    let what = hixl_core::notifies_waited_for(&names);
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

    /// Internal (the KV executor): a new descriptor, the caller's to close, that becomes
    /// readable after a notification arrives (an eventfd: reading 8 bytes resets it; arrivals
    /// before this call do not count). Raises `Failed` before `initialize` or after `finalize`.
    fn _notify_fd(&self) -> PyResult<i32> {
        use std::os::fd::IntoRawFd;
        Ok(self.engine.notify_fd().map_err(to_py)?.into_raw_fd())
    }

    /// Counters of every peer this engine has a link to, as `{peer: {...}}`.
    ///
    /// Takes no arguments. Each peer's dict holds `backend` (the data path now: "self", "shm",
    /// "cuda_ipc", "rdma" or "tcp"), `not_chosen` (why the backends tried before it were not
    /// taken; "" when it was first), `failovers` (times the data path died while the control
    /// channel lived and the next backend of `hixl.backends` took over: 0 or 1), `failover`
    /// (why: "rdma -> tcp: ..."; "" when it did not), `alive`, `bytes_write`, `bytes_read`,
    /// `ops_write` and `ops_read` (completed requests), `errors` (transfer requests that failed or timed out, counted as they
    /// settle), `notifies` (delivered), `direct_parts` (same-host copies through a mapping of
    /// the peer's `alloc`'d memory), `in_flight` (requests, `send_notify` included, submitted
    /// and not settled; never negative), `queue_slots_used` / `queue_slots` (the link's
    /// request queue; 0 / 0 for "self"), `heartbeat_misses` (intervals in which nothing came
    /// from the peer and it acknowledged nothing but our probes: 0 on a healthy link), `rails`
    /// (rdma over several devices: a list of `device`, `up`, `out_why`, `bytes`, `returns` (times
    /// it came back after being left out) per rail;
    /// empty for other backends) and
    /// `latency_us` (`count`, `avg`, `p50`, `p99`, `max` of recent requests, in
    /// microseconds). `hixl.metrics` exposes the same for Prometheus.
    ///
    /// Raises `Failed` before `initialize` or after `finalize`. Does not block.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for s in self.engine.stats().map_err(to_py)? {
            let d = PyDict::new(py);
            d.set_item("backend", s.backend)?;
            d.set_item("not_chosen", s.not_chosen)?;
            d.set_item("failovers", s.failovers)?;
            d.set_item("failover", s.failover)?;
            d.set_item("alive", s.alive)?;
            d.set_item("bytes_write", s.bytes_write)?;
            d.set_item("bytes_read", s.bytes_read)?;
            d.set_item("ops_write", s.ops_write)?;
            d.set_item("ops_read", s.ops_read)?;
            d.set_item("errors", s.errors)?;
            let by_status = PyDict::new(py);
            for (st, n) in s.errors_by_status.iter().filter(|(_, n)| *n > 0) {
                by_status.set_item(st.name(), n)?;
            }
            d.set_item("errors_by_status", by_status)?;
            d.set_item("notifies", s.notifies)?;
            d.set_item("direct_parts", s.direct_parts)?;
            d.set_item("in_flight", s.in_flight)?;
            d.set_item("queue_slots_used", s.queue_slots.0)?;
            d.set_item("queue_slots", s.queue_slots.1)?;
            d.set_item("heartbeat_misses", s.heartbeat_misses)?;
            let rails = pyo3::types::PyList::empty(py);
            for r in &s.rails {
                let rd = PyDict::new(py);
                rd.set_item("device", &r.device)?;
                rd.set_item("up", r.up)?;
                rd.set_item("out_why", &r.out_why)?;
                rd.set_item("bytes", r.bytes)?;
                rd.set_item("returns", r.returns)?;
                rails.append(rd)?;
            }
            d.set_item("rails", rails)?;
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
