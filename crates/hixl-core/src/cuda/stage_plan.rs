//! Staging device memory over TCP, the pure part: how a request's segments are cut into
//! chunks that fit one pinned bounce slot, and in which order the copies (device <-> pinned
//! host) and the network transfers (pinned host <-> peer) of those chunks run so that they
//! overlap. No CUDA and no I/O here: `transport::staging` executes the steps this module
//! hands out, and the tests below check the plans on any machine.

use crate::queue::SegPair;

/// The most bytes one frame into or out of device memory may carry at a target (the largest
/// `hixl.cuda.stage_chunk`).
pub(crate) const MAX_FRAME: u64 = 64 << 20;

/// One piece of a chunk: `len` bytes of the caller's local memory at `local` (device memory,
/// or host memory when nothing is staged), which sit at offset `off` of the chunk's bounce
/// slot, and go to (or come from) `remote` at the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The caller's local address.
    pub local: u64,
    /// Offset in the bounce slot.
    pub off: u64,
    /// The peer's address.
    pub remote: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A chunk: pieces that fill one slot front to back (their offsets are contiguous from 0).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Its pieces, in order.
    pub pieces: Vec<Piece>,
    /// Their bytes in all (at most the slot size).
    pub bytes: u64,
}

impl Chunk {
    /// The network segments of this chunk when its local side is the slot at `slot` (pieces
    /// that continue each other at the peer are joined: the slot side is contiguous).
    pub(crate) fn net_segs(&self, slot: u64) -> Vec<SegPair> {
        let mut out: Vec<SegPair> = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            match out.last_mut() {
                Some(l) if l.remote + l.len == p.remote && l.local + l.len == slot + p.off => l.len += p.len,
                _ => out.push(SegPair { local: slot + p.off, remote: p.remote, len: p.len }),
            }
        }
        out
    }

    /// The network segments when nothing is staged (the local side is the caller's memory).
    pub(crate) fn direct_segs(&self) -> Vec<SegPair> {
        self.pieces.iter().map(|p| SegPair { local: p.local, remote: p.remote, len: p.len }).collect()
    }

    /// The copies between the caller's memory and the slot as (caller's address, slot offset,
    /// length): pieces that continue each other in the caller's memory are joined, so a
    /// contiguous request costs one copy per chunk.
    pub(crate) fn copies(&self) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64)> = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            match out.last_mut() {
                Some((l, o, n)) if *l + *n == p.local && *o + *n == p.off => *n += p.len,
                _ => out.push((p.local, p.off, p.len)),
            }
        }
        out
    }
}

/// Cuts `segs` into chunks of at most `slot` bytes and at most `max_pieces` pieces each; a
/// segment is cut where a chunk ends. Every byte appears exactly once, in order.
pub(crate) fn chunks(segs: &[SegPair], slot: u64, max_pieces: usize) -> Vec<Chunk> {
    let slot = slot.max(1);
    let max_pieces = max_pieces.max(1);
    let mut out = Vec::new();
    let mut cur = Chunk::default();
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            let take = s.len.min(slot - cur.bytes);
            cur.pieces.push(Piece { local: s.local, off: cur.bytes, remote: s.remote, len: take });
            cur.bytes += take;
            s = SegPair { local: s.local + take, remote: s.remote + take, len: s.len - take };
            if cur.bytes == slot || cur.pieces.len() == max_pieces {
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.pieces.is_empty() {
        out.push(cur);
    }
    out
}

/// Which way the bytes of a staged request flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    /// Device memory here to the peer: copy a chunk to its slot, then send it.
    CopyThenNet,
    /// The peer to device memory here: receive a chunk into its slot, then copy it out.
    NetThenCopy,
    /// Host memory here, device memory at the peer: no copy here, only chunked transfers
    /// (the target stages), at most `depth` in flight.
    NetOnly,
}

/// The next thing to do for a staged request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// Issue the copy of chunk k (asynchronous).
    Copy(usize),
    /// Wait until the copy of chunk k ended.
    WaitCopy(usize),
    /// Hand chunk k to the network (asynchronous).
    Net(usize),
    /// Wait until the network transfer of chunk k ended.
    WaitNet(usize),
    /// Every chunk went both ways.
    Done,
}

/// The order of a staged request's steps over a ring of `depth` slots (chunk k uses slot
/// `k % depth`). A slot is busy from the first step of its chunk until the last one ended,
/// so at most `depth` chunks are under way; within that bound copies run ahead of the network
/// (CopyThenNet) or the network runs ahead of the copies (NetThenCopy), which is the overlap:
/// the copy of chunk k+1 runs while chunk k is on the wire.
#[derive(Clone, Debug)]
pub(crate) struct Pipeline {
    n: usize,
    depth: usize,
    flow: Flow,
    copy_issued: usize,
    copy_done: usize,
    net_issued: usize,
    net_done: usize,
}

impl Pipeline {
    /// `n` chunks over `depth` slots (at least 1).
    pub(crate) fn new(n: usize, depth: usize, flow: Flow) -> Pipeline {
        let (copy_issued, copy_done) = if flow == Flow::NetOnly { (n, n) } else { (0, 0) };
        Pipeline { n, depth: depth.max(1), flow, copy_issued, copy_done, net_issued: 0, net_done: 0 }
    }

    /// The step to take now.
    pub(crate) fn next(&self) -> Act {
        match self.flow {
            Flow::CopyThenNet => {
                if self.copy_issued < self.n && self.copy_issued < self.net_done + self.depth {
                    Act::Copy(self.copy_issued)
                } else if self.net_issued < self.copy_issued {
                    if self.copy_done > self.net_issued {
                        Act::Net(self.net_issued)
                    } else {
                        Act::WaitCopy(self.copy_done)
                    }
                } else if self.net_done < self.net_issued {
                    Act::WaitNet(self.net_done)
                } else {
                    Act::Done
                }
            }
            Flow::NetThenCopy => {
                if self.net_issued < self.n && self.net_issued < self.copy_done + self.depth {
                    Act::Net(self.net_issued)
                } else if self.copy_issued < self.net_issued {
                    if self.net_done > self.copy_issued {
                        Act::Copy(self.copy_issued)
                    } else {
                        Act::WaitNet(self.net_done)
                    }
                } else if self.copy_done < self.copy_issued {
                    Act::WaitCopy(self.copy_done)
                } else {
                    Act::Done
                }
            }
            Flow::NetOnly => {
                if self.net_issued < self.n && self.net_issued < self.net_done + self.depth {
                    Act::Net(self.net_issued)
                } else if self.net_done < self.net_issued {
                    Act::WaitNet(self.net_done)
                } else {
                    Act::Done
                }
            }
        }
    }

    /// Records that `act` (the step `next` returned) was taken.
    pub(crate) fn did(&mut self, act: Act) {
        match act {
            Act::Copy(_) => self.copy_issued += 1,
            Act::WaitCopy(_) => self.copy_done += 1,
            Act::Net(_) => self.net_issued += 1,
            Act::WaitNet(_) => self.net_done += 1,
            Act::Done => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(local: u64, remote: u64, len: u64) -> SegPair {
        SegPair { local, remote, len }
    }

    /// Runs a pipeline to the end, checking the slot rule at every step; returns its steps.
    fn run(n: usize, depth: usize, flow: Flow) -> Vec<Act> {
        let mut p = Pipeline::new(n, depth, flow);
        let mut steps = Vec::new();
        // Per chunk: copy issued, copy ended, net issued, net ended.
        let mut state = vec![[false; 4]; n];
        loop {
            let a = p.next();
            if a == Act::Done {
                break;
            }
            match a {
                Act::Copy(k) => {
                    assert!(!state[k][0], "copy {k} twice");
                    if flow == Flow::NetThenCopy {
                        assert!(state[k][3], "copy {k} before its bytes arrived");
                    }
                    state[k][0] = true;
                }
                Act::WaitCopy(k) => {
                    assert!(state[k][0] && !state[k][1]);
                    state[k][1] = true;
                }
                Act::Net(k) => {
                    assert!(!state[k][2], "net {k} twice");
                    if flow == Flow::CopyThenNet {
                        assert!(state[k][1], "chunk {k} sent before its copy ended");
                    }
                    state[k][2] = true;
                }
                Act::WaitNet(k) => {
                    assert!(state[k][2] && !state[k][3]);
                    state[k][3] = true;
                }
                Act::Done => unreachable!(),
            }
            // A chunk holds its slot from its first step until its last one ended.
            let busy = state
                .iter()
                .filter(|s| match flow {
                    Flow::CopyThenNet => s[0] && !s[3],
                    Flow::NetThenCopy => s[2] && !s[1],
                    Flow::NetOnly => s[2] && !s[3],
                })
                .count();
            assert!(busy <= depth, "{busy} slots busy with depth {depth} after {a:?}");
            p.did(a);
            steps.push(a);
            assert!(steps.len() <= 4 * n + 1, "no progress");
        }
        for (k, s) in state.iter().enumerate() {
            let want = if flow == Flow::NetOnly { [false, false, true, true] } else { [true; 4] };
            assert_eq!(*s, want, "chunk {k}");
        }
        steps
    }

    #[test]
    fn device_to_peer_copies_ahead_while_earlier_chunks_are_on_the_wire() {
        let steps = run(6, 3, Flow::CopyThenNet);
        let at = |a: Act| steps.iter().position(|x| *x == a).unwrap();
        // The copy of chunk 1 is issued before chunk 0 has left, and chunk 3 (slot 0 again)
        // is copied only after chunk 0's transfer ended.
        assert!(at(Act::Copy(1)) < at(Act::WaitNet(0)));
        assert!(at(Act::Copy(2)) < at(Act::Net(0)));
        assert!(at(Act::Copy(3)) > at(Act::WaitNet(0)));
        for depth in 1..5 {
            for n in 0..9 {
                run(n, depth, Flow::CopyThenNet);
            }
        }
    }

    #[test]
    fn peer_to_device_receives_ahead_while_earlier_chunks_are_copied() {
        let steps = run(6, 3, Flow::NetThenCopy);
        let at = |a: Act| steps.iter().position(|x| *x == a).unwrap();
        assert!(at(Act::Net(2)) < at(Act::Copy(0)));
        // Chunk 1's bytes arrive while chunk 0's copy runs (it is waited for only later).
        assert!(at(Act::Copy(0)) < at(Act::WaitNet(1)));
        assert!(at(Act::WaitNet(1)) < at(Act::WaitCopy(0)));
        assert!(at(Act::Net(3)) > at(Act::WaitCopy(0)));
        for depth in 1..5 {
            for n in 0..9 {
                run(n, depth, Flow::NetThenCopy);
            }
        }
    }

    #[test]
    fn host_to_peer_device_memory_keeps_depth_transfers_in_flight() {
        let steps = run(5, 2, Flow::NetOnly);
        assert_eq!(&steps[..3], &[Act::Net(0), Act::Net(1), Act::WaitNet(0)]);
        assert!(run(0, 2, Flow::NetOnly).is_empty());
    }

    #[test]
    fn chunks_fill_slots_and_cover_every_byte_once_in_order() {
        let segs = [seg(0x1000, 0x9000, 10), seg(0x2000, 0xa000, 3), seg(0x3000, 0xb000, 9)];
        let c = chunks(&segs, 8, 100);
        assert_eq!(c.iter().map(|c| c.bytes).collect::<Vec<_>>(), vec![8, 8, 6]);
        assert_eq!(
            c[1].pieces,
            vec![
                Piece { local: 0x1008, off: 0, remote: 0x9008, len: 2 },
                Piece { local: 0x2000, off: 2, remote: 0xa000, len: 3 },
                Piece { local: 0x3000, off: 5, remote: 0xb000, len: 3 },
            ]
        );
        // Offsets are contiguous from 0 in every chunk; all bytes, in order.
        let mut flat = Vec::new();
        for ch in &c {
            let mut off = 0;
            for p in &ch.pieces {
                assert_eq!(p.off, off);
                off += p.len;
                flat.extend((0..p.len).map(|i| (p.local + i, p.remote + i)));
            }
        }
        let want: Vec<_> =
            segs.iter().flat_map(|s| (0..s.len).map(move |i| (s.local + i, s.remote + i))).collect();
        assert_eq!(flat, want);
        assert!(chunks(&[], 8, 100).is_empty());
    }

    #[test]
    fn chunks_cap_pieces_and_join_what_continues() {
        // 1024 scattered 64 KiB blocks into 4 MiB slots: 64 blocks per chunk.
        let segs: Vec<SegPair> =
            (0..1024u64).map(|i| seg(i * 3 * 65536, (1023 - i) * 2 * 65536, 65536)).collect();
        let c = chunks(&segs, 4 << 20, 1 << 16);
        assert_eq!(c.len(), 16);
        assert!(c.iter().all(|c| c.bytes == 4 << 20 && c.pieces.len() == 64));
        // The piece cap cuts a chunk early.
        let tiny: Vec<SegPair> = (0..10u64).map(|i| seg(i * 100, i * 100, 1)).collect();
        assert_eq!(
            chunks(&tiny, 1 << 20, 4).iter().map(|c| c.pieces.len()).collect::<Vec<_>>(),
            vec![4, 4, 2]
        );
        // One contiguous region: one copy and one network segment per chunk.
        let c = chunks(&[seg(0x10_0000, 0x80_0000, 10 << 20)], 4 << 20, 1 << 16);
        assert_eq!(c.len(), 3);
        assert_eq!(c[1].copies(), vec![(0x10_0000 + (4 << 20), 0, 4 << 20)]);
        assert_eq!(c[1].net_segs(0x7000), vec![seg(0x7000, 0x80_0000 + (4 << 20), 4 << 20)]);
        // Pieces contiguous at the peer but not here: two copies, one network segment.
        let c = chunks(&[seg(0x1000, 0x9000, 4), seg(0x5000, 0x9004, 4)], 64, 16);
        assert_eq!(c[0].copies(), vec![(0x1000, 0, 4), (0x5000, 4, 4)]);
        assert_eq!(c[0].net_segs(0x100), vec![seg(0x100, 0x9000, 8)]);
        assert_eq!(c[0].direct_segs(), vec![seg(0x1000, 0x9000, 4), seg(0x5000, 0x9004, 4)]);
    }
}
