//! The target ranges of one served data frame (a list of segments or one strided
//! descriptor): checked against the registry and pinned before a byte moves, then walked
//! lazily. A strided frame is never expanded into memory: its ranges come from
//! [`StridedRanges`] as they are needed, at most [`crate::transport::io::IOV_MAX`] iovecs at
//! a time, and a frame whose elements are not contiguous names at most
//! [`wire::MAX_STRIDED_ELEMS`] of them.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::registry::{Abort, Pin, Registry};
use crate::transport::io::nbio::IoJob;
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

    /// Adds the ranges to `job` (a strided descriptor stays lazy there too).
    ///
    /// # Safety
    /// As for [`IoJob::push_raw`]: the ranges must lie in registered regions that stay pinned
    /// while the job lives.
    pub(crate) unsafe fn push_into(&self, job: &mut IoJob) {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                OwnedRanges::List(segs) => segs.iter().for_each(|s| job.push_raw(s.addr, s.len)),
                OwnedRanges::Strided(st) => {
                    if let Some(r) = st.ranges() {
                        job.push_strided(r)
                    }
                }
            }
        }
    }

    /// Feeds the bytes of the ranges to a data-MAC hasher.
    ///
    /// # Safety
    /// The ranges must lie in registered regions that stay pinned during the call.
    pub(crate) unsafe fn hash(&self, h: &mut blake3::Hasher) {
        self.for_each(|addr, len| {
            // SAFETY: the caller guarantees the range is pinned, registered memory.
            unsafe {
                crate::sys::mem::with_bytes(addr, len, |b| {
                    h.update(b);
                })
            };
        });
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
