//! The target ranges of one served data frame (a list of segments or one strided
//! descriptor): checked against the registry and pinned before a byte moves, then walked
//! lazily. A strided frame is never expanded into memory: its ranges come from
//! [`StridedRanges`] as they are needed, at most [`crate::transport::io::IOV_MAX`] iovecs at
//! a time, and a frame whose elements are not contiguous names at most
//! [`wire::MAX_STRIDED_ELEMS`] of them.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::registry::{Abort, Pin, Registry};
use crate::sys::mem::{PinnedRanges, StridedShape};
use crate::wire::{self, Seg, StridedSeg};

/// The target ranges of one data frame: a list of segments or one strided descriptor.
pub(crate) enum OwnedRanges {
    List(Vec<Seg>),
    Strided(StridedSeg),
}

impl OwnedRanges {
    /// Bytes the ranges hold, or None on overflow.
    pub(crate) fn bytes(&self) -> Option<u64> {
        match self {
            OwnedRanges::List(segs) => wire::total_len(segs).ok(),
            OwnedRanges::Strided(st) => st.bytes(),
        }
    }

    /// Checks the ranges against the registry (and a strided frame against the element cap)
    /// and pins their regions on behalf of `holder`.
    pub(crate) fn pin(&self, reg: &Registry, holder: &Arc<dyn Abort>, write: bool) -> Result<Vec<Pin>> {
        match self {
            OwnedRanges::List(segs) => check_and_pin(reg, segs, holder, write),
            OwnedRanges::Strided(st) => {
                st.check_elems().map_err(|e| {
                    Error::param(format!(
                        "{e} (count={}, size={}, stride={}): a strided frame names at most \
                         MAX_STRIDED_ELEMS separate elements; split it into several frames",
                        st.count, st.size, st.stride
                    ))
                })?;
                let span = st.span().ok_or_else(|| Error::param("strided range overflows"))?;
                let region = reg.lookup_for(st.addr, span, "remote strided", write)?;
                Ok(vec![region.pin(holder)?])
            }
        }
    }

    /// Calls `f` with every contiguous (address, length) of the ranges, in order, walking a
    /// strided descriptor lazily (touching elements as one range).
    pub(crate) fn for_each(&self, mut f: impl FnMut(u64, u64)) {
        match self {
            OwnedRanges::List(segs) => segs.iter().for_each(|s| f(s.addr, s.len)),
            OwnedRanges::Strided(st) => st.ranges().into_iter().flatten().for_each(|(a, n)| f(a, n)),
        }
    }
}

/// A frame's target ranges with the pins that keep them registered: built only by
/// [`PinnedFrame::pin`], which checks every range against the registry before it pins, so its
/// ranges are memory the application registered (and promised valid at `register_mem`) that
/// cannot be deregistered while the value lives. Its bytes then move through safe calls (an
/// `IoJob` that keeps it, [`PinnedFrame::hash`]).
pub(crate) struct PinnedFrame {
    ranges: OwnedRanges,
    pins: Vec<Pin>,
}

impl PinnedFrame {
    /// Checks `ranges` against the registry (see [`OwnedRanges::pin`]) and pins their regions
    /// on behalf of `holder`.
    pub(crate) fn pin(
        ranges: OwnedRanges,
        reg: &Registry,
        holder: &Arc<dyn Abort>,
        write: bool,
    ) -> Result<Self> {
        let pins = ranges.pin(reg, holder, write)?;
        Ok(PinnedFrame { ranges, pins })
    }

    /// The pins.
    pub(crate) fn pins(&self) -> &[Pin] {
        &self.pins
    }

    /// The ranges.
    pub(crate) fn ranges(&self) -> &OwnedRanges {
        &self.ranges
    }

    /// Feeds the bytes of the ranges to a data-MAC hasher.
    pub(crate) fn hash(&self, h: &mut blake3::Hasher) {
        crate::sys::mem::for_each_slice(self, |b| {
            h.update(b);
        });
    }
}

// SAFETY: a PinnedFrame is built only by `PinnedFrame::pin` (its fields are private to this
// module), which checks every range against the registry (`Registry::lookup_for`: each list
// segment, or a strided frame's whole span, lies inside one registered region, writable when
// `write`) and pins those regions, keeping the pins in `pins`. Deregistration does not succeed
// while a pin lives (`close_and_drain` refuses new pins, waits, aborts the holders and fails
// if pins remain), and the application promised (at the unsafe function `register_mem*`) that
// registered memory stays valid until its deregistration succeeds; the pins live as long as
// the value, and that memory is the application's, not the value's, so it stays put when the
// value moves. The strided shape is the descriptor `ranges` walks, so the two agree.
unsafe impl PinnedRanges for PinnedFrame {
    fn for_each_range(&self, f: impl FnMut(u64, u64)) {
        self.ranges.for_each(f)
    }

    fn strided(&self) -> Option<StridedShape> {
        match &self.ranges {
            OwnedRanges::List(_) => None,
            OwnedRanges::Strided(st) => {
                Some(StridedShape { addr: st.addr, count: st.count, size: st.size, stride: st.stride })
            }
        }
    }
}

/// Checks every segment against the registry and pins the regions they fall in.
fn check_and_pin(reg: &Registry, segs: &[Seg], holder: &Arc<dyn Abort>, write: bool) -> Result<Vec<Pin>> {
    let mut pins: Vec<Pin> = Vec::new();
    for s in segs {
        if let Some(p) = pins.last() {
            if p.region().contains(s.addr, s.len) {
                continue;
            }
        }
        let region = reg.lookup_for(s.addr, s.len, "remote", write)?;
        if !pins.iter().any(|p| p.region().id == region.id) {
            pins.push(region.pin(holder)?);
        }
    }
    Ok(pins)
}
