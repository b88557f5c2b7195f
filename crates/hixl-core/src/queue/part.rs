//! A part (one stream's share of a request) and what keeps its local memory valid.
//!
//! A request's pins on its local regions are one [`PinSet`] behind an `Arc`: the request
//! holds it until it settles, each of its parts holds a clone, and so does each I/O job made
//! from a part (it keeps the keeper of the part's [`LocalRanges`]). A region thus stays pinned,
//! and cannot be deregistered, while anything may still move bytes to or from it, whoever
//! settled the request and when. A part proves its local side as a value, the way a served
//! frame's `PinnedFrame` proves the target's: [`Part::local`] checks every local range against
//! the memory the part keeps and returns a view the safe calls of `sys::mem` accept.

use std::sync::Arc;

use super::{NotifyDesc, Request, SegPair, Strided};
use crate::registry::Pin;
use crate::sys::mem::{for_each_slice, KeptRanges, PinnedMemory, PinnedRanges, StridedShape};
use crate::wire::Domain;

/// What a part carries.
#[derive(Debug)]
pub enum PartBody {
    /// Data segments of a READ or WRITE.
    Data(Vec<SegPair>),
    /// A strided READ or WRITE.
    Strided(Strided),
    /// A notification.
    Notify(NotifyDesc),
}

impl PartBody {
    /// Data bytes the part moves (0 for a notification).
    pub fn bytes(&self) -> u64 {
        match self {
            PartBody::Data(segs) => segs.iter().map(|s| s.len).sum(),
            PartBody::Strided(s) => s.bytes(),
            PartBody::Notify(_) => 0,
        }
    }

    /// Whether every local range lies in memory that `mem` covers.
    fn local_in(&self, mem: &dyn PinnedMemory) -> bool {
        match self {
            PartBody::Data(segs) => segs.iter().all(|s| mem.covers(s.local, s.len)),
            PartBody::Strided(st) => {
                let span = (st.count.max(1) - 1).checked_mul(st.lstride).and_then(|x| x.checked_add(st.size));
                span.is_some_and(|span| mem.covers(st.local, span))
            }
            PartBody::Notify(_) => true,
        }
    }
}

/// The pins a request holds on its local regions, shared by the request and its parts (see
/// this module). Dropping the last reference releases the regions for deregistration.
pub struct PinSet {
    pins: Vec<Pin>,
}

impl PinSet {
    /// The set of `pins`.
    pub fn new(pins: Vec<Pin>) -> PinSet {
        PinSet { pins }
    }

    /// The pins.
    pub fn pins(&self) -> &[Pin] {
        &self.pins
    }

    /// Whether every byte of `[addr, addr+len)` lies in one of its regions, of any memory
    /// domain (a range across two adjacent regions lies in both).
    pub(crate) fn in_regions(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else { return false };
        let mut at = addr;
        while at < end {
            match self.pins.iter().map(|p| p.region()).find(|r| r.contains(at, 1)) {
                Some(r) => at = r.end(),
                None => return false,
            }
        }
        true
    }
}

// SAFETY: a Pin keeps its region registered: `Registry::deregister` (and `deregister_mem`)
// waits for the region's pins and fails while one is held, so the region's memory is still
// what its registrant promised to keep valid until deregistration succeeds (the contract of
// `Engine::register_mem*`, unsafe functions; the engine's own `alloc` memory is freed only
// after that).
// Only host regions are covered: device memory is not this process's to touch, and a range
// counts only inside one region (regions never overlap and each is one mapping's worth of
// memory its registrant vouched for). The pins never change while the set lives.
unsafe impl PinnedMemory for PinSet {
    #[inline]
    fn covers(&self, addr: u64, len: u64) -> bool {
        self.pins.iter().any(|p| {
            let r = p.region();
            r.mem_type == Domain::Host && r.contains(addr, len)
        })
    }
}

/// A unit of work for one stream: a share of a request, with what keeps its local memory
/// valid while the part (or an I/O job made from it) lives.
pub struct Part {
    /// The request it belongs to.
    pub req: Arc<Request>,
    /// Its content.
    pub body: PartBody,
    /// What keeps its local ranges valid; None when this process may not touch them (a
    /// notification, a request without pins).
    memory: Option<Arc<dyn PinnedMemory>>,
}

impl Part {
    /// A part of `req` whose local side the request's pins keep valid.
    pub fn new(req: Arc<Request>, body: PartBody) -> Part {
        let memory = match body {
            PartBody::Notify(_) => None,
            _ => req.pin_set().map(|p| p as Arc<dyn PinnedMemory>),
        };
        Part { req, body, memory }
    }

    /// A part of `req` whose local side `memory` keeps valid (a staging buffer's slots).
    pub(crate) fn in_memory(req: Arc<Request>, body: PartBody, memory: Arc<dyn PinnedMemory>) -> Part {
        Part { req, body, memory: Some(memory) }
    }

    /// Another part of the same request over the same memory (a share of this one's
    /// segments; checked again when it is used, like any part).
    pub fn share(&self, body: PartBody) -> Part {
        Part { req: self.req.clone(), body, memory: self.memory.clone() }
    }

    /// What keeps the local memory valid, if anything.
    pub(crate) fn memory(&self) -> Option<&Arc<dyn PinnedMemory>> {
        self.memory.as_ref()
    }

    /// The local side as ranges this process may move bytes to and from; None when a local
    /// range lies outside the memory the part keeps (none kept, or device memory), which no
    /// host copy or socket may then touch. Costs a comparison or two per segment.
    pub(crate) fn local(&self) -> Option<LocalRanges<'_>> {
        let memory = self.memory.as_ref()?;
        self.body.local_in(&**memory).then_some(LocalRanges { body: &self.body, memory })
    }
}

/// The error for a data part whose local side [`Part::local`] refused (never one the engine
/// built): it fails before any of its bytes moved.
pub(crate) fn unpinned_part() -> crate::error::Error {
    crate::error::Error::failed("a part's local memory is not pinned host memory of this process")
}

/// A part's local ranges, each checked to lie in the memory the part keeps ([`Part::local`]).
pub(crate) struct LocalRanges<'a> {
    body: &'a PartBody,
    memory: &'a Arc<dyn PinnedMemory>,
}

impl LocalRanges<'_> {
    /// Feeds the bytes, in wire order, to a data-MAC hasher.
    pub(crate) fn hash_into(&self, h: &mut blake3::Hasher) {
        for_each_slice(self, |b| {
            h.update(b);
        });
    }
}

// SAFETY: `Part::local` made the value only after finding every local range (a strided body's
// whole span) inside `memory`, which the borrowed part keeps alive, and the ranges yielded
// are exactly those ranges (or pieces of the span); `PinnedMemory` vouches for them.
unsafe impl PinnedRanges for LocalRanges<'_> {
    fn for_each_range(&self, mut f: impl FnMut(u64, u64)) {
        match self.body {
            PartBody::Data(segs) => segs.iter().for_each(|s| f(s.local, s.len)),
            PartBody::Strided(st) => st.local_ranges().for_each(|(a, n)| f(a, n)),
            PartBody::Notify(_) => {}
        }
    }

    fn strided(&self) -> Option<StridedShape> {
        match self.body {
            PartBody::Strided(st) => {
                Some(StridedShape { addr: st.local, count: st.count, size: st.size, stride: st.lstride })
            }
            _ => None,
        }
    }
}

// SAFETY: every range lies in `memory` (checked by `Part::local`, see above).
unsafe impl KeptRanges for LocalRanges<'_> {
    fn keeper(&self) -> &Arc<dyn PinnedMemory> {
        self.memory
    }
}
