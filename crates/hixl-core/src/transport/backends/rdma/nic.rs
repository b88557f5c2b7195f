//! One rail of an engine: an open RDMA device, its protection domain, memory regions (one per
//! registered region), its completion queue and channel. The engine's one poller (`rails`)
//! drains every rail's CQ.

use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use super::limits::Limits;
use super::verbs::{access, Channel, Cq, Ctx, Mr, Pd, PortAttr, Verbs, PORT_ACTIVE};
use crate::error::Result;
use crate::registry::Access;

struct LocalMr {
    len: u64,
    mr: Mr,
    lkey: u32,
}

/// Registrations by (address, rkey): the same range may be registered twice for a moment
/// (the engine then releases the second), so the address alone does not name one.
type Mrs = BTreeMap<(u64, u32), LocalMr>;

/// An open device and what the engine made on it.
pub(super) struct Nic {
    pub(super) verbs: Arc<dyn Verbs>,
    pub(super) device: String,
    /// Its index among the engine's rails.
    pub(super) rail: u8,
    ctx: Ctx,
    pub(super) pd: Pd,
    pub(super) ch: Channel,
    pub(super) ch_fd: RawFd,
    pub(super) cq: Cq,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    /// GRH traffic class and service level of every QP.
    pub(super) traffic_class: u8,
    pub(super) sl: u8,
    pub(super) gid: [u8; 16],
    pub(super) attr: PortAttr,
    /// The queue sizes used on it (cut to `dev` and `attr`).
    pub(super) limits: Limits,
    mrs: RwLock<Mrs>,
    /// Send-queue slots of the initiator QPs open now (at most `limits.cq_depth`).
    pub(super) sq_slots: AtomicUsize,
}

impl Nic {
    /// Sets up the opened device `name` (`ctx`) as rail `rail`: its port must be active and
    /// its GID usable; makes its PD, completion channel and CQ. On error the caller closes `ctx`.
    pub(super) fn setup(
        verbs: &Arc<dyn Verbs>,
        name: &str,
        ctx: Ctx,
        o: &crate::options::rdma::RdmaOptions,
        rail: u8,
    ) -> Result<Arc<Nic>> {
        let (port, gid_index) = (o.port, o.gid_index);
        let attr = verbs.query_port(ctx, port)?;
        if attr.state != PORT_ACTIVE {
            return Err(super::unsupported(format!("port {port} is not active (state {})", attr.state)));
        }
        let dev = verbs.query_device(ctx)?;
        let limits = Limits::derive(&dev, &attr)?;
        let gid = verbs.query_gid(ctx, port, gid_index)?;
        if attr.link_layer == 2 && gid == [0u8; 16] {
            return Err(super::unsupported(format!(
                "GID index {gid_index} of port {port} is empty (RoCE needs a configured GID: hixl.rdma.gid_index)"
            )));
        }
        let pd = verbs.alloc_pd(ctx)?;
        let (ch, ch_fd) = match verbs.create_comp_channel(ctx) {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: the PD allocated just above, released once; nothing uses it yet.
                unsafe { verbs.dealloc_pd(pd) };
                return Err(e);
            }
        };
        let cq = match verbs.create_cq(ctx, limits.cq_depth, Some(ch)) {
            Ok(cq) => cq,
            Err(e) => {
                // SAFETY: the channel and PD made just above, released once; nothing uses them.
                unsafe {
                    verbs.destroy_comp_channel(ch);
                    verbs.dealloc_pd(pd);
                }
                return Err(e);
            }
        };
        Ok(Arc::new(Nic {
            verbs: verbs.clone(),
            device: name.to_string(),
            rail,
            ctx,
            pd,
            ch,
            ch_fd,
            cq,
            port,
            gid_index,
            traffic_class: o.traffic_class,
            sl: o.service_level,
            gid,
            attr,
            limits,
            mrs: RwLock::new(BTreeMap::new()),
            sq_slots: AtomicUsize::new(0),
        }))
    }

    /// Whether its port is active now (a port that went down fails sends as local errors).
    pub(super) fn port_active(&self) -> bool {
        self.verbs.query_port(self.ctx, self.port).is_ok_and(|a| a.state == PORT_ACTIVE)
    }

    /// Registers `[addr, addr + len)`: remote read always, remote write only for a writable
    /// region (so the NIC refuses what the TCP target refuses), local write (a READ lands in
    /// it) unless the memory is immutable. Returns the rkey.
    pub(super) fn register(&self, addr: u64, len: u64, how: Access) -> Result<u32> {
        // SAFETY: the engine registers only memory it checked is mapped, and deregisters it
        // (this region's `deregister`) before the memory may be freed.
        let (mr, lkey, rkey) = unsafe { self.verbs.reg_mr(self.pd, addr, len, access_bits(how)) }?;
        self.mrs.write().unwrap().insert((addr, rkey), LocalMr { len, mr, lkey });
        Ok(rkey)
    }

    /// Registers `len` bytes at `offset` of the dma-buf `fd` as `[iova, iova + len)`, with the
    /// access `register` gives (`ibv_reg_dmabuf_mr`; the caller may close `fd` after). Returns
    /// the rkey.
    pub(super) fn register_dmabuf(
        &self,
        iova: u64,
        len: u64,
        how: Access,
        fd: RawFd,
        offset: u64,
    ) -> Result<u32> {
        // SAFETY: `fd` is a dma-buf the driver exported for whole pages around the range
        // (`gpudirect::register`), so it holds `offset + len` bytes; the region keeps its own
        // reference to it until `deregister`.
        let (mr, lkey, rkey) =
            unsafe { self.verbs.reg_dmabuf_mr(self.pd, offset, len, iova, fd, access_bits(how)) }?;
        self.mrs.write().unwrap().insert((iova, rkey), LocalMr { len, mr, lkey });
        Ok(rkey)
    }

    /// Deregisters the region at `addr` with `rkey` (the NIC waits for operations still using it).
    pub(super) fn deregister(&self, addr: u64, rkey: u32) {
        let m = self.mrs.write().unwrap().remove(&(addr, rkey));
        if let Some(m) = m {
            // SAFETY: `m` was just taken out of the table, so this MR is deregistered once and
            // no later lookup (`lkey`) can hand it out.
            if let Err(e) = unsafe { self.verbs.dereg_mr(m.mr) } {
                tracing::warn!(addr = %format_args!("0x{addr:x}"), "ibv_dereg_mr failed: {e}");
            }
        }
    }

    /// The lkey of the region holding `[addr, addr + len)`, and where that region ends.
    pub(super) fn lkey(&self, addr: u64, len: u64) -> Option<(u32, u64)> {
        let mrs = self.mrs.read().unwrap();
        let want = addr.checked_add(len)?;
        // Regions do not overlap (but for a range registered twice): the last few starting at
        // or before `addr` are the only candidates.
        mrs.range(..=(addr, u32::MAX)).rev().take(4).find_map(|(&(start, _), m)| {
            let end = start + m.len;
            (want <= end).then_some((m.lkey, end))
        })
    }

    /// Destroys a QP; an initiator's gives its send-queue slots back.
    ///
    /// Crate-internal and safe on purpose: its callers pass the `qp` of a `QpCreated` that this
    /// `Nic` made and drop it after (every call site destroys a QP once, when the lane, the
    /// target entry or the half-built setup that owned it goes away).
    pub(super) fn destroy_qp(&self, qp: super::verbs::Qp, initiator: bool) {
        // SAFETY: see above: a QP of this NIC, destroyed once by its one owner.
        unsafe { self.verbs.destroy_qp(qp) };
        if initiator {
            self.sq_slots.fetch_sub(self.limits.sq_depth as usize, Ordering::AcqRel);
        }
    }
}

/// The NIC access of a region: remote read always, remote write only for a writable region
/// (so the NIC refuses what the TCP target refuses), local write (a READ lands in it) unless
/// the memory is immutable.
fn access_bits(how: Access) -> u32 {
    match how {
        Access::ReadWrite => access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
        Access::ReadOnly => access::LOCAL_WRITE | access::REMOTE_READ,
        // Possibly read-only pages: the NIC may not even write them locally.
        Access::Immutable => access::REMOTE_READ,
    }
}

impl Drop for Nic {
    /// Every QP is gone by now (links and target QPs hold the `Nic`): release the rest in the
    /// order the verbs require.
    fn drop(&mut self) {
        let mrs = std::mem::take(&mut *self.mrs.write().unwrap());
        // SAFETY: the Nic owns these handles (made in `setup`, never handed out) and this is
        // its last use of them; every QP is gone (links and target QPs hold the Nic), so
        // nothing depends on the CQ or the PD, released in the order the verbs require.
        unsafe {
            for (_, m) in mrs {
                let _ = self.verbs.dereg_mr(m.mr);
            }
            self.verbs.destroy_cq(self.cq);
            self.verbs.destroy_comp_channel(self.ch);
            self.verbs.dealloc_pd(self.pd);
            self.verbs.close_device(self.ctx);
        }
    }
}
