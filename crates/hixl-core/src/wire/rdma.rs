//! What the `rdma` backend carries over the control channel, as pure encoding and decoding:
//! the payload of BackendOpen / BackendOpened (queue-pair addresses) and its region key (the
//! rkey). Every field a peer sends is checked here before the backend sees it.

use super::{Reader, WireError};

/// Most queue pairs one BackendOpen may ask for (`hixl.rdma.qps` is at most this).
pub const MAX_QPS: usize = 64;
/// Queue-pair numbers and packet sequence numbers are 24-bit.
pub const MAX_QPN: u32 = (1 << 24) - 1;

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
}

/// The payload of an `rdma` BackendOpen (initiator's QPs, plus target QPs of this link it
/// retires after an error) or BackendOpened (the target's QPs, `retire` empty).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RdmaOpen {
    /// Queue pairs of the target's side of this link that the initiator no longer uses.
    pub retire: Vec<u32>,
    /// Queue-pair addresses, one per QP to connect.
    pub qps: Vec<QpAddr>,
}

impl RdmaOpen {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(2 + 4 * self.retire.len() + 27 * self.qps.len());
        p.push(self.retire.len() as u8);
        for q in &self.retire {
            p.extend_from_slice(&q.to_le_bytes());
        }
        p.push(self.qps.len() as u8);
        for q in &self.qps {
            p.extend_from_slice(&q.gid);
            p.extend_from_slice(&q.lid.to_le_bytes());
            p.extend_from_slice(&q.qpn.to_le_bytes());
            p.extend_from_slice(&q.psn.to_le_bytes());
            p.push(q.mtu);
        }
        p
    }

    /// Decodes and checks a payload: counts within [`MAX_QPS`], 24-bit numbers, a known MTU,
    /// nothing left over.
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
            retire.push(qp_number(r.u32("retired qpn")?, "retired qpn")?);
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
            qps.push(QpAddr { gid, lid, qpn, psn, mtu });
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

/// The `rdma` region key: the memory region's rkey.
pub fn encode_rkey(rkey: u32) -> Vec<u8> {
    rkey.to_le_bytes().to_vec()
}

/// The rkey of an `rdma` region key; anything but 4 bytes is refused.
pub fn decode_rkey(key: &[u8]) -> Result<u32, WireError> {
    let b: [u8; 4] = key
        .try_into()
        .map_err(|_| WireError::Invalid { field: "rdma region key length", value: key.len() as u64 })?;
    Ok(u32::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RdmaOpen {
        let q = |qpn| QpAddr { gid: [qpn as u8; 16], lid: 3, qpn, psn: 0xABCDE, mtu: 3 };
        RdmaOpen { retire: vec![17], qps: vec![q(5), q(MAX_QPN)] }
    }

    #[test]
    fn qp_addresses_round_trip() {
        let o = sample();
        assert_eq!(RdmaOpen::decode(&o.encode()), Ok(o));
        assert_eq!(RdmaOpen::decode(&RdmaOpen::default().encode()), Ok(RdmaOpen::default()));
        assert_eq!(decode_rkey(&encode_rkey(0xDEAD_BEEF)), Ok(0xDEAD_BEEF));
    }

    #[test]
    fn hostile_payloads_are_refused_naming_the_field() {
        let good = sample().encode();
        for cut in 0..good.len() {
            assert!(RdmaOpen::decode(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert_eq!(RdmaOpen::decode(&long), Err(WireError::Trailing(1)));
        let mut bad_mtu = good.clone();
        *bad_mtu.last_mut().unwrap() = 6;
        assert_eq!(RdmaOpen::decode(&bad_mtu), Err(WireError::Invalid { field: "qp mtu", value: 6 }));
        let mut zero_qpn = good.clone();
        zero_qpn[6 + 16 + 2..6 + 16 + 6].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(RdmaOpen::decode(&zero_qpn), Err(WireError::Invalid { field: "qpn", value: 0 }));
        let too_many = [0u8, (MAX_QPS + 1) as u8];
        assert!(matches!(RdmaOpen::decode(&too_many), Err(WireError::TooLarge { field: "qp count", .. })));
        assert!(decode_rkey(&[1, 2, 3]).is_err());
    }
}
