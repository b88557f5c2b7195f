//! A strided range walked lazily: the contiguous ranges of `count` elements of `size` bytes,
//! `stride` apart, one at a time, so that a peer-sized count never becomes memory. Elements
//! that touch (stride == size) are one range. Pure code, no I/O: the target's served streams
//! and the initiator's data paths take iovecs from it a chunk at a time (see docs/PROTOCOL.md,
//! "Strided frames").

use super::{StridedSeg, WireError, MAX_STRIDED_ELEMS};

/// The contiguous ranges, as (address, length), of a strided range, in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedRanges {
    next: u64,
    len: u64,
    stride: u64,
    left: u64,
}

impl StridedRanges {
    /// `count` elements of `size` bytes at `addr + i * stride`; None when `size` is 0, the
    /// elements overlap (`stride < size`), or the range overflows the address space.
    pub fn new(addr: u64, count: u64, size: u64, stride: u64) -> Option<StridedRanges> {
        if size == 0 || stride < size {
            return None;
        }
        if count == 0 {
            return Some(StridedRanges { next: addr, len: size, stride, left: 0 });
        }
        let span = (count - 1).checked_mul(stride)?.checked_add(size)?;
        addr.checked_add(span)?;
        Some(if stride == size {
            StridedRanges { next: addr, len: span, stride: span, left: 1 }
        } else {
            StridedRanges { next: addr, len: size, stride, left: count }
        })
    }

    /// How many ranges `count` elements of `size` bytes, `stride` apart, are: 1 when they touch
    /// (stride == size), else `count`.
    pub fn pieces(count: u64, size: u64, stride: u64) -> u64 {
        if stride == size {
            count.min(1)
        } else {
            count
        }
    }

    /// Ranges not yet yielded.
    pub fn remaining(&self) -> u64 {
        self.left
    }
}

impl Iterator for StridedRanges {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.left == 0 {
            return None;
        }
        let at = self.next;
        self.left -= 1;
        if self.left > 0 {
            // Cannot overflow: `new` checked the whole span.
            self.next += self.stride;
        }
        Some((at, self.len))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = usize::try_from(self.left).unwrap_or(usize::MAX);
        (n, usize::try_from(self.left).ok())
    }
}

impl StridedSeg {
    /// Its contiguous ranges, walked lazily; None for a descriptor no decoder accepts (size 0,
    /// overlapping elements, overflow).
    pub fn ranges(&self) -> Option<StridedRanges> {
        StridedRanges::new(self.addr, self.count, self.size, self.stride)
    }

    /// How many separate ranges it names (see [`StridedRanges::pieces`]).
    pub fn pieces(&self) -> u64 {
        StridedRanges::pieces(self.count, self.size, self.stride)
    }

    /// Refuses a frame whose elements are not contiguous and more than
    /// [`MAX_STRIDED_ELEMS`]: a target serves at most that many separate ranges per frame.
    pub fn check_elems(&self) -> Result<(), WireError> {
        if self.pieces() > MAX_STRIDED_ELEMS {
            return Err(WireError::TooLarge {
                field: "strided count (elements not contiguous)",
                value: self.count,
                limit: MAX_STRIDED_ELEMS,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_elements_are_one_range() {
        let r = StridedRanges::new(0x1000, 8 << 20, 1, 1).unwrap();
        assert_eq!(r.remaining(), 1);
        assert_eq!(r.collect::<Vec<_>>(), vec![(0x1000, 8 << 20)]);
        assert_eq!(StridedRanges::pieces(8 << 20, 1, 1), 1);
        assert_eq!(StridedRanges::pieces(0, 4, 4), 0);
    }

    #[test]
    fn gaps_give_one_range_per_element_lazily() {
        let mut r = StridedRanges::new(100, 5, 8, 64).unwrap();
        assert_eq!(r.size_hint(), (5, Some(5)));
        assert_eq!(r.next(), Some((100, 8)));
        assert_eq!(r.remaining(), 4);
        assert_eq!(r.collect::<Vec<_>>(), vec![(164, 8), (228, 8), (292, 8), (356, 8)]);
        // A billion elements cost nothing until walked.
        let big = StridedRanges::new(0, 1 << 30, 1, 2).unwrap();
        assert_eq!(std::mem::size_of_val(&big), 32);
        assert_eq!(big.remaining(), 1 << 30);
    }

    #[test]
    fn bad_descriptors_are_refused() {
        assert_eq!(StridedRanges::new(0, 4, 0, 4), None, "size 0");
        assert_eq!(StridedRanges::new(0, 4, 8, 4), None, "overlapping");
        assert_eq!(StridedRanges::new(0, u64::MAX, 2, 2), None, "span overflows");
        assert_eq!(StridedRanges::new(u64::MAX - 10, 2, 8, 8), None, "address overflows");
        // The last byte of the address space is reachable, one past it is not.
        assert!(StridedRanges::new(u64::MAX - 16, 2, 8, 8).is_some());
        assert_eq!(StridedRanges::new(0, 0, 8, 8).unwrap().next(), None);
    }

    #[test]
    fn the_element_cap_counts_separate_ranges() {
        let seg = |count, size, stride| StridedSeg { addr: 0, count, size, stride };
        assert!(seg(MAX_STRIDED_ELEMS, 1, 2).check_elems().is_ok());
        let e = seg(MAX_STRIDED_ELEMS + 1, 1, 2).check_elems().unwrap_err().to_string();
        assert!(e.contains(&(MAX_STRIDED_ELEMS + 1).to_string()), "{e}");
        assert!(e.contains(&MAX_STRIDED_ELEMS.to_string()), "{e}");
        assert!(seg(u64::MAX / 4, 1, 1).check_elems().is_ok(), "contiguous: one range");
    }
}
