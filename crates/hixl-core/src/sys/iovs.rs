//! Iovecs together with what keeps their memory valid: the one place where the socket jobs'
//! memory becomes [`RawIov`]s. Every way in takes its proof as a value and keeps it for as long
//! as the queue lives: a [`PinnedRanges`] value (a served frame's checked and pinned ranges, a
//! staging buffer's prefix), a [`KeptRanges`] view (a part's local side, whose keeper, the
//! request's pins, is kept), or an owned buffer (a frame header, a MAC). The iovecs come out
//! only borrowed from the queue ([`IovQueue::refill`]), so the vectored calls over them
//! (`sockio::send_iovs`, ...) are safe, and `transport::io::nbio::IoJob`, which moves a queue's
//! bytes, needs no `unsafe` block.
//!
//! Strided ranges are never expanded into iovecs all at once (a peer names the count): they
//! wait in `later`, in order with what was pushed after them, and [`IovQueue::refill`] takes
//! iovecs from them into the window as the window drains.

use std::collections::VecDeque;
use std::sync::Arc;

use super::mem::{KeptRanges, PinnedMemory, PinnedRanges, RawIov};
use crate::wire::StridedRanges;

/// A piece of a queue behind its window.
enum Later {
    Iov(RawIov),
    /// Ranges vouched for by a [`PinnedRanges`] value the queue keeps (or its keeper), or in
    /// tests by the caller of `IovQueue::push_strided`.
    Strided(StridedRanges),
}

/// Iovecs to move, in order, and what keeps their memory valid (see this module); `H`: the
/// [`PinnedRanges`] value the queue was made for ([`IovQueue::with_owner`]), which its holder
/// reads back.
pub(crate) struct IovQueue<H = ()> {
    /// The window: what the next system call moves, from `start` on.
    iovs: Vec<RawIov>,
    start: usize,
    /// What follows the window, walked into it lazily.
    later: VecDeque<Later>,
    /// Bytes pushed in all.
    total: u64,
    /// Owned buffers some iovecs point into.
    owned: Vec<Vec<u8>>,
    /// [`PinnedRanges`] values pushed, kept until the queue drops.
    held: Vec<Box<dyn Send>>,
    /// The keepers of the [`KeptRanges`] pushed, kept until the queue drops.
    kept: Vec<Arc<dyn PinnedMemory>>,
    /// The pinned ranges the queue was made for, kept until it drops.
    owner: Option<H>,
}

impl Default for IovQueue<()> {
    fn default() -> Self {
        IovQueue::empty()
    }
}

impl<P: PinnedRanges> IovQueue<P> {
    /// A queue over the ranges of `p`, which it keeps (see [`IovQueue::owner`]) until it drops.
    pub(crate) fn with_owner(p: P) -> Self {
        let mut q = IovQueue::empty();
        q.push_ranges_of(&p);
        q.owner = Some(p);
        q
    }

    /// The pinned ranges the queue was made for, if it was made by `with_owner`.
    pub(crate) fn owner(&self) -> Option<&P> {
        self.owner.as_ref()
    }
}

impl<H> IovQueue<H> {
    /// An empty queue.
    pub(crate) fn empty() -> Self {
        IovQueue {
            iovs: Vec::new(),
            start: 0,
            later: VecDeque::new(),
            total: 0,
            owned: Vec::new(),
            held: Vec::new(),
            kept: Vec::new(),
            owner: None,
        }
    }

    /// Adds the ranges of `p` and keeps `p` until the queue is dropped.
    pub(crate) fn push_pinned<P: PinnedRanges + Send + 'static>(&mut self, p: P) {
        self.push_ranges_of(&p);
        self.held.push(Box::new(p));
    }

    /// Adds the ranges of `p` (a part's local side) and keeps its keeper until the queue is
    /// dropped (one reference per run of pushes with the same keeper, no allocation per push).
    pub(crate) fn push_kept<P: KeptRanges>(&mut self, p: &P) {
        let keeper = p.keeper();
        if !self.kept.last().is_some_and(|k| Arc::ptr_eq(k, keeper)) {
            self.kept.push(keeper.clone());
        }
        self.push_ranges_of(p);
    }

    /// Adds the ranges of `p` (a strided shape stays lazy). Private: its callers keep `p`, or
    /// the keeper of its ranges, for as long as the queue lives.
    fn push_ranges_of<P: PinnedRanges>(&mut self, p: &P) {
        match p.strided() {
            Some(sh) => {
                if let Some(r) = StridedRanges::new(sh.addr, sh.count, sh.size, sh.stride) {
                    self.push_lazy(r)
                }
            }
            None => p.for_each_range(|addr, len| {
                if len > 0 {
                    // SAFETY: `p` vouches for every range it yields while it lives (the
                    // promise of `PinnedRanges`), and the queue keeps it (in `held` or `owner`),
                    // or its keeper (in `kept`, the promise of `KeptRanges`), until it drops.
                    self.push_iov(unsafe { RawIov::new(addr, len) })
                }
            }),
        }
    }

    /// Adds an owned buffer (sent as is).
    pub(crate) fn push_owned(&mut self, b: Vec<u8>) {
        if !b.is_empty() {
            // SAFETY: the queue keeps `b` (its heap buffer never moves) until it is dropped.
            self.push_iov(unsafe { RawIov::new(b.as_ptr() as u64, b.len() as u64) });
            self.owned.push(b);
        }
    }

    /// Adds `len` bytes at `addr` (the tests' way in).
    ///
    /// # Safety
    /// As for [`RawIov::new`], until the queue is dropped: the memory must stay valid
    /// (readable for a queue that is sent, writable for one received into) while it lives.
    #[cfg(test)]
    pub(crate) unsafe fn push_raw(&mut self, addr: u64, len: u64) {
        if len > 0 {
            // SAFETY: the caller's contract.
            self.push_iov(unsafe { RawIov::new(addr, len) });
        }
    }

    /// Adds the ranges of a strided range, walked into iovecs only as the queue gets to them
    /// (the tests' way in).
    ///
    /// # Safety
    /// As for [`IovQueue::push_raw`], for every range of `ranges`.
    #[cfg(test)]
    pub(crate) unsafe fn push_strided(&mut self, ranges: StridedRanges) {
        self.push_lazy(ranges)
    }

    /// Queues strided ranges behind the window. Its callers vouch for every range (the
    /// [`PinnedRanges`] value the queue keeps, or its keeper; in tests the caller of
    /// `push_strided`): `refill` turns them into iovecs.
    fn push_lazy(&mut self, ranges: StridedRanges) {
        let bytes: u64 = match ranges.clone().next() {
            Some((_, len)) => len.saturating_mul(ranges.remaining()),
            None => return,
        };
        self.total += bytes;
        self.later.push_back(Later::Strided(ranges));
    }

    fn push_iov(&mut self, v: RawIov) {
        self.total += v.len() as u64;
        if self.later.is_empty() {
            self.iovs.push(v);
        } else {
            self.later.push_back(Later::Iov(v));
        }
    }

    /// Bytes pushed in all.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Whether every iovec was consumed ([`IovQueue::advance`]).
    pub(crate) fn is_done(&self) -> bool {
        self.start == self.iovs.len() && self.later.is_empty()
    }

    /// Tops the window up from what waits behind it (when fewer than half of `max` iovecs are
    /// left in it), so that it holds at most `max` iovecs of strided ranges; returns what is
    /// left of it.
    pub(crate) fn refill(&mut self, max: usize) -> &[RawIov] {
        if !self.later.is_empty() && self.iovs.len() - self.start < max / 2 {
            self.iovs.drain(..self.start);
            self.start = 0;
            while self.iovs.len() < max {
                let Some(next) = self.later.front_mut() else { break };
                match next {
                    Later::Iov(v) => {
                        self.iovs.push(*v);
                        self.later.pop_front();
                    }
                    Later::Strided(r) => {
                        let room = max - self.iovs.len();
                        // SAFETY: every range was vouched for when it was queued (`push_lazy`):
                        // by the `PinnedRanges` value the queue keeps until it drops (in
                        // `held`, `owner`, or its keeper in `kept`), or by the caller of
                        // `push_strided`.
                        self.iovs.extend(r.by_ref().take(room).map(|(a, n)| unsafe { RawIov::new(a, n) }));
                        if r.remaining() == 0 {
                            self.later.pop_front();
                        }
                    }
                }
            }
        }
        &self.iovs[self.start..]
    }

    /// How many iovecs the window holds now (a bound the tests check).
    #[cfg(test)]
    pub(crate) fn in_hand(&self) -> usize {
        self.iovs.len()
    }

    /// Consumes the first `n` bytes of the window (at most what it holds).
    pub(crate) fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let v = &mut self.iovs[self.start];
            if n >= v.len() {
                n -= v.len();
                self.start += 1;
            } else {
                v.skip(n);
                n = 0;
            }
        }
    }
}
