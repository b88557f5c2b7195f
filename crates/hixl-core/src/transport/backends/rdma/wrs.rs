//! A part's segments as RDMA work requests: one request per contiguous remote range inside one
//! remote region (at most the port's message size), carrying up to the device's SGE limit of local pieces (`Limits`), and
//! local pieces that follow each other in one local region merged into one SGE. Every remote
//! range is checked against the peer's table here (its region and rkey), every local one
//! against this NIC's registrations (its lkey). The rkey is the one the peer's region key holds
//! for the peer's rail the QP is connected to.

use super::nic::Nic;
use super::verbs::{SendWr, Sge, WrOp};
use crate::error::{Error, Result};
use crate::queue::{Part, PartBody, SegPair, TransferOp};
use crate::registry::RemoteTable;
use crate::wire::rdma::decode_rkeys;

/// The work requests of one part on a QP of `nic` connected to the peer's rail `peer_rail`
/// (wr_id and signaled are set when they are posted).
pub(super) fn build(nic: &Nic, table: &RemoteTable, part: &Part, peer_rail: u8) -> Result<Vec<SendWr>> {
    let (op, max_sge) = match part.req.op {
        TransferOp::Write => (WrOp::Write, nic.limits.sge_write),
        TransferOp::Read => (WrOp::Read, nic.limits.sge_read),
    };
    let lookup = |addr: u64, len: u64| nic.lkey(addr, len);
    let mut b = Builder {
        op,
        out: Vec::new(),
        max_msg: nic.limits.max_msg,
        max_sge: max_sge as usize,
        rail: peer_rail,
    };
    match &part.body {
        PartBody::Data(segs) => segs.iter().try_for_each(|s| b.seg(table, &lookup, *s))?,
        PartBody::Strided(st) => {
            st.for_each_chunk(1024, |c| c.iter().try_for_each(|s| b.seg(table, &lookup, *s)))?
        }
        PartBody::Notify(_) => return Err(Error::failed("a notification reached the RDMA data path")),
    }
    Ok(b.out)
}

struct Builder {
    op: WrOp,
    out: Vec<SendWr>,
    max_msg: u64,
    /// SGEs per request.
    max_sge: usize,
    /// The peer's rail: which of a region's rkeys applies.
    rail: u8,
}

impl Builder {
    /// Adds one segment, cut where its remote region, its local region or the message size
    /// ends.
    fn seg(
        &mut self,
        table: &RemoteTable,
        lkey: &impl Fn(u64, u64) -> Option<(u32, u64)>,
        s: SegPair,
    ) -> Result<()> {
        let (mut local, mut remote, mut left) = (s.local, s.remote, s.len);
        while left > 0 {
            let e = table.find(remote, 1).ok_or_else(|| {
                Error::param(format!("remote range 0x{remote:x}+{left} is not registered at the peer"))
            })?;
            let rkey = match e.key(super::NAME).map(decode_rkeys) {
                Some(Ok(k)) => match k.get(self.rail as usize) {
                    Some(k) => *k,
                    None => {
                        return Err(Error::param(format!(
                            "the peer's region 0x{:x}+{} has RDMA keys for {} rails, none for its rail {}",
                            e.addr,
                            e.len,
                            k.len(),
                            self.rail
                        )))
                    }
                },
                _ => {
                    return Err(Error::param(format!(
                        "the peer's region 0x{:x}+{} has no RDMA key (registered while its rdma backend was off?)",
                        e.addr, e.len
                    )))
                }
            };
            let (lk, lend) = lkey(local, 1).ok_or_else(|| {
                Error::param(format!("local range 0x{local:x}+{left} is not registered with the RDMA device"))
            })?;
            let n = left.min(e.addr + e.len - remote).min(lend - local).min(self.max_msg);
            self.piece(local, remote, n, lk, rkey);
            local += n;
            remote += n;
            left -= n;
        }
        Ok(())
    }

    fn piece(&mut self, local: u64, remote: u64, len: u64, lkey: u32, rkey: u32) {
        if let Some(w) = self.out.last_mut() {
            let joins =
                w.rkey == rkey && w.remote_addr + w.bytes() == remote && w.bytes() + len <= self.max_msg;
            if joins {
                let last = w.sges.last_mut().expect("a request has an SGE");
                if last.lkey == lkey && last.addr + last.length as u64 == local {
                    last.length += len as u32;
                    return;
                }
                if w.sges.len() < self.max_sge {
                    w.sges.push(Sge { addr: local, length: len as u32, lkey });
                    return;
                }
            }
        }
        self.out.push(SendWr {
            wr_id: 0,
            op: self.op,
            sges: vec![Sge { addr: local, length: len as u32, lkey }],
            signaled: false,
            remote_addr: remote,
            rkey,
            inline: false,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{BackendKey, RegionEntry};

    fn table() -> RemoteTable {
        let key = |k: &[u32]| {
            vec![BackendKey {
                backend: crate::transport::backends::rdma::NAME.into(),
                key: crate::wire::rdma::encode_rkeys(k),
            }]
        };
        // Two adjacent remote regions, one without an rdma key, one registered on two rails.
        RemoteTable::new(vec![
            RegionEntry { keys: key(&[11]), ..RegionEntry::host(0x10000, 0x1000, 1) },
            RegionEntry { keys: key(&[22]), ..RegionEntry::host(0x11000, 0x1000, 2) },
            RegionEntry::host(0x20000, 0x1000, 3),
            RegionEntry { keys: key(&[33, 44]), ..RegionEntry::host(0x30000, 0x1000, 4) },
        ])
    }

    /// Local memory: one region [0x1000, 0x3000) with lkey 7.
    fn lkey(addr: u64, len: u64) -> Option<(u32, u64)> {
        (addr >= 0x1000 && addr + len <= 0x3000).then_some((7, 0x3000))
    }

    /// SGEs per request in these tests (a device's limit).
    const SGE: usize = 16;

    fn build(segs: &[(u64, u64, u64)], max_msg: u64) -> Result<Vec<SendWr>> {
        build_sge(segs, max_msg, SGE)
    }

    fn build_sge(segs: &[(u64, u64, u64)], max_msg: u64, max_sge: usize) -> Result<Vec<SendWr>> {
        build_on(segs, max_msg, max_sge, 0)
    }

    fn build_on(segs: &[(u64, u64, u64)], max_msg: u64, max_sge: usize, rail: u8) -> Result<Vec<SendWr>> {
        let mut b = Builder { op: WrOp::Write, out: Vec::new(), max_msg, max_sge, rail };
        for &(local, remote, len) in segs {
            b.seg(&table(), &lkey, SegPair { local, remote, len })?;
        }
        Ok(b.out)
    }

    #[test]
    fn contiguous_remote_ranges_chain_sges_and_adjacent_local_pieces_merge() {
        // Remote contiguous, local scattered: one request with three SGEs.
        let w =
            build(&[(0x1000, 0x10000, 16), (0x1100, 0x10010, 16), (0x1200, 0x10020, 16)], 1 << 30).unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].sges.len(), 3);
        assert_eq!((w[0].remote_addr, w[0].rkey, w[0].bytes()), (0x10000, 11, 48));
        // Both contiguous: one SGE.
        let w = build(&[(0x1000, 0x10000, 16), (0x1010, 0x10010, 16)], 1 << 30).unwrap();
        assert_eq!((w.len(), w[0].sges.len(), w[0].sges[0].length), (1, 1, 32));
        // A remote gap: two requests.
        assert_eq!(build(&[(0x1000, 0x10000, 16), (0x1010, 0x10100, 16)], 1 << 30).unwrap().len(), 2);
    }

    #[test]
    fn requests_are_cut_at_remote_regions_the_message_size_and_the_sge_limit() {
        // Crosses from region 1 (rkey 11) into the adjacent region 2 (rkey 22).
        let w = build(&[(0x1000, 0x10F00, 0x200)], 1 << 30).unwrap();
        assert_eq!(
            w.iter().map(|w| (w.remote_addr, w.rkey, w.bytes())).collect::<Vec<_>>(),
            [(0x10F00, 11, 0x100), (0x11000, 22, 0x100)]
        );
        let w = build(&[(0x1000, 0x10000, 0x1000)], 0x400).unwrap();
        assert_eq!(w.len(), 4, "at most max_msg per request");
        let segs: Vec<_> = (0..SGE as u64 + 1).map(|i| (0x1000 + i * 32, 0x10000 + i * 16, 16)).collect();
        let w = build(&segs, 1 << 30).unwrap();
        assert_eq!(w.iter().map(|w| w.sges.len()).collect::<Vec<_>>(), [SGE, 1]);
        // A device with 4 SGEs per request: the same 17 pieces take five requests.
        let w = build_sge(&segs, 1 << 30, 4).unwrap();
        assert_eq!(w.iter().map(|w| w.sges.len()).collect::<Vec<_>>(), [4, 4, 4, 4, 1]);
    }

    /// A QP to the peer's rail N carries the region's Nth rkey; a region with fewer keys (a peer
    /// of fewer rails) is refused naming that.
    #[test]
    fn the_rkey_is_the_one_of_the_peer_rail() {
        let rkey = |rail| build_on(&[(0x1000, 0x30000, 8)], 1 << 30, SGE, rail).map(|w| w[0].rkey);
        assert_eq!((rkey(0).unwrap(), rkey(1).unwrap()), (33, 44));
        let e = rkey(2).unwrap_err();
        assert!(e.message.contains("keys for 2 rails, none for its rail 2"), "{e}");
        let e = build_on(&[(0x1000, 0x10000, 8)], 1 << 30, SGE, 1).unwrap_err();
        assert!(e.message.contains("keys for 1 rails"), "{e}");
    }

    #[test]
    fn unregistered_or_keyless_ranges_are_refused_naming_them() {
        let e = build(&[(0x1000, 0x40000, 8)], 1 << 30).unwrap_err();
        assert!(e.message.contains("0x40000") && e.message.contains("not registered at the peer"), "{e}");
        let e = build(&[(0x1000, 0x20000, 8)], 1 << 30).unwrap_err();
        assert!(e.message.contains("no RDMA key"), "{e}");
        let e = build(&[(0x9000, 0x10000, 8)], 1 << 30).unwrap_err();
        assert!(e.message.contains("0x9000") && e.message.contains("RDMA device"), "{e}");
    }
}
