//! One user transfer in flight: its parts' count, its one atomic state, its waiters, its pins,
//! and the completion queue it reports to when an event loop awaits it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::{Completion, CompletionQueue, NotifyDesc, PinSet, TransferOp, TransferStatus, SPIN};
use crate::error::{Error, Result, Status};
use crate::registry::Pin;
use crate::stats::{Outcome, PeerStats};

/// What a request's data path offers a thread that waits for the request: to do the work
/// that ends it on that thread (TCP reads the answer to a small request on the waiting thread
/// instead of waking a worker and handing the answer over).
pub trait WaitHelp: Send + Sync {
    /// Works toward ending `req` on the calling thread, returning when it ended, when `until`
    /// passed, or when there is nothing to do here (the waiter then waits as usual).
    fn help(&self, req: &Request, until: Instant);
}

/// `Request::posted_ns` before the request was posted.
const NOT_POSTED: u64 = u64::MAX;

/// A user transfer in flight.
pub struct Request {
    /// Engine-unique id.
    pub id: u64,
    /// Direction.
    pub op: TransferOp,
    /// Peer address (shared with the link's other requests: no copy per request).
    pub peer: Arc<str>,
    /// Bytes moved by the whole request.
    pub bytes: u64,
    /// Number of descriptors the caller passed.
    pub descs: usize,
    /// When it was submitted.
    pub started: Instant,
    deadline: Instant,
    state: AtomicU8,
    parts_left: AtomicUsize,
    error: Mutex<Option<Error>>,
    /// Its pins on its local regions, shared with its parts (see `queue::part`); dropped here
    /// when it settles.
    pins: Mutex<Option<Arc<PinSet>>>,
    notify_after: Mutex<Option<NotifyDesc>>,
    /// Whether it carries a notification after its data (counted when it completes).
    pub carries_notify: bool,
    /// Local and remote address of its first segment (for the DEBUG log); 0: none.
    pub first_addrs: (u64, u64),
    /// Whether its submitter waits for it right away (`Waiting::Now`): a path may then run it
    /// on the submitting thread.
    pub waited_at_once: bool,
    /// Whether some of its memory, here or at the peer, is device memory (its validation found
    /// a device domain): a path that moves only host memory stages it (`tcp`).
    pub touches_device: bool,
    sleep: Mutex<()>,
    wake: Condvar,
    sleepers: AtomicUsize,
    /// Where to report settling, with the token to report (set once, by `report_to`).
    report: OnceLock<(Arc<CompletionQueue>, u64)>,
    /// Set when its I/O ended, by the completer that logs it: exactly once.
    accounted: AtomicBool,
    /// The counters it is counted in (set once, by `track`, when it is submitted): it is in
    /// their `in_flight` until it settles, and counted there as it settles.
    counted_in: OnceLock<Arc<PeerStats>>,
    /// Taken by the one call that settles it (see `finish_as`).
    claimed: AtomicBool,
    /// The backend that carried it and when its I/O ended (for telemetry).
    ended: OnceLock<(&'static str, Instant)>,
    /// The backend that carried its data, when its notification went on after it over the
    /// control channel (whose completer settles it): the one `account` records.
    carried_by: OnceLock<&'static str>,
    /// When the submitting call had handed it to its backend (for telemetry): nanoseconds
    /// after `started`, `NOT_POSTED` before (an atomic store: no once-cell on the hot path).
    posted_ns: AtomicU64,
    /// The task awaiting it (async Rust), woken when it settles.
    wakers: Mutex<Vec<std::task::Waker>>,
    /// Whether the deadline thread watches it (an awaited future asked).
    watched: AtomicBool,
    has_waker: AtomicBool,
    /// Its data path's offer to waiting threads (set once, when it is submitted).
    help: OnceLock<Weak<dyn WaitHelp>>,
}

impl Request {
    /// A new WAITING request with `parts` parts outstanding.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        op: TransferOp,
        peer: impl Into<Arc<str>>,
        bytes: u64,
        descs: usize,
        parts: usize,
        timeout: Duration,
        pins: Vec<Pin>,
        notify_after: Option<NotifyDesc>,
    ) -> Self {
        let now = Instant::now();
        Request {
            id,
            op,
            peer: peer.into(),
            bytes,
            descs,
            started: now,
            deadline: now + crate::wait::capped(timeout),
            state: AtomicU8::new(TransferStatus::Waiting as u8),
            parts_left: AtomicUsize::new(parts),
            error: Mutex::new(None),
            pins: Mutex::new((!pins.is_empty()).then(|| Arc::new(PinSet::new(pins)))),
            carries_notify: notify_after.is_some(),
            first_addrs: (0, 0),
            waited_at_once: false,
            touches_device: false,
            notify_after: Mutex::new(notify_after),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            report: OnceLock::new(),
            accounted: AtomicBool::new(false),
            counted_in: OnceLock::new(),
            claimed: AtomicBool::new(false),
            ended: OnceLock::new(),
            carried_by: OnceLock::new(),
            posted_ns: AtomicU64::new(NOT_POSTED),
            wakers: Mutex::new(Vec::new()),
            watched: AtomicBool::new(false),
            has_waker: AtomicBool::new(false),
            help: OnceLock::new(),
        }
    }

    /// Lets threads that wait for this request do its path's work (see [`WaitHelp`]).
    pub fn set_help(&self, help: Weak<dyn WaitHelp>) {
        let _ = self.help.set(help);
    }

    /// The same request, naming `(local, remote)` as the addresses of its first segment.
    pub fn with_first_addrs(mut self, local: u64, remote: u64) -> Self {
        self.first_addrs = (local, remote);
        self
    }

    /// The same request, saying whether some of its memory is device memory.
    pub fn touching_device(mut self, yes: bool) -> Self {
        self.touches_device = yes;
        self
    }

    /// Whether it has left WAITING (no clock read: a deadline that passed unobserved does not
    /// count here).
    pub(crate) fn has_ended(&self) -> bool {
        TransferStatus::from_u8(self.state.load(Ordering::Acquire)) != TransferStatus::Waiting
    }

    /// The same request, saying whether its submitter waits for it right away.
    pub fn waited(mut self, at_once: bool) -> Self {
        self.waited_at_once = at_once;
        self
    }

    /// Current status; a WAITING request past its deadline turns into TIMEOUT here.
    pub fn status(&self) -> TransferStatus {
        let s = TransferStatus::from_u8(self.state.load(Ordering::Acquire));
        if s == TransferStatus::Waiting && Instant::now() >= self.deadline {
            self.settle(
                TransferStatus::Timeout,
                Some(Error::timeout(format!(
                    "transfer {} to {} did not finish within its deadline ({:?})",
                    self.id,
                    self.peer,
                    self.deadline - self.started
                ))),
            );
            return self.published();
        }
        s
    }

    /// The final state, once the call that claimed the settling has published it (it is
    /// counting the request meanwhile: a few atomic additions).
    fn published(&self) -> TransferStatus {
        loop {
            let s = TransferStatus::from_u8(self.state.load(Ordering::Acquire));
            if s != TransferStatus::Waiting {
                return s;
            }
            std::thread::yield_now();
        }
    }

    /// The error of a FAILED or TIMEOUT request.
    pub fn error(&self) -> Option<Error> {
        self.error.lock().unwrap().clone()
    }

    /// Converts the final state into a `Result` (WAITING counts as TIMEOUT for sync callers).
    pub fn result(&self) -> Result<()> {
        match self.status() {
            TransferStatus::Completed => Ok(()),
            TransferStatus::Waiting => {
                Err(Error::timeout(format!("transfer {} to {} still waiting", self.id, self.peer)))
            }
            _ => Err(self.error().unwrap_or_else(|| Error::failed("transfer failed"))),
        }
    }

    /// The request's own deadline.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Blocks until the request leaves WAITING, the request's deadline passes, or `timeout`
    /// (if any) expires, whichever is first; returns the status then.
    pub fn wait(&self, timeout: Option<Duration>) -> TransferStatus {
        // Ended already (copied on the submitting thread): no clock, no helper.
        if self.has_ended() {
            return TransferStatus::from_u8(self.state.load(Ordering::Acquire));
        }
        let until = timeout
            .and_then(|t| Instant::now().checked_add(t))
            .map_or(self.deadline, |u| self.deadline.min(u));
        if let Some(h) = self.help.get().and_then(Weak::upgrade) {
            if self.status() == TransferStatus::Waiting {
                h.help(self, until);
            }
        }
        // Short spin (yielding, so the threads that complete us can run) before parking:
        // small transfers finish in tens of microseconds and a wake-up costs about as much.
        let spin_until = Instant::now() + SPIN;
        let mut i = 0u32;
        loop {
            let s = self.status();
            if s != TransferStatus::Waiting {
                return s;
            }
            if Instant::now() >= spin_until.min(until) {
                break;
            }
            i += 1;
            if i < 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let mut g = self.sleep.lock().unwrap();
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            // Read the raw state here: settling (status() past the deadline) takes this lock.
            let s = TransferStatus::from_u8(self.state.load(Ordering::Acquire));
            let now = Instant::now();
            if s != TransferStatus::Waiting || now >= until {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(g);
                return self.status();
            }
            g = self.wake.wait_timeout(g, until - now).unwrap().0;
        }
    }

    /// Counts the request in `stats` from now on: it is in their `in_flight` until it settles,
    /// and counted there (operation, bytes, latency, error, notification) as it settles. Once
    /// per request; a request never tracked (a staged chunk) is counted nowhere.
    pub(crate) fn track(&self, stats: &Arc<PeerStats>) {
        if self.counted_in.set(stats.clone()).is_ok() {
            stats.submitted();
        }
    }

    /// Moves WAITING into a final state once; later calls are ignored. Wakes waiters.
    pub fn settle(&self, to: TransferStatus, err: Option<Error>) -> bool {
        self.finish_as(to, err)
    }

    /// Settles a request that was refused before any backend took it: FAILED with `err`, no
    /// longer in flight, counted as a failed request with `err`'s status (the submitting call
    /// reports the refusal). False when it had settled already.
    pub(crate) fn refuse(&self, err: Error) -> bool {
        self.settle(TransferStatus::Failed, Some(err))
    }

    /// The one way a request settles. The first caller claims it; it records the error,
    /// counts the request in its peer's stats and only then publishes the final state, so
    /// that whoever sees the request end (a waiter, `status()`, a completion queue) reads
    /// stats that include it, and stats never count a request that is still WAITING.
    fn finish_as(&self, to: TransferStatus, err: Option<Error>) -> bool {
        if self.claimed.swap(true, Ordering::AcqRel) {
            return false;
        }
        if let Some(e) = &err {
            self.error.lock().unwrap().get_or_insert_with(|| e.clone());
        }
        if let Some(stats) = self.counted_in.get() {
            let outcome = match to {
                TransferStatus::Completed => Outcome::Completed,
                TransferStatus::Timeout => Outcome::Failed(Status::Timeout),
                _ => Outcome::Failed(self.error().map_or(Status::Failed, |e| e.status)),
            };
            let end = self.ended_at().unwrap_or_else(Instant::now);
            let counted = crate::stats::Settled {
                op: self.op,
                bytes: self.bytes,
                descs: self.descs,
                carries_notify: self.carries_notify,
                latency: end.saturating_duration_since(self.started),
            };
            stats.settled(counted, outcome);
        }
        self.state.store(to as u8, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.sleep.lock().unwrap();
            self.wake.notify_all();
        }
        // Pairs with the fence in `report_to` (see there).
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Some((q, token)) = self.report.get() {
            q.push(*token);
        }
        if self.has_waker.load(Ordering::SeqCst) {
            self.wake();
        }
        if self.watched.load(Ordering::SeqCst) {
            super::future::forget(self);
        }
        true
    }

    /// The completer's once-only claim to log the end of the request's I/O; true the first
    /// time. Records the backend and the end time (telemetry, and the latency it is counted
    /// with when it settles).
    pub(crate) fn account(&self, backend: &'static str) -> bool {
        let first = !self.accounted.swap(true, Ordering::AcqRel);
        if first {
            let backend = self.carried_by.get().copied().unwrap_or(backend);
            let _ = self.ended.set((backend, Instant::now()));
        }
        first
    }

    /// Records that `backend` carried its data and its notification follows over the control
    /// channel (see `Completer::finish`): the request is accounted to `backend`, not to the
    /// control channel that settles it.
    pub(crate) fn carried_by(&self, backend: &'static str) {
        let _ = self.carried_by.set(backend);
    }

    /// When its I/O ended, as `account` recorded it.
    pub(crate) fn ended_at(&self) -> Option<Instant> {
        self.ended.get().map(|(_, t)| *t)
    }

    /// A future that resolves when the request settles (see [`Completion`]).
    pub fn completion(self: &Arc<Self>) -> Completion {
        Completion::new(self.clone())
    }

    /// Adds a task to wake when it settles (every future awaiting it is woken).
    pub(super) fn set_waker(&self, w: std::task::Waker) {
        {
            let mut ws = self.wakers.lock().unwrap();
            if !ws.iter().any(|x| x.will_wake(&w)) {
                ws.push(w);
            }
        }
        self.has_waker.store(true, Ordering::SeqCst);
        // Pairs with the fence in `settle`: the caller's next status check sees the settle, or
        // the settle sees this waker.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// The deadline thread watches it.
    pub(super) fn mark_watched(&self) {
        self.watched.store(true, Ordering::SeqCst);
    }

    /// Wakes every task awaiting it.
    pub(super) fn wake(&self) {
        let ws = std::mem::take(&mut *self.wakers.lock().unwrap());
        for w in ws {
            w.wake();
        }
    }

    /// The backend `account` recorded (None before its I/O ended).
    pub(crate) fn carrier(&self) -> Option<&'static str> {
        self.ended.get().map(|(b, _)| *b)
    }

    /// Records that the submitting call has handed it to its backend.
    pub(crate) fn mark_posted(&self) {
        let ns = self.started.elapsed().as_nanos().min(u128::from(NOT_POSTED - 1)) as u64;
        let _ = self.posted_ns.compare_exchange(NOT_POSTED, ns, Ordering::Release, Ordering::Relaxed);
    }

    /// How it went, once its I/O has ended (None while in flight).
    pub fn telemetry(&self) -> Option<Telemetry> {
        let (backend, end) = *self.ended.get()?;
        let posted = match self.posted_ns.load(Ordering::Acquire) {
            NOT_POSTED => self.started,
            ns => self.started + Duration::from_nanos(ns),
        };
        Some(Telemetry {
            backend,
            post: posted.saturating_duration_since(self.started),
            duration: end.saturating_duration_since(self.started),
            started: self.started,
        })
    }

    /// Asks for `token` to be queued on `q` when the request settles. A request reports one
    /// token: a later call gets the token asked for first. Returns the token that will be
    /// queued, or None when the request has settled already (then a token may or may not be
    /// queued, and the caller should not wait for one).
    pub fn report_to(&self, q: &Arc<CompletionQueue>, token: u64) -> Option<u64> {
        let _ = self.report.set((q.clone(), token));
        let queued = self.report.get().map_or(token, |(_, t)| *t);
        // `settle` flips the state, fences, then reads `report`; this sets `report`, fences,
        // then reads the state. With a SeqCst fence between each side's write and read, at
        // least one of the two sees the other's write: the token is queued, or this returns
        // None, or both.
        std::sync::atomic::fence(Ordering::SeqCst);
        (self.state.load(Ordering::SeqCst) == TransferStatus::Waiting as u8).then_some(queued)
    }

    /// Records the end of one part. Returns true when it was the last one; the caller then
    /// decides between settling and sending the notify that follows the data.
    pub fn part_done(&self, res: &Result<()>) -> bool {
        if let Err(e) = res {
            self.error.lock().unwrap().get_or_insert_with(|| e.clone());
        }
        self.parts_left.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Parts not reported yet: 0 once every backend that carried one stopped touching its
    /// memory (a request settled by its deadline may still have parts under way).
    pub(crate) fn parts_outstanding(&self) -> usize {
        self.parts_left.load(Ordering::Acquire)
    }

    /// Adds parts (the notify sent after the data).
    pub fn add_parts(&self, n: usize) {
        self.parts_left.fetch_add(n, Ordering::AcqRel);
    }

    /// The first error recorded by any part.
    pub fn part_error(&self) -> Option<Error> {
        self.error.lock().unwrap().clone()
    }

    /// Takes the notification that must follow the data, if any.
    pub fn take_notify_after(&self) -> Option<NotifyDesc> {
        self.notify_after.lock().unwrap().take()
    }

    /// Its pins on its local regions (None once released, or when it has none), for a part
    /// to keep (see [`super::Part::new`]).
    pub fn pin_set(&self) -> Option<Arc<PinSet>> {
        self.pins.lock().unwrap().clone()
    }

    /// Drops the request's reference to its pins (all I/O for this request has stopped); the
    /// regions are released once no part or I/O job made from it holds one either.
    pub fn release_pins(&self) {
        self.pins.lock().unwrap().take();
    }
}

/// A settled request's telemetry (like NIXL's transfer telemetry).
#[derive(Clone, Copy, Debug)]
pub struct Telemetry {
    /// The backend that carried it.
    pub backend: &'static str,
    /// Time the submitting call took to hand it to the backend, from its creation (after its
    /// descriptors were checked).
    pub post: Duration,
    /// From its creation until its I/O ended.
    pub duration: Duration,
    /// When it was created.
    pub started: Instant,
}
