//! How big the backend makes its queues on one device: what it would like, cut to what the
//! device says it has (`ibv_query_device`, `ibv_query_port`). Pure, so that every device's
//! numbers can be tried here; `hixl info` prints the result beside the device's own.

use super::verbs::{DeviceAttr, PortAttr};
use crate::error::{Error, Result};

/// Entries of the engine's completion queue wanted (every initiator QP's send queue must fit in
/// it, which bounds the QPs an engine opens).
pub(super) const WANT_CQE: u32 = 65536;
/// Send-queue slots per QP wanted.
pub(super) const WANT_SQ: u32 = 512;
/// Scatter/gather entries per work request wanted.
pub(super) const WANT_SGE: u32 = 16;
/// Outstanding RDMA READs per QP wanted (as initiator and as responder).
pub(super) const WANT_RD_ATOMIC: u32 = crate::wire::rdma::MAX_READS as u32;
/// The smallest queues the backend works with; a device offering less is not used.
const MIN_CQE: u32 = 64;
const MIN_SQ: u32 = 16;

/// The queue sizes the backend uses on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Limits {
    /// Entries of the engine's CQ.
    pub cq_depth: u32,
    /// Send-queue slots of each QP (at most `cq_depth`).
    pub sq_depth: u32,
    /// SGEs of one RDMA WRITE.
    pub sge_write: u32,
    /// SGEs of one RDMA READ.
    pub sge_read: u32,
    /// Largest message of one work request.
    pub max_msg: u64,
    /// Outstanding READs a QP issues (`max_rd_atomic`).
    pub rd_atomic_init: u8,
    /// Outstanding READs of the peer a QP answers (`max_dest_rd_atomic`).
    pub rd_atomic_dest: u8,
}

fn clip(want: u32, have: i32) -> u32 {
    want.min(have.max(0) as u32)
}

impl Limits {
    /// The sizes for a device with `dev` and `port`; Unsupported naming the limit where the
    /// device offers less than the backend needs.
    pub(super) fn derive(dev: &DeviceAttr, port: &PortAttr) -> Result<Limits> {
        let cq_depth = clip(WANT_CQE, dev.max_cqe);
        if cq_depth < MIN_CQE {
            return Err(too_small("max_cqe", dev.max_cqe, MIN_CQE));
        }
        let sq_depth = clip(WANT_SQ, dev.max_qp_wr).min(cq_depth);
        if sq_depth < MIN_SQ {
            return Err(too_small("max_qp_wr", dev.max_qp_wr, MIN_SQ));
        }
        let sge_write = clip(WANT_SGE, dev.max_sge);
        if sge_write == 0 {
            return Err(too_small("max_sge", dev.max_sge, 1));
        }
        // Some devices leave max_sge_rd 0: their READs take max_sge. A READ's SGEs count
        // against the QP's send SGEs too.
        let sge_read = if dev.max_sge_rd > 0 { clip(sge_write, dev.max_sge_rd) } else { sge_write };
        // Devices that report 0 answer READs anyway (one at a time).
        let rd = |have: i32| clip(WANT_RD_ATOMIC, have).max(1) as u8;
        Ok(Limits {
            cq_depth,
            sq_depth,
            sge_write,
            sge_read,
            max_msg: (port.max_msg_sz as u64).clamp(4096, 1 << 30),
            rd_atomic_init: rd(dev.max_qp_init_rd_atom),
            rd_atomic_dest: rd(dev.max_qp_rd_atom),
        })
    }

    /// Initiator QPs of `sq_depth` slots that fit in the CQ.
    pub(super) fn max_initiator_qps(&self) -> u32 {
        self.cq_depth / self.sq_depth
    }

    /// One line for `hixl info`: the device's limits and what the backend uses of them.
    pub(super) fn describe(&self, dev: &DeviceAttr, port: &PortAttr) -> String {
        format!(
            "device max_cqe {} max_qp_wr {} max_sge {}/{} (write/read) max_qp_rd_atom {}/{} \
             (init/dest) max_msg {} mtu {}; hixl uses CQ {} SQ {} SGE {}/{} READs {}/{} message {}",
            dev.max_cqe,
            dev.max_qp_wr,
            dev.max_sge,
            dev.max_sge_rd,
            dev.max_qp_init_rd_atom,
            dev.max_qp_rd_atom,
            port.max_msg_sz,
            128u32 << port.active_mtu.min(5),
            self.cq_depth,
            self.sq_depth,
            self.sge_write,
            self.sge_read,
            self.rd_atomic_init,
            self.rd_atomic_dest,
            self.max_msg
        )
    }
}

fn too_small(what: &str, have: i32, need: u32) -> Error {
    super::unsupported(format!("the device's {what} is {have}; hixl needs at least {need}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port() -> PortAttr {
        PortAttr { state: 4, active_mtu: 3, max_msg_sz: 1 << 31, lid: 0, link_layer: 2, gid_tbl_len: 16 }
    }

    fn dev(cqe: i32, wr: i32, sge: i32, sge_rd: i32, rd: i32) -> DeviceAttr {
        DeviceAttr {
            max_mr_size: u64::MAX,
            max_qp: 1 << 16,
            max_qp_wr: wr,
            max_sge: sge,
            max_sge_rd: sge_rd,
            max_cq: 1 << 16,
            max_cqe: cqe,
            max_qp_rd_atom: rd,
            max_qp_init_rd_atom: rd,
        }
    }

    #[test]
    fn rxe_limits_cut_the_cq_and_keep_the_rest() {
        // rdma_rxe on Linux 6.1: max_cqe 32767, max_qp_wr 1048576, max_sge 32, rd_atom 128.
        let l = Limits::derive(&dev(32767, 1 << 20, 32, 32, 128), &port()).unwrap();
        assert_eq!((l.cq_depth, l.sq_depth, l.sge_write, l.sge_read), (32767, 512, 16, 16));
        assert_eq!((l.rd_atomic_init, l.rd_atomic_dest, l.max_msg), (16, 16, 1 << 30));
        assert_eq!(l.max_initiator_qps(), 63);
        let s = l.describe(&dev(32767, 1 << 20, 32, 32, 128), &port());
        assert!(
            s.contains("max_cqe 32767") && s.contains("CQ 32767 SQ 512") && s.contains("mtu 1024"),
            "{s}"
        );
    }

    #[test]
    fn a_small_device_gets_small_queues_and_a_too_small_one_is_refused_by_name() {
        let l = Limits::derive(&dev(1024, 64, 4, 0, 0), &port()).unwrap();
        assert_eq!((l.cq_depth, l.sq_depth, l.sge_write, l.sge_read), (1024, 64, 4, 4));
        assert_eq!((l.rd_atomic_init, l.rd_atomic_dest), (1, 1));
        let l = Limits::derive(&dev(1024, 64, 30, 2, 4), &port()).unwrap();
        assert_eq!((l.sge_write, l.sge_read, l.rd_atomic_init), (16, 2, 4));
        let sq_bigger_than_cq = Limits::derive(&dev(100, 1000, 4, 4, 4), &port()).unwrap();
        assert_eq!(sq_bigger_than_cq.sq_depth, 100);
        for (d, what) in [(dev(32, 64, 4, 4, 4), "max_cqe is 32"), (dev(1024, 8, 4, 4, 4), "max_qp_wr is 8")]
        {
            let e = Limits::derive(&d, &port()).unwrap_err();
            assert!(e.message.contains(what), "{}", e.message);
        }
        assert!(Limits::derive(&dev(1024, 64, 0, 0, 4), &port()).unwrap_err().message.contains("max_sge"));
        let tiny_msg = PortAttr { max_msg_sz: 100, ..port() };
        assert_eq!(Limits::derive(&dev(1024, 64, 4, 4, 4), &tiny_msg).unwrap().max_msg, 4096);
    }
}
