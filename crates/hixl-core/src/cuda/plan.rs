//! How one request's copies are spread over the stream pool (`hixl.cuda.streams`): pure
//! arithmetic, tested without a GPU.
//!
//! A request's segments are cut into at most `streams` shares of about equal bytes (a segment
//! is cut where a share ends, never into pieces below `min_share` bytes), and share i goes to
//! stream `(first + i) % streams`, where `first` turns round from request to request, so that
//! small requests do not all queue behind one stream while the others idle.

use crate::queue::SegPair;

/// The shares of `segs` as (stream index, segments), at most `streams` of them, each at least
/// `min_share` bytes unless the whole request is smaller; every byte appears exactly once and
/// in order.
pub(crate) fn spread(
    segs: &[SegPair],
    streams: usize,
    first: usize,
    min_share: u64,
) -> Vec<(usize, Vec<SegPair>)> {
    let streams = streams.max(1);
    let total: u64 = segs.iter().map(|s| s.len).sum();
    if total == 0 {
        return vec![];
    }
    let n = ((total / min_share.max(1)) as usize).clamp(1, streams);
    let share = total.div_ceil(n as u64);
    let mut out: Vec<(usize, Vec<SegPair>)> = Vec::with_capacity(n);
    let mut cur: Vec<SegPair> = Vec::new();
    let mut filled = 0u64;
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            let room = share - filled;
            let take = s.len.min(room);
            cur.push(SegPair { local: s.local, remote: s.remote, len: take });
            filled += take;
            s = SegPair { local: s.local + take, remote: s.remote + take, len: s.len - take };
            if filled == share {
                out.push(((first + out.len()) % streams, std::mem::take(&mut cur)));
                filled = 0;
            }
        }
    }
    if !cur.is_empty() {
        out.push(((first + out.len()) % streams, cur));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> SegPair {
        SegPair { local, remote, len }
    }

    /// `segs` with pieces that continue each other (in both address spaces) joined: two lists
    /// that move the same bytes in the same order have equal normal forms.
    fn bytes(segs: &[SegPair]) -> Vec<SegPair> {
        let mut out: Vec<SegPair> = Vec::new();
        for s in segs.iter().filter(|s| s.len > 0) {
            match out.last_mut() {
                Some(l) if l.local + l.len == s.local && l.remote + l.len == s.remote => l.len += s.len,
                _ => out.push(*s),
            }
        }
        out
    }

    #[test]
    fn one_large_copy_is_cut_into_equal_shares_one_per_stream() {
        let segs = [seg(0x1000, 0x9000, 4 << 20)];
        let plan = spread(&segs, 4, 1, 64 << 10);
        assert_eq!(plan.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1, 2, 3, 0]);
        for (_, share) in &plan {
            assert_eq!(share.iter().map(|s| s.len).sum::<u64>(), 1 << 20);
        }
        let flat: Vec<SegPair> = plan.into_iter().flat_map(|(_, v)| v).collect();
        assert_eq!(bytes(&flat), bytes(&segs));
    }

    #[test]
    fn small_requests_use_one_stream_and_rotate() {
        let segs = [seg(0, 0, 4096)];
        assert_eq!(spread(&segs, 4, 0, 64 << 10), vec![(0, segs.to_vec())]);
        assert_eq!(spread(&segs, 4, 6, 64 << 10), vec![(2, segs.to_vec())]);
        assert!(spread(&[], 4, 0, 1).is_empty());
        // streams = 0 is read as 1.
        assert_eq!(spread(&segs, 0, 5, 1)[0].0, 0);
    }

    #[test]
    fn scattered_blocks_cover_every_byte_once_in_order_and_balance() {
        // 1024 blocks of 64 KiB at scattered addresses, as a KV cache's blocks are.
        let segs: Vec<SegPair> =
            (0..1024u64).map(|i| seg(i * 3 * 65536, (1023 - i) * 2 * 65536 + 17, 65536)).collect();
        for streams in [1, 3, 4, 7] {
            let plan = spread(&segs, streams, 0, 64 << 10);
            assert_eq!(plan.len(), streams);
            let sizes: Vec<u64> = plan.iter().map(|(_, v)| v.iter().map(|s| s.len).sum()).collect();
            let (lo, hi) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
            assert!(hi - lo <= (64u64 << 20).div_ceil(streams as u64), "{sizes:?}");
            let flat: Vec<SegPair> = plan.into_iter().flat_map(|(_, v)| v).collect();
            assert_eq!(bytes(&flat), bytes(&segs));
        }
    }

    #[test]
    fn min_share_limits_the_number_of_shares() {
        let segs = [seg(0, 0, 100 << 10)];
        // 100 KiB with 64 KiB minimum: one share, not four of 25 KiB.
        assert_eq!(spread(&segs, 4, 0, 64 << 10).len(), 1);
        assert_eq!(spread(&segs, 4, 0, 32 << 10).len(), 3);
    }
}
