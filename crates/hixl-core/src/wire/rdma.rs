//! What the `rdma` backend carries over the control channel, as pure encoding and decoding:
//! the payload of BackendOpen / BackendOpened (queue-pair addresses) and its region key (the
//! rkeys, one per rail). Every field a peer sends is checked here before the backend sees it.
//!
//! Multi-rail (docs/PROTOCOL.md): with one rail everything is byte for byte what it was before
//! rails existed (a 4-byte key; QP addresses with no rail section), so single-rail peers of
//! either age interoperate. A QP on another rail than 0 adds a rail section after the QP
//! addresses: [`RAILS_TAG`], one rail index per retired QP, one per QP address.
//!
//! READ depth: a QP address carries how many RDMA READs its QP keeps outstanding and how many
//! of its peer's it answers at once (its device's `max_qp_init_rd_atom` and `max_qp_rd_atom`,
//! cut to [`MAX_READS`]), so that an initiator never has more READs in flight than the
//! target's QP accepts. Where every QP's pair is the default ([`MAX_READS`] both ways, what
//! engines of before this section assumed) the section is left out, so such peers
//! interoperate byte for byte; otherwise [`READS_TAG`] and one pair per QP address follow.

use super::{Reader, WireError};

/// Most queue pairs one BackendOpen may ask for (`hixl.rdma.qps` is at most this).
pub const MAX_QPS: usize = 64;
/// Queue-pair numbers and packet sequence numbers are 24-bit.
pub const MAX_QPN: u32 = (1 << 24) - 1;
/// Most rails (devices) one engine uses, and so most rkeys in one region key.
pub const MAX_RAILS: usize = 8;
/// The byte that opens the rail section of an `rdma` BackendOpen(ed) payload.
pub const RAILS_TAG: u8 = 1;
/// The byte that opens the READ-depth section (after the rail section, if any).
pub const READS_TAG: u8 = 2;
/// Most RDMA READs a QP keeps outstanding or answers (what the backend asks of a device), and
/// the depth a QP address without a READ-depth section stands for.
pub const MAX_READS: u8 = 16;

/// The address of one RC queue pair: what its peer needs to move its own QP to RTR.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpAddr {
    /// The port's GID at the chosen GID index (RoCE routes by it; IB uses it with a GRH).
    pub gid: [u8; 16],
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Queue-pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number this QP sends (24 bits).
    pub psn: u32,
    /// The port's active MTU as `ibv_mtu` (1 = 256 ... 5 = 4096 bytes).
    pub mtu: u8,
    /// The rail (index into the sender's devices) the QP is on; below [`MAX_RAILS`].
    pub rail: u8,
    /// RDMA READs this QP keeps outstanding (its `max_rd_atomic` at most), 1 to [`MAX_READS`].
    pub reads_out: u8,
    /// RDMA READs of its peer this QP answers at once (its `max_dest_rd_atomic`), 1 to
    /// [`MAX_READS`].
    pub reads_in: u8,
}

impl QpAddr {
    /// Whether its READ depths are those a payload without a READ-depth section stands for.
    pub fn default_reads(&self) -> bool {
        (self.reads_out, self.reads_in) == (MAX_READS, MAX_READS)
    }
}

/// A QP of the target's side of a link, by rail and number (QP numbers are per device, so the
/// same number may be on two rails).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QpRef {
    /// The target's rail it is on.
    pub rail: u8,
    /// Its number.
    pub qpn: u32,
}

/// The payload of an `rdma` BackendOpen (initiator's QPs, plus target QPs of this link it
/// retires after an error) or BackendOpened (the target's QPs, `retire` empty).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RdmaOpen {
    /// Queue pairs of the target's side of this link that the initiator no longer uses.
    pub retire: Vec<QpRef>,
    /// Queue-pair addresses, one per QP to connect.
    pub qps: Vec<QpAddr>,
}

impl RdmaOpen {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(3 + 5 * self.retire.len() + 28 * self.qps.len());
        p.push(self.retire.len() as u8);
        for q in &self.retire {
            p.extend_from_slice(&q.qpn.to_le_bytes());
        }
        p.push(self.qps.len() as u8);
        for q in &self.qps {
            p.extend_from_slice(&q.gid);
            p.extend_from_slice(&q.lid.to_le_bytes());
            p.extend_from_slice(&q.qpn.to_le_bytes());
            p.extend_from_slice(&q.psn.to_le_bytes());
            p.push(q.mtu);
        }
        let rails = self.retire.iter().map(|r| r.rail).chain(self.qps.iter().map(|q| q.rail));
        if rails.clone().any(|r| r != 0) {
            p.push(RAILS_TAG);
            p.extend(rails);
        }
        if !self.qps.iter().all(QpAddr::default_reads) {
            p.push(READS_TAG);
            p.extend(self.qps.iter().flat_map(|q| [q.reads_out, q.reads_in]));
        }
        p
    }

    /// Decodes and checks a payload: counts within [`MAX_QPS`], 24-bit numbers, a known MTU,
    /// rails below [`MAX_RAILS`] (a rail section only where one rail is not 0), READ depths of
    /// 1 to [`MAX_READS`] (a READ-depth section only where one is not the default), nothing
    /// left over.
    pub fn decode(b: &[u8]) -> Result<RdmaOpen, WireError> {
        let mut r = Reader { b };
        let count = |r: &mut Reader<'_>, field| -> Result<usize, WireError> {
            let n = r.u8(field)? as usize;
            if n > MAX_QPS {
                return Err(WireError::TooLarge { field, value: n as u64, limit: MAX_QPS as u64 });
            }
            Ok(n)
        };
        let n = count(&mut r, "retired qp count")?;
        let mut retire = Vec::with_capacity(n);
        for _ in 0..n {
            retire.push(QpRef { rail: 0, qpn: qp_number(r.u32("retired qpn")?, "retired qpn")? });
        }
        let n = count(&mut r, "qp count")?;
        let mut qps = Vec::with_capacity(n);
        for _ in 0..n {
            let gid: [u8; 16] = r.take(16, "qp gid")?.try_into().expect("16 bytes");
            let lid = r.u16("qp lid")?;
            let qpn = qp_number(r.u32("qpn")?, "qpn")?;
            let psn = r.u32("qp psn")?;
            if psn > MAX_QPN {
                return Err(WireError::Invalid { field: "qp psn", value: psn as u64 });
            }
            let mtu = r.u8("qp mtu")?;
            if !(1..=5).contains(&mtu) {
                return Err(WireError::Invalid { field: "qp mtu", value: mtu as u64 });
            }
            qps.push(QpAddr { gid, lid, qpn, psn, mtu, rail: 0, reads_out: MAX_READS, reads_in: MAX_READS });
        }
        if let Some(&tag) = r.b.first() {
            if tag != RAILS_TAG && tag != READS_TAG {
                return Err(WireError::Invalid { field: "section tag", value: tag as u64 });
            }
        }
        if r.b.first() == Some(&RAILS_TAG) {
            r.u8("rail section")?;
            let rail = |r: &mut Reader<'_>| -> Result<u8, WireError> {
                let v = r.u8("qp rail")?;
                if v as usize >= MAX_RAILS {
                    return Err(WireError::TooLarge {
                        field: "qp rail",
                        value: v as u64,
                        limit: MAX_RAILS as u64 - 1,
                    });
                }
                Ok(v)
            };
            for q in &mut retire {
                q.rail = rail(&mut r)?;
            }
            for q in &mut qps {
                q.rail = rail(&mut r)?;
            }
            if retire.iter().all(|q| q.rail == 0) && qps.iter().all(|q| q.rail == 0) {
                // Only a payload with a QP off rail 0 has the section (one encoding per payload).
                return Err(WireError::Invalid { field: "rail section", value: 0 });
            }
        }
        if let Some(&tag) = r.b.first() {
            if tag != READS_TAG {
                return Err(WireError::Invalid { field: "section tag", value: tag as u64 });
            }
            r.u8("read depth section")?;
            for q in &mut qps {
                for (v, field) in [(&mut q.reads_out, "qp reads out"), (&mut q.reads_in, "qp reads in")] {
                    *v = r.u8(field)?;
                    if !(1..=MAX_READS).contains(v) {
                        return Err(WireError::Invalid { field, value: *v as u64 });
                    }
                }
            }
            if qps.iter().all(QpAddr::default_reads) {
                // Only a payload with a QP of another depth has the section.
                return Err(WireError::Invalid { field: "read depth section", value: MAX_READS as u64 });
            }
        }
        if !r.b.is_empty() {
            return Err(WireError::Trailing(r.b.len()));
        }
        Ok(RdmaOpen { retire, qps })
    }
}

fn qp_number(v: u32, field: &'static str) -> Result<u32, WireError> {
    if v == 0 || v > MAX_QPN {
        return Err(WireError::Invalid { field, value: v as u64 });
    }
    Ok(v)
}

/// The `rdma` region key: the rkey of the region's memory region on each rail, in rail order
/// (4 bytes little-endian each; one rail: the 4 bytes of one rkey, as before rails).
pub fn encode_rkeys(rkeys: &[u32]) -> Vec<u8> {
    rkeys.iter().flat_map(|k| k.to_le_bytes()).collect()
}

/// The rkeys of an `rdma` region key, one per rail of the peer: 1 to [`MAX_RAILS`] of them.
pub fn decode_rkeys(key: &[u8]) -> Result<Vec<u32>, WireError> {
    if key.is_empty() || key.len() % 4 != 0 || key.len() / 4 > MAX_RAILS {
        return Err(WireError::Invalid { field: "rdma region key length", value: key.len() as u64 });
    }
    Ok(key.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RdmaOpen {
        let q = |qpn| QpAddr {
            gid: [qpn as u8; 16],
            lid: 3,
            qpn,
            psn: 0xABCDE,
            mtu: 3,
            rail: 0,
            reads_out: MAX_READS,
            reads_in: MAX_READS,
        };
        RdmaOpen { retire: vec![QpRef { rail: 0, qpn: 17 }], qps: vec![q(5), q(MAX_QPN)] }
    }

    fn railed() -> RdmaOpen {
        let mut o = sample();
        o.retire[0].rail = 2;
        o.qps[1].rail = 1;
        o
    }

    #[test]
    fn qp_addresses_round_trip() {
        let o = sample();
        assert_eq!(RdmaOpen::decode(&o.encode()), Ok(o));
        assert_eq!(RdmaOpen::decode(&RdmaOpen::default().encode()), Ok(RdmaOpen::default()));
        assert_eq!(RdmaOpen::decode(&railed().encode()), Ok(railed()));
        assert_eq!(decode_rkeys(&encode_rkeys(&[0xDEAD_BEEF])), Ok(vec![0xDEAD_BEEF]));
        assert_eq!(decode_rkeys(&encode_rkeys(&[1, 2, 3])), Ok(vec![1, 2, 3]));
    }

    /// One rail: the bytes of before rails existed (a peer of then reads them, and we theirs).
    #[test]
    fn single_rail_encodings_are_those_of_before_rails() {
        assert_eq!(encode_rkeys(&[0x0403_0201]), [1, 2, 3, 4]);
        let o = sample().encode();
        assert_eq!(o.len(), 1 + 4 + 1 + 2 * 27, "no rail section");
        assert_eq!(&o[1..5], &17u32.to_le_bytes());
        let r = railed().encode();
        assert_eq!(r.len(), o.len() + 1 + 3, "the tag and one rail per retired QP and per QP");
        assert_eq!(&r[o.len()..], &[RAILS_TAG, 2, 0, 1]);
    }

    #[test]
    fn hostile_rail_sections_and_keys_are_refused() {
        let base = sample().encode();
        let with = |tail: &[u8]| [&base[..], tail].concat();
        assert_eq!(
            RdmaOpen::decode(&with(&[7, 0, 0, 1])),
            Err(WireError::Invalid { field: "section tag", value: 7 })
        );
        assert_eq!(
            RdmaOpen::decode(&with(&[RAILS_TAG, 0, 0, 0])),
            Err(WireError::Invalid { field: "rail section", value: 0 }),
            "an all-zero section is not the canonical encoding"
        );
        assert!(matches!(
            RdmaOpen::decode(&with(&[RAILS_TAG, 0, 0, MAX_RAILS as u8])),
            Err(WireError::TooLarge { field: "qp rail", .. })
        ));
        assert!(RdmaOpen::decode(&with(&[RAILS_TAG, 0, 1])).is_err(), "one rail short");
        assert_eq!(
            RdmaOpen::decode(&with(&[RAILS_TAG, 0, 0, 1, 0])),
            Err(WireError::Invalid { field: "section tag", value: 0 }),
            "a byte after the rail section is no READ-depth section"
        );
        for bad in [&[][..], &[1, 2, 3], &[0; 36]] {
            assert!(decode_rkeys(bad).is_err(), "{} bytes", bad.len());
        }
    }

    #[test]
    fn hostile_payloads_are_refused_naming_the_field() {
        let good = sample().encode();
        for cut in 0..good.len() {
            assert!(RdmaOpen::decode(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(RdmaOpen::decode(&long), Err(WireError::Invalid { field: "section tag", value: 0 }));
        let mut bad_mtu = good.clone();
        *bad_mtu.last_mut().unwrap() = 6;
        assert_eq!(RdmaOpen::decode(&bad_mtu), Err(WireError::Invalid { field: "qp mtu", value: 6 }));
        let mut zero_qpn = good.clone();
        zero_qpn[6 + 16 + 2..6 + 16 + 6].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(RdmaOpen::decode(&zero_qpn), Err(WireError::Invalid { field: "qpn", value: 0 }));
        let too_many = [0u8, (MAX_QPS + 1) as u8];
        assert!(matches!(RdmaOpen::decode(&too_many), Err(WireError::TooLarge { field: "qp count", .. })));
        assert!(decode_rkeys(&[1, 2, 3]).is_err());
    }

    fn shallow() -> RdmaOpen {
        let mut o = railed();
        o.qps[0].reads_out = 4;
        o.qps[1].reads_in = 2;
        o
    }

    /// READ depths: left out where every QP has the default (the bytes of before the section),
    /// otherwise one pair per QP address after the rail section; round trips with and without
    /// rails.
    #[test]
    fn read_depths_travel_only_where_one_is_not_the_default() {
        assert_eq!(RdmaOpen::decode(&shallow().encode()), Ok(shallow()));
        let railed_bytes = railed().encode();
        let b = shallow().encode();
        assert_eq!(&b[..railed_bytes.len()], &railed_bytes[..], "the section comes last");
        assert_eq!(&b[railed_bytes.len()..], &[READS_TAG, 4, MAX_READS, MAX_READS, 2]);
        let mut flat = sample();
        flat.qps[1].reads_out = 1;
        assert_eq!(RdmaOpen::decode(&flat.encode()), Ok(flat.clone()));
        assert_eq!(flat.encode()[sample().encode().len()], READS_TAG, "no rail section before it");
    }

    #[test]
    fn hostile_read_depth_sections_are_refused_naming_the_field() {
        let base = sample().encode();
        let with = |tail: &[u8]| [&base[..], tail].concat();
        assert_eq!(
            RdmaOpen::decode(&with(&[READS_TAG, 16, 16, 16, 16])),
            Err(WireError::Invalid { field: "read depth section", value: 16 }),
            "all defaults is not the canonical encoding"
        );
        assert_eq!(
            RdmaOpen::decode(&with(&[READS_TAG, 0, 16, 16, 16])),
            Err(WireError::Invalid { field: "qp reads out", value: 0 })
        );
        assert_eq!(
            RdmaOpen::decode(&with(&[READS_TAG, 16, 17, 16, 16])),
            Err(WireError::Invalid { field: "qp reads in", value: 17 })
        );
        assert!(RdmaOpen::decode(&with(&[READS_TAG, 2, 2, 2])).is_err(), "one depth short");
        assert_eq!(RdmaOpen::decode(&with(&[READS_TAG, 2, 2, 2, 2, 0])), Err(WireError::Trailing(1)));
        // The rail section after the depths: the order is fixed (one encoding per payload).
        let rails_after = with(&[READS_TAG, 2, 2, 2, 2, RAILS_TAG, 1, 0, 0]);
        assert!(RdmaOpen::decode(&rails_after).is_err());
        let mut twice = shallow().encode();
        twice.extend_from_slice(&[READS_TAG, 2, 2, 2, 2]);
        assert!(RdmaOpen::decode(&twice).is_err(), "a second section");
    }
}
