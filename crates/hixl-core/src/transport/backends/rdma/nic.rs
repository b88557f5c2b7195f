//! One rail of an engine: an open RDMA device, its protection domain, memory regions (one per
//! registered region), its completion queue and channel. The engine's one poller (`rails`)
//! drains every rail's CQ.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use super::limits::Limits;
use super::verbs::{
    access, CompletionChannel, CompletionQueue, Context, MemoryRegion, PortAttr, ProtectionDomain, QpCaps,
    QueuePair, Verbs, PORT_ACTIVE,
};
use crate::cuda::dmabuf::DmaBuf;
use crate::error::{Error, Result, Status};
use crate::registry::Access;
use crate::transport::backend::MemorySpan;

struct LocalMr {
    len: u64,
    mr: MemoryRegion,
}

/// Registrations by (address, rkey): the same range may be registered twice for a moment
/// (the engine then releases the second), so the address alone does not name one.
type Mrs = BTreeMap<(u64, u32), LocalMr>;

/// An open device and what the engine made on it.
pub(super) struct Nic {
    pub(super) device: String,
    /// Its index among the engine's rails.
    pub(super) rail: u8,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    /// GRH traffic class and service level of every QP.
    pub(super) traffic_class: u8,
    pub(super) sl: u8,
    pub(super) gid: [u8; 16],
    pub(super) attr: PortAttr,
    /// The queue sizes used on it (cut to `dev` and `attr`).
    pub(super) limits: Limits,
    /// Send-queue slots of the initiator QPs open now (at most `limits.cq_depth`).
    sq_slots: Arc<AtomicUsize>,
    // The verbs objects, last and in this order: fields drop in declaration order, so when the
    // Nic goes (every QP is gone by then: links and target QPs hold the Nic) its MRs are
    // deregistered, then the CQ, the channel and the PD are released and the device closed,
    // the order the verbs require (each object also holds those it depends on, see
    // `verbs::owned`).
    mrs: RwLock<Mrs>,
    pub(super) cq: Arc<CompletionQueue>,
    pub(super) channel: Arc<CompletionChannel>,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<Context>,
}

/// The send-queue slots one initiator QP holds on its rail's CQ (see `Nic::sq_slots`), given
/// back when dropped.
pub(super) struct SendSlots {
    slots: Arc<AtomicUsize>,
    n: usize,
}

impl Drop for SendSlots {
    fn drop(&mut self) {
        self.slots.fetch_sub(self.n, Ordering::AcqRel);
    }
}

/// A QP of a rail and, for an initiator's, the send-queue slots it holds: when dropped the QP
/// is destroyed first, then its slots are given back (fields drop in declaration order).
pub(super) struct RailQp {
    qp: QueuePair,
    _slots: Option<SendSlots>,
}

impl std::ops::Deref for RailQp {
    type Target = QueuePair;

    fn deref(&self) -> &QueuePair {
        &self.qp
    }
}

impl Nic {
    /// Sets up the opened device `name` (`ctx`) as rail `rail`: its port must be active and
    /// its GID usable; makes its PD, completion channel and CQ. On error what it made is
    /// released (the CQ's channel, then the PD), then the device is closed (when `ctx` drops).
    pub(super) fn setup(
        ctx: Arc<Context>,
        name: &str,
        o: &crate::options::rdma::RdmaOptions,
        rail: u8,
    ) -> Result<Arc<Nic>> {
        let (port, gid_index) = (o.port, o.gid_index);
        let attr = ctx.query_port(port)?;
        if attr.state != PORT_ACTIVE {
            return Err(super::unsupported(format!("port {port} is not active (state {})", attr.state)));
        }
        let dev = ctx.query_device()?;
        let limits = Limits::derive(&dev, &attr)?;
        let gid = ctx.query_gid(port, gid_index)?;
        if attr.link_layer == 2 && gid == [0u8; 16] {
            return Err(super::unsupported(format!(
                "GID index {gid_index} of port {port} is empty (RoCE needs a configured GID: hixl.rdma.gid_index)"
            )));
        }
        // On an error below, the locals made so far drop in reverse order: channel, then PD.
        let pd = ctx.alloc_pd()?;
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(limits.cq_depth, &channel)?;
        Ok(Arc::new(Nic {
            device: name.to_string(),
            rail,
            port,
            gid_index,
            traffic_class: o.traffic_class,
            sl: o.service_level,
            gid,
            attr,
            limits,
            sq_slots: Arc::new(AtomicUsize::new(0)),
            mrs: RwLock::new(BTreeMap::new()),
            cq,
            channel,
            pd,
            ctx,
        }))
    }

    /// The provider its device was opened with.
    pub(super) fn verbs(&self) -> &Arc<dyn Verbs> {
        self.ctx.verbs()
    }

    /// Whether its port is active now (a port that went down fails sends as local errors).
    pub(super) fn port_active(&self) -> bool {
        self.ctx.query_port(self.port).is_ok_and(|a| a.state == PORT_ACTIVE)
    }

    /// Registers the span `mem`: remote read always, remote write only for a writable region
    /// (so the NIC refuses what the TCP target refuses), local write (a READ lands in it)
    /// unless the memory is immutable. Returns the rkey. The region stays until
    /// [`Nic::deregister`], which the backend's deregistration hook calls.
    pub(super) fn register(&self, mem: &MemorySpan) -> Result<u32> {
        let mr = self.pd.register(mem, access_bits(mem.access()))?;
        Ok(self.keep(mem, mr))
    }

    /// Registers the span `mem` of device memory from `buf`, the dma-buf the driver exported
    /// for it (`ibv_reg_dmabuf_mr`; `buf` may be closed after), with the access `register`
    /// gives. Returns the rkey.
    pub(super) fn register_dmabuf(&self, mem: &MemorySpan, buf: &DmaBuf) -> Result<u32> {
        let mr = self.pd.register_dmabuf(mem, buf, access_bits(mem.access()))?;
        Ok(self.keep(mem, mr))
    }

    /// Keeps `mr`, the region of `mem`, until [`Nic::deregister`]; returns its rkey.
    fn keep(&self, mem: &MemorySpan, mr: MemoryRegion) -> u32 {
        let rkey = mr.rkey();
        self.mrs.write().unwrap().insert((mem.addr(), rkey), LocalMr { len: mem.len(), mr });
        rkey
    }

    /// Deregisters the region at `addr` with `rkey` (the NIC waits for operations still using it).
    pub(super) fn deregister(&self, addr: u64, rkey: u32) {
        let m = self.mrs.write().unwrap().remove(&(addr, rkey));
        if let Some(m) = m {
            // Taken out of the table first: no later lookup (`lkey`) can hand it out.
            if let Err(e) = m.mr.deregister() {
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
            (want <= end).then_some((m.mr.lkey(), end))
        })
    }

    /// Reserves the send-queue slots of one initiator QP (`limits.sq_depth`) on the CQ, which
    /// has room for `limits.cq_depth` completions; RESOURCE_EXHAUSTED when they do not fit.
    pub(super) fn reserve_send_slots(&self) -> Result<SendSlots> {
        let sq = self.limits.sq_depth as usize;
        let used = self.sq_slots.fetch_add(sq, Ordering::AcqRel) + sq;
        let slots = SendSlots { slots: self.sq_slots.clone(), n: sq };
        if used > self.limits.cq_depth as usize {
            drop(slots);
            return Err(Error::new(
                Status::ResourceExhausted,
                format!(
                    "the engine's RDMA completion queue ({} entries, the device's limit) serves at \
                     most {} QPs of {} work requests (fewer peers, or a smaller hixl.rdma.qps)",
                    self.limits.cq_depth,
                    self.limits.max_initiator_qps(),
                    sq
                ),
            ));
        }
        Ok(slots)
    }

    /// Creates an RC QP on this rail's PD and CQ; `slots` (an initiator's) are held while it
    /// lives and given back if it cannot be made.
    pub(super) fn create_qp(&self, caps: QpCaps, slots: Option<SendSlots>) -> Result<RailQp> {
        // A device that cannot carry the inline data asked for makes the QP without any.
        let qp = match self.pd.create_qp(&self.cq, caps) {
            Err(_) if caps.max_inline_data > 0 => {
                self.pd.create_qp(&self.cq, QpCaps { max_inline_data: 0, ..caps })?
            }
            r => r?,
        };
        Ok(RailQp { qp, _slots: slots })
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
