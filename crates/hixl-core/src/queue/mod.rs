//! Requests and the lock-free bounded queue between callers and link workers.
//!
//! A [`Request`] is one user transfer (a whole batch of descriptors). Before it is queued it is
//! cut into [`Part`]s (one per stream share); workers pop many parts per wake-up and submit them
//! together. The request's state is an atomic that flips once, WAITING -> COMPLETED | FAILED |
//! TIMEOUT; waiters spin briefly, then sleep on a condition variable.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result, Status};
use crate::wire::StridedRanges;

mod completion;
mod future;
mod part;
mod request;
pub use completion::CompletionQueue;
pub use future::Completion;
pub(crate) use part::unpinned_part;
pub use part::{Part, PartBody, PinSet};
pub use request::{Request, Telemetry, WaitHelp};

pub use crate::op::{SegPair, TransferOp};

/// How long a waiter spins before it sleeps. Fixed: a same-host request often ends within it
/// (no futex round trip), and a longer spin only burns the waiter's core.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// State of a request. The numbers are the public contract (the same in Python, and as in
/// HIXL's TransferStatus).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TransferStatus {
    /// Still in flight.
    Waiting = 0,
    /// All bytes are at the destination.
    Completed = 1,
    /// Did not finish before its deadline.
    Timeout = 2,
    /// Failed; see [`Request::error`].
    Failed = 3,
}

impl TransferStatus {
    /// Every status, in the order of its number.
    pub const ALL: [TransferStatus; 4] =
        [TransferStatus::Waiting, TransferStatus::Completed, TransferStatus::Timeout, TransferStatus::Failed];

    fn from_u8(v: u8) -> Self {
        Self::ALL.get(v as usize).copied().unwrap_or(TransferStatus::Failed)
    }

    /// The upper-case name used in docs and in Python.
    pub fn name(self) -> &'static str {
        match self {
            TransferStatus::Waiting => "WAITING",
            TransferStatus::Completed => "COMPLETED",
            TransferStatus::Timeout => "TIMEOUT",
            TransferStatus::Failed => "FAILED",
        }
    }
}

/// A notification: a name and a message, and for a received one the engine it came from.
///
/// Make one to send with [`NotifyDesc::new`] (a struct literal must name `peer` too, which
/// only a received notification carries):
///
/// ```
/// use hixl_core::NotifyDesc;
/// let n = NotifyDesc::new("kv", "layer 3 done");
/// assert_eq!((n.name.as_str(), n.msg.as_str(), n.peer.as_str()), ("kv", "layer 3 done", ""));
/// ```
///
/// Send it with `Engine::send_notify`, or after a batch's bytes with `Engine::transfer_async`;
/// take received ones with `Engine::get_notifies` or `Engine::wait_notifies`.
///
/// Equality compares `name` and `msg` only: `peer` says where one came from, not what it says.
#[derive(Clone, Debug, Default)]
pub struct NotifyDesc {
    /// Name (who or what it is about).
    pub name: String,
    /// Message body.
    pub msg: String,
    /// For a received notification: the engine id of the connection it arrived on, as that
    /// connection's handshake established it (see docs/RELIABILITY.md, "Notifications'
    /// sender"); "" for one built here (ignored when sending).
    pub peer: String,
}

impl NotifyDesc {
    /// A notification to send: `name` and `msg`, no sender.
    pub fn new(name: impl Into<String>, msg: impl Into<String>) -> Self {
        NotifyDesc { name: name.into(), msg: msg.into(), peer: String::new() }
    }
}

impl PartialEq for NotifyDesc {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.msg == other.msg
    }
}

impl Eq for NotifyDesc {}

/// `count` elements of `size` bytes: element i is at `local + i * lstride` here and at
/// `remote + i * rstride` at the peer. Stays this compact through the queue and on the wire;
/// backends expand it into segments a chunk at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// Local address of element 0.
    pub local: u64,
    /// Remote address of element 0.
    pub remote: u64,
    /// Number of elements (>= 1).
    pub count: u64,
    /// Bytes per element (>= 1).
    pub size: u64,
    /// Local distance between elements (>= size).
    pub lstride: u64,
    /// Remote distance between elements (>= size).
    pub rstride: u64,
}

impl Strided {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.count * self.size
    }

    /// Element `i` as a segment pair.
    pub fn seg(&self, i: u64) -> SegPair {
        SegPair {
            local: self.local + i * self.lstride,
            remote: self.remote + i * self.rstride,
            len: self.size,
        }
    }

    /// Whether the elements touch on both sides (both strides equal the size): then they are
    /// one contiguous segment pair.
    pub fn contiguous(&self) -> bool {
        self.lstride == self.size && self.rstride == self.size
    }

    /// Calls `f` with the segments of elements, at most `chunk` at a time, reusing one buffer;
    /// elements that touch on both sides come as one segment.
    pub fn for_each_chunk<E>(
        &self,
        chunk: usize,
        mut f: impl FnMut(&[SegPair]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.contiguous() {
            return f(&[SegPair { local: self.local, remote: self.remote, len: self.bytes() }]);
        }
        let mut buf = Vec::with_capacity(chunk.min(self.count as usize));
        let mut i = 0;
        while i < self.count {
            buf.clear();
            let n = (self.count - i).min(chunk as u64);
            buf.extend((i..i + n).map(|k| self.seg(k)));
            f(&buf)?;
            i += n;
        }
        Ok(())
    }

    /// The local side's contiguous ranges, walked lazily (see [`StridedRanges`]).
    pub fn local_ranges(&self) -> StridedRanges {
        StridedRanges::new(self.local, self.count, self.size, self.lstride)
            .expect("a validated strided descriptor lies in one registered region")
    }

    /// How many frames' worth of elements it is on the wire: one strided frame names at most
    /// [`crate::wire::MAX_STRIDED_ELEMS`] elements that are not contiguous at the target.
    pub fn frames_needed(&self) -> usize {
        let pieces = StridedRanges::pieces(self.count, self.size, self.rstride);
        usize::try_from(pieces.div_ceil(crate::wire::MAX_STRIDED_ELEMS)).unwrap_or(usize::MAX).max(1)
    }

    /// Cuts into at most `parts` strided pieces of about equal element counts.
    pub fn split(self, parts: usize) -> Vec<Strided> {
        let parts = (parts as u64).clamp(1, self.count);
        let per = self.count.div_ceil(parts);
        let mut out = Vec::with_capacity(parts as usize);
        let mut i = 0;
        while i < self.count {
            let n = per.min(self.count - i);
            let s = self.seg(i);
            out.push(Strided { local: s.local, remote: s.remote, count: n, ..self });
            i += n;
        }
        out
    }
}

/// A bounded lock-free MPMC queue with reservations and a doorbell for sleeping workers. The
/// reservation counter is the bound; the storage grows with use (an idle link with a deep
/// queue costs almost nothing, which matters with hundreds of peers).
///
/// Besides the shared queue that any worker drains, it may have per-worker *lanes*: the shares
/// of one split request are pushed one per lane, so that every stream carries its share even
/// when one worker could have popped them all before the others woke. One reservation counter
/// bounds the items in the shared queue and the lanes together.
pub struct WorkQueue<T> {
    q: SegQueue<T>,
    lanes: Vec<SegQueue<T>>,
    capacity: usize,
    reserved: AtomicUsize,
    closed: AtomicBool,
    sleepers: AtomicUsize,
    bell: Mutex<()>,
    ring: Condvar,
    /// How long a worker that found the queue empty keeps polling before it sleeps.
    spin: Duration,
}

impl<T> WorkQueue<T> {
    /// A queue holding at most `capacity` items, without lanes.
    pub fn new(capacity: usize) -> Self {
        Self::with_lanes(capacity, 0)
    }

    /// A queue holding at most `capacity` items in all, with `lanes` per-worker lanes.
    pub fn with_lanes(capacity: usize, lanes: usize) -> Self {
        let cap = capacity.max(1);
        WorkQueue {
            q: SegQueue::new(),
            lanes: (0..lanes).map(|_| SegQueue::new()).collect(),
            capacity: cap,
            reserved: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            bell: Mutex::new(()),
            ring: Condvar::new(),
            spin: Duration::ZERO,
        }
    }

    /// Lets workers poll an empty queue for `spin` before they sleep: a request that arrives
    /// meanwhile needs no wake-up (which costs tens of microseconds on virtual machines).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Slots reserved now (queued or about to be).
    pub fn in_use(&self) -> usize {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Reserves `n` slots; `RESOURCE_EXHAUSTED` at once when they are not free.
    pub fn reserve(&self, n: usize) -> Result<()> {
        let cap = self.capacity;
        let mut cur = self.reserved.load(Ordering::Relaxed);
        loop {
            if cur + n > cap {
                return Err(Error::new(
                    Status::ResourceExhausted,
                    format!(
                        "request queue full: {cur} of {cap} slots in use, {n} more needed \
                         (raise hixl.queue_depth or wait for transfers to finish)"
                    ),
                ));
            }
            match self.reserved.compare_exchange_weak(cur, cur + n, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(v) => cur = v,
            }
        }
    }

    /// Gives back reservations that will not be used.
    pub fn unreserve(&self, n: usize) {
        self.reserved.fetch_sub(n, Ordering::AcqRel);
    }

    /// Pushes an item into a slot reserved earlier and rings the bell.
    pub fn push_reserved(&self, item: T) {
        self.q.push(item);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.bell.lock().unwrap();
            self.ring.notify_one();
        }
    }

    /// Pushes an item reserved earlier into one worker's lane and wakes the workers (all of
    /// them: the bell does not know which sleeper owns the lane).
    pub fn push_reserved_lane(&self, lane: usize, item: T) {
        self.lanes[lane].push(item);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.bell.lock().unwrap();
            self.ring.notify_all();
        }
    }

    /// Pops up to `max` shared items into `out`; sleeps up to `idle` when empty. Returns false
    /// once the queue is closed and empty.
    pub fn pop_batch(&self, out: &mut Vec<T>, max: usize, idle: Duration) -> bool {
        self.pop_weighted(None, out, max, u64::MAX, |_| 0, idle)
    }

    fn empty_for(&self, lane: Option<usize>) -> bool {
        self.q.is_empty() && lane.is_none_or(|l| self.lanes[l].is_empty())
    }

    fn pop_from(&self, lane: Option<usize>) -> Option<T> {
        let x = lane.and_then(|l| self.lanes[l].pop()).or_else(|| self.q.pop());
        if x.is_some() {
            self.reserved.fetch_sub(1, Ordering::AcqRel);
        }
        x
    }

    /// Pops items of `lane` (if any) first, then shared ones, into `out`: at most `max`, and
    /// no more once their summed `weight` reaches `max_weight` (so one worker does not take
    /// every large item while the others idle). Sleeps up to `idle` when there is nothing.
    /// Returns false once the queue is closed and empty.
    pub fn pop_weighted(
        &self,
        lane: Option<usize>,
        out: &mut Vec<T>,
        max: usize,
        max_weight: u64,
        weight: impl Fn(&T) -> u64,
        idle: Duration,
    ) -> bool {
        let mut spun = false;
        loop {
            if self.try_pop_weighted(lane, out, max, max_weight, &weight) || !out.is_empty() {
                return true;
            }
            if self.closed.load(Ordering::Acquire) {
                return false;
            }
            if !self.spin.is_zero() && !spun {
                spun = true;
                let until = Instant::now() + self.spin;
                while self.empty_for(lane) && !self.closed.load(Ordering::Acquire) && Instant::now() < until {
                    std::hint::spin_loop();
                    std::thread::yield_now();
                }
                if !self.empty_for(lane) {
                    continue;
                }
            }
            let g = self.bell.lock().unwrap();
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if self.empty_for(lane) && !self.closed.load(Ordering::Acquire) {
                let _ = self.ring.wait_timeout(g, idle).unwrap();
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if self.empty_for(lane) {
                return !self.closed.load(Ordering::Acquire);
            }
        }
    }

    /// Pops like [`WorkQueue::pop_weighted`] but never waits: false when nothing was taken.
    pub fn try_pop_weighted(
        &self,
        lane: Option<usize>,
        out: &mut Vec<T>,
        max: usize,
        max_weight: u64,
        weight: impl Fn(&T) -> u64,
    ) -> bool {
        let (before, mut taken) = (out.len(), 0u64);
        while out.len() < max && taken < max_weight {
            match self.pop_from(lane) {
                Some(x) => {
                    taken = taken.saturating_add(weight(&x));
                    out.push(x);
                }
                None => break,
            }
        }
        out.len() > before
    }

    /// Closes the queue: workers drain what is left and then stop.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        let _g = self.bell.lock().unwrap();
        self.ring.notify_all();
    }

    /// Whether nothing is queued, shared or in any lane.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty() && self.lanes.iter().all(|l| l.is_empty())
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Pops one item from anywhere without waiting (used to fail leftovers).
    pub fn pop(&self) -> Option<T> {
        if let Some(x) = self.lanes.iter().find_map(|l| l.pop()) {
            self.reserved.fetch_sub(1, Ordering::AcqRel);
            return Some(x);
        }
        self.pop_from(None)
    }
}

#[cfg(test)]
mod tests;
