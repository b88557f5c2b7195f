//! Transfers: batches, one-sided helpers, strided descriptors, notifications, stats.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::types::{PeerSnapshot, StridedDesc, TransferOpDesc, TransferReq, Waiting};
use super::validate::{
    route, serves, split_bodies, validate, validate_strided, with_fresh_table, DomainPairs,
};
use super::{Engine, PeerConn, PeerSlot, Running};
use crate::error::{Error, Result, Status};
use crate::queue::{NotifyDesc, Part, PartBody, Request, TransferOp, TransferStatus};
use crate::registry::Pin;
use crate::transport::DataPath;
use crate::wire::Domain;

impl Engine {
    /// Runs a batch and waits for it (up to `timeout`).
    pub fn transfer_sync(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        timeout: Duration,
    ) -> Result<()> {
        let req = self.submit_transfer(remote, op, descs, None, Some(timeout), Waiting::Now)?;
        req.wait(None);
        req.result()
    }

    /// Validates and queues a batch; returns at once. `notify` is delivered to the peer after
    /// all of the batch's bytes are there. `timeout` (default `hixl.transfer_timeout_ms`) is the
    /// request's deadline.
    pub fn transfer_async(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        self.submit_transfer(remote, op, descs, notify, timeout, Waiting::Later)
    }

    /// `transfer_async`, saying when the caller will wait for the request (see [`Waiting`]):
    /// a synchronous call built on this passes `Waiting::Now`.
    pub fn submit_transfer(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
        waiting: Waiting,
    ) -> Result<TransferReq> {
        self.transfer_or_not(remote, op, descs, notify, timeout, waiting, Ask::Peer)?
            .ok_or_else(|| Error::failed("a submission that may ask the peer stopped short"))
    }

    /// `submit_transfer` with `Waiting::Now`, for a caller that holds a lock its process's
    /// other threads need (Python's GIL) while it submits and waits a moment: it submits only
    /// where that needs nothing from the network. Where it would (a remote range missing from
    /// the peer's region table as last received, or a backend still to open), it returns None
    /// having done nothing, and the caller submits again with the lock released.
    pub fn try_submit_held(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        timeout: Option<Duration>,
    ) -> Result<Option<TransferReq>> {
        self.transfer_or_not(remote, op, descs, None, timeout, Waiting::Now, Ask::Never)
    }

    #[allow(clippy::too_many_arguments)]
    fn transfer_or_not(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
        waiting: Waiting,
        ask: Ask,
    ) -> Result<Option<TransferReq>> {
        let timeout = timeout.map(crate::wait::capped);
        let r = self.running()?;
        let ready = (|| {
            let conn = Self::conn(&r, remote)?;
            if descs.is_empty() {
                return Err(Error::param("the descriptor list is empty"));
            }
            if let Some(n) = &notify {
                check_notify(n)?;
            }
            let write = op == TransferOp::Write;
            let mut pairs = DomainPairs::default();
            let found = table_check(&r, &conn, ask, |miss| {
                pairs.clear();
                validate(&r, &conn, remote, descs, write, miss, &mut pairs)
            })?;
            let Some((segs, pins, bytes)) = found else { return Ok(None) };
            let Some(link) = path_asking(&conn, remote, &pairs, ask)? else { return Ok(None) };
            let bodies = split_bodies(segs, bytes, link.parallelism(), r.opts.split_bytes);
            let batch = Batch { bodies, device: touches_device(&pairs), waiting, link };
            Ok(Some((conn, batch, bytes, pins)))
        })();
        let ready = ready.inspect_err(|e| count_refusal(&r, remote, op, e))?;
        let Some((conn, batch, bytes, pins)) = ready else { return Ok(None) };
        self.submit(&r, &conn, op, batch, bytes, descs.len(), pins, notify, timeout).map(Some)
    }

    /// Makes the request for a validated batch and queues its parts on the peer's link.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        r: &Running,
        conn: &PeerConn,
        op: TransferOp,
        Batch { bodies, device, waiting, link }: Batch,
        bytes: u64,
        descs: usize,
        pins: Vec<Pin>,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        let timeout = timeout.unwrap_or(r.opts.transfer_timeout);
        let id = r.next_req.fetch_add(1, Ordering::Relaxed);
        let n = bodies.len();
        let first = match bodies.first() {
            Some(PartBody::Data(segs)) => segs.first().map(|s| (s.local, s.remote)),
            Some(PartBody::Strided(st)) => Some((st.local, st.remote)),
            _ => None,
        };
        let (local, remote_addr) = first.unwrap_or((0, 0));
        let mut req = Request::new(id, op, conn.name.clone(), bytes, descs, n, timeout, pins, notify);
        // Fields set in place (the builder methods would move the request each time).
        req.first_addrs = (local, remote_addr);
        req.waited_at_once = waiting == Waiting::Now;
        req.touches_device = device;
        let req = Arc::new(req);
        req.track(&conn.link.stats());
        // Each part keeps a reference to the request's pins (see `queue::part`).
        let parts: Vec<Part> = bodies.into_iter().map(|body| Part::new(req.clone(), body)).collect();
        if let Err(e) = link.submit(parts) {
            // Refused before any backend took it: counted as a failed request with its status,
            // no longer in flight (unless a part reached the completer, which settled it).
            req.refuse(e.clone());
            req.release_pins();
            return Err(e);
        }
        // A request that ended while it was submitted (a same-host copy on this thread) needs
        // no helper, and a later notification need not wait for it.
        let ended = req.has_ended();
        if !ended {
            if let Some(h) = link.wait_help() {
                req.set_help(h);
            }
        }
        req.mark_posted();
        if !ended {
            remember(conn, &req);
        }
        Ok(req)
    }

    /// One-sided WRITE of `len` bytes, waiting up to `timeout`.
    pub fn put(
        &self,
        remote: &str,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_sync(
            remote,
            TransferOp::Write,
            &[TransferOpDesc { local_addr, remote_addr, len }],
            timeout,
        )
    }

    /// One-sided READ of `len` bytes, waiting up to `timeout`.
    pub fn get(
        &self,
        remote: &str,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_sync(
            remote,
            TransferOp::Read,
            &[TransferOpDesc { local_addr, remote_addr, len }],
            timeout,
        )
    }

    /// Strided WRITE (see [`StridedDesc`]), waiting up to `timeout`.
    pub fn put_strided(
        &self,
        remote: &str,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        self.strided_sync(remote, TransferOp::Write, local_base, remote_base, d, timeout)
    }

    /// Strided READ (see [`StridedDesc`]), waiting up to `timeout`.
    pub fn get_strided(
        &self,
        remote: &str,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        self.strided_sync(remote, TransferOp::Read, local_base, remote_base, d, timeout)
    }

    fn strided_sync(
        &self,
        remote: &str,
        op: TransferOp,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        let bases = (local_base, remote_base);
        let req = self.submit_strided(remote, op, bases, d, None, Some(timeout), Waiting::Now)?;
        req.wait(None);
        req.result()
    }

    /// Queues a strided transfer and returns at once: one request, one descriptor on the wire,
    /// expanded into segments only by the backend, a chunk at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn strided_async(
        &self,
        remote: &str,
        op: TransferOp,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        self.submit_strided(remote, op, (local_base, remote_base), d, notify, timeout, Waiting::Later)
    }

    /// `strided_async` with the bases as one pair, saying when the caller will wait for the
    /// request (see [`Waiting`]).
    #[allow(clippy::too_many_arguments)]
    pub fn submit_strided(
        &self,
        remote: &str,
        op: TransferOp,
        bases: (u64, u64),
        d: &StridedDesc,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
        waiting: Waiting,
    ) -> Result<TransferReq> {
        self.strided_or_not(remote, op, bases, d, notify, timeout, waiting, Ask::Peer)?
            .ok_or_else(|| Error::failed("a submission that may ask the peer stopped short"))
    }

    /// `submit_strided` with `Waiting::Now` for a caller that holds a lock its process's other
    /// threads need: as [`Engine::try_submit_held`].
    pub fn try_strided_held(
        &self,
        remote: &str,
        op: TransferOp,
        bases: (u64, u64),
        d: &StridedDesc,
        timeout: Option<Duration>,
    ) -> Result<Option<TransferReq>> {
        self.strided_or_not(remote, op, bases, d, None, timeout, Waiting::Now, Ask::Never)
    }

    #[allow(clippy::too_many_arguments)]
    fn strided_or_not(
        &self,
        remote: &str,
        op: TransferOp,
        (local_base, remote_base): (u64, u64),
        d: &StridedDesc,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
        waiting: Waiting,
        ask: Ask,
    ) -> Result<Option<TransferReq>> {
        let timeout = timeout.map(crate::wait::capped);
        let r = self.running()?;
        let ready = (|| {
            let conn = Self::conn(&r, remote)?;
            if let Some(n) = &notify {
                check_notify(n)?;
            }
            let write = op == TransferOp::Write;
            let found = table_check(&r, &conn, ask, |miss| {
                validate_strided(&r, &conn, remote, (local_base, remote_base), d, write, miss)
            })?;
            let Some((st, pins, pairs)) = found else { return Ok(None) };
            let Some(link) = path_asking(&conn, remote, &pairs, ask)? else { return Ok(None) };
            let shares = if st.bytes() >= r.opts.split_bytes { link.parallelism() } else { 1 };
            // One frame names at most MAX_STRIDED_ELEMS separate elements at the target: more
            // are sent as more parts (each its own frame), never refused.
            let shares = shares.max(st.frames_needed());
            let bodies: Vec<PartBody> = st.split(shares).into_iter().map(PartBody::Strided).collect();
            let batch = Batch { bodies, device: touches_device(&pairs), waiting, link };
            Ok(Some((conn, batch, st.bytes(), pins)))
        })();
        let ready = ready.inspect_err(|e| count_refusal(&r, remote, op, e))?;
        let Some((conn, batch, bytes, pins)) = ready else { return Ok(None) };
        self.submit(&r, &conn, op, batch, bytes, 1, pins, notify, timeout).map(Some)
    }

    /// Status of a request (WAITING turns into TIMEOUT past its deadline).
    pub fn get_transfer_status(&self, req: &TransferReq) -> Result<TransferStatus> {
        Ok(req.status())
    }

    /// Sends a notification; it is delivered after the data of every transfer to the same peer
    /// submitted before it.
    pub fn send_notify(&self, remote: &str, n: NotifyDesc, timeout: Duration) -> Result<()> {
        let timeout = crate::wait::capped(timeout);
        let r = self.running()?;
        let conn = Self::conn(&r, remote).map_err(|e| {
            let died = matches!(r.peers.lock().unwrap().get(remote), Some(PeerSlot::Connected(_)));
            if died {
                Error::new(
                    Status::NotifyFailed,
                    format!("notify to {remote} cannot be delivered: {}", e.message),
                )
            } else {
                e
            }
        })?;
        check_notify(&n)?;
        let deadline = Instant::now() + timeout;
        let earlier: Vec<_> = conn.recent.lock().unwrap().iter().filter_map(|w| w.upgrade()).collect();
        for q in earlier {
            let left = deadline.saturating_duration_since(Instant::now());
            if q.wait(Some(left)) == TransferStatus::Waiting {
                return Err(Error::timeout(format!(
                    "notify to {remote}: an earlier transfer was still in flight after {timeout:?}"
                )));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let id = r.next_req.fetch_add(1, Ordering::Relaxed);
        let req =
            Arc::new(Request::new(id, TransferOp::Write, conn.name.clone(), 0, 0, 1, left, vec![], None));
        req.track(&conn.link.stats());
        if let Err(e) = conn.control.send_notifies(vec![Part::new(req.clone(), PartBody::Notify(n))]) {
            req.refuse(e.clone());
            return Err(e);
        }
        req.wait(None);
        req.result().map_err(|e| match e.status {
            Status::Timeout | Status::ResourceExhausted => e,
            _ => Error::new(Status::NotifyFailed, format!("notify to {remote} failed: {}", e.message)),
        })
    }

    /// Waits up to `timeout` for a notification (named `name`, when given) and returns every
    /// pending one that matches (the others stay for `get_notifies`); TIMEOUT when none came.
    pub fn wait_notifies(&self, timeout: Duration, name: Option<&str>) -> Result<Vec<NotifyDesc>> {
        self.wait_notifies_any(timeout, name.as_slice())
    }

    /// As `wait_notifies`, for a notification named any of `names` (any name, when empty): every
    /// pending one with one of them is returned, in arrival order; the others stay.
    pub fn wait_notifies_any(&self, timeout: Duration, names: &[&str]) -> Result<Vec<NotifyDesc>> {
        let notifies = self.running()?.notifies.clone();
        notifies.wait_take(names, crate::wait::capped(timeout))
    }

    /// A descriptor (the caller's to close) that becomes readable after a notification
    /// arrives, for an event loop that waits on descriptors instead of in `wait_notifies`:
    /// ask for it, then look at what is pending, and after each wake read it (8 bytes, an
    /// eventfd counter) before looking again. Arrivals before the first call do not make it
    /// readable; every descriptor it returns shares one counter.
    pub fn notify_fd(&self) -> Result<std::os::fd::OwnedFd> {
        self.running()?.notifies.arrival_fd()
    }

    /// Returns and clears the notifications received so far.
    pub fn get_notifies(&self) -> Result<Vec<NotifyDesc>> {
        Ok(self.running()?.notifies.take())
    }

    /// Per-peer counters.
    pub fn stats(&self) -> Result<Vec<PeerSnapshot>> {
        let r = self.running()?;
        let peers = r.peers.lock().unwrap();
        let mut out = Vec::new();
        for (peer, slot) in peers.iter() {
            if let PeerSlot::Connected(c) = slot {
                let s = c.link.stats();
                let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
                let (failovers, failover) = c.failovers();
                out.push(PeerSnapshot {
                    peer: peer.clone(),
                    backend: c.link.backend(),
                    not_chosen: c.not_chosen.clone(),
                    failovers,
                    failover,
                    alive: c.link.is_alive(),
                    bytes_write: l(&s.bytes_write),
                    bytes_read: l(&s.bytes_read),
                    ops_write: l(&s.ops_write),
                    ops_read: l(&s.ops_read),
                    errors: l(&s.errors),
                    notifies: l(&s.notifies),
                    direct_parts: l(&s.direct_parts),
                    latency: s.latency(),
                    in_flight: s.in_flight.load(Ordering::Relaxed),
                    errors_by_status: crate::error::Status::ALL
                        .iter()
                        .zip(&s.errors_by_status)
                        .map(|(st, n)| (*st, l(n)))
                        .collect(),
                    latency_buckets: s.latency_buckets.iter().map(l).collect(),
                    latency_sum_us: l(&s.latency_sum_us),
                    queue_slots: c.link.queue_slots(),
                    heartbeat_misses: l(&s.heartbeat_misses),
                    rails: c.link.rails(),
                });
            }
        }
        out.sort_by(|a, b| a.peer.cmp(&b.peer));
        Ok(out)
    }

    /// Transfers refused at submission because no link to their peer existed (never
    /// connected, or disconnected), by status; failures to a peer with a link, dead or alive,
    /// are in its [`Engine::stats`] row instead. Statuses with no failure are left out.
    pub fn unlinked_errors(&self) -> Result<Vec<(Status, u64)>> {
        let r = self.running()?;
        let counts = Status::ALL.iter().zip(&r.unlinked.errors_by_status);
        Ok(counts.map(|(st, n)| (*st, n.load(Ordering::Relaxed))).filter(|(_, n)| *n > 0).collect())
    }

    /// Bytes of memory registered (every region's length).
    pub fn registered_bytes(&self) -> Result<u64> {
        Ok(self.running()?.registry.total_bytes())
    }

    /// Number of registered regions.
    pub fn registered_count(&self) -> Result<usize> {
        Ok(self.running()?.registry.len())
    }
}

/// Counts a transfer refused before it became a request (bad descriptors, a dead or unknown
/// peer) as a failed request with its status: in the peer's stats while a link to it exists
/// (alive or dead), else in the engine's count of failures to peers without a link.
fn count_refusal(r: &Running, remote: &str, op: TransferOp, e: &Error) {
    let stats = match r.peers.lock().unwrap().get(remote) {
        Some(PeerSlot::Connected(c)) => c.link.stats(),
        _ => r.unlinked.clone(),
    };
    stats.record(op, 0, Some(e.status), Duration::ZERO);
}

/// A validated batch on its way to the link.
struct Batch {
    bodies: Vec<PartBody>,
    /// Some of its memory (here or at the peer) is device memory: a path that moves host
    /// memory only stages it (the `tcp` path, see `transport::staging`).
    device: bool,
    waiting: Waiting,
    /// The path that carries it (see `path_for`).
    link: Arc<dyn DataPath>,
}

fn check_notify(n: &NotifyDesc) -> Result<()> {
    if n.name.len() > crate::wire::MAX_NAME || n.msg.len() > crate::wire::MAX_MSG {
        return Err(Error::param(format!(
            "notify name ({} bytes) or msg ({} bytes) is too long: the limits are {} and {} bytes",
            n.name.len(),
            n.msg.len(),
            crate::wire::MAX_NAME,
            crate::wire::MAX_MSG
        )));
    }
    Ok(())
}

fn remember(conn: &PeerConn, req: &Arc<Request>) {
    let mut recent = conn.recent.lock().unwrap();
    if recent.len() >= 256 {
        recent.retain(|w| w.upgrade().is_some_and(|q| q.status() == TransferStatus::Waiting));
    }
    recent.push(Arc::downgrade(req));
}

/// Whether a batch between these domain pairs touches device memory on either side.
fn touches_device(pairs: &[(Domain, Domain)]) -> bool {
    pairs.iter().any(|(l, t)| l.is_device() || t.is_device())
}

/// Whether a submission may wait on the network (ask the peer for its region table, open a
/// backend), or must stop short where it would.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ask {
    Peer,
    Never,
}

/// Validates with `check`: as `with_fresh_table` where the submission may ask the peer; where
/// it may not, None when the validation failed only because a remote range is missing from
/// the peer's table as last received.
fn table_check<T>(
    r: &Running,
    conn: &PeerConn,
    ask: Ask,
    mut check: impl FnMut(&mut bool) -> Result<T>,
) -> Result<Option<T>> {
    if ask == Ask::Peer {
        return with_fresh_table(r, conn, check).map(Some);
    }
    let mut miss = false;
    match check(&mut miss) {
        Err(_) if miss => Ok(None),
        other => other.map(Some),
    }
}

/// `path_for`, or, where the submission may not wait on the network, the link's own path
/// when it serves the batch (None otherwise: a later backend may have to be opened).
fn path_asking(
    conn: &PeerConn,
    remote: &str,
    pairs: &[(Domain, Domain)],
    ask: Ask,
) -> Result<Option<Arc<dyn DataPath>>> {
    match ask {
        Ask::Peer => path_for(conn, remote, pairs).map(Some),
        Ask::Never => Ok(serves(conn.domains(), pairs).then(|| conn.link.clone())),
    }
}

/// The path for a batch between these domain pairs: the link's own, or a later backend that
/// serves them (opened now if it is not open; see `validate::route`).
fn path_for(conn: &PeerConn, remote: &str, pairs: &[(Domain, Domain)]) -> Result<Arc<dyn DataPath>> {
    if serves(conn.domains(), pairs) {
        return Ok(conn.link.clone()); // (without building the list of later backends)
    }
    match route(conn.domains(), &conn.later_domains(), pairs) {
        Some(None) => Ok(conn.link.clone()),
        Some(Some(i)) => conn.sides.path(i, &conn.control),
        None => Err(Error::new(
            Status::Unsupported,
            format!(
                "this batch to {remote} mixes memory domains that no one backend serves ({}): submit \
                 its device and host descriptors as separate batches",
                pairs.iter().map(|(l, t)| format!("{l} -> {t}")).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}
