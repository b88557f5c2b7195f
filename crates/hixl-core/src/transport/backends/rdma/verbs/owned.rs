//! Owned verbs objects: each one holds the provider it came from and the objects the verbs
//! require to outlive it, and releases itself when dropped (as rust-ibverbs's types do), so that
//! the backend never handles a raw handle nor calls an `unsafe fn` release itself.
//!
//! Who holds whom: a protection domain, a completion channel and a completion queue hold their
//! [`Context`]; a completion queue holds its channel; a memory region holds its protection
//! domain; a queue pair holds its protection domain and its completion queue (all by `Arc`).
//! An object is therefore released only once everything made on it is gone, whatever order its
//! owners drop them in: QPs before their CQ, a CQ before its channel, MRs and QPs before their
//! PD, all of them before the context (the order `ibv_destroy_*` requires). The handles stay
//! private to this module: nothing else can release one, or use it after its release.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, RwLock};

use super::{
    Channel, Cq, Ctx, DeviceAttr, Mr, Pd, PortAttr, PostError, Qp, QpCaps, QpTransition, SendWr, Verbs, Wc,
};
use crate::cuda::dmabuf::DmaBuf;
use crate::error::{Error, Result};
use crate::transport::backend::MemorySpan;

/// An open device (`ibv_open_device`), closed when the last object made on it is gone.
pub(crate) struct Context {
    verbs: Arc<dyn Verbs>,
    ctx: Ctx,
}

impl Context {
    /// Opens the device `name` of `verbs`.
    pub(crate) fn open(verbs: &Arc<dyn Verbs>, name: &str) -> Result<Arc<Context>> {
        let ctx = verbs.open_device(name)?;
        Ok(Arc::new(Context { verbs: verbs.clone(), ctx }))
    }

    /// The provider it was opened with.
    pub(crate) fn verbs(&self) -> &Arc<dyn Verbs> {
        &self.verbs
    }

    /// `ibv_query_device`: the device's limits.
    pub(crate) fn query_device(&self) -> Result<DeviceAttr> {
        self.verbs.query_device(self.ctx)
    }

    /// `ibv_query_port`.
    pub(crate) fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.verbs.query_port(self.ctx, port)
    }

    /// `ibv_query_gid`.
    pub(crate) fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        self.verbs.query_gid(self.ctx, port, index)
    }

    /// `ibv_alloc_pd`.
    pub(crate) fn alloc_pd(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        let pd = self.verbs.alloc_pd(self.ctx)?;
        Ok(Arc::new(ProtectionDomain { ctx: self.clone(), pd, host_spans: RwLock::default() }))
    }

    /// `ibv_create_comp_channel`.
    pub(crate) fn create_comp_channel(self: &Arc<Self>) -> Result<Arc<CompletionChannel>> {
        let (ch, fd) = self.verbs.create_comp_channel(self.ctx)?;
        Ok(Arc::new(CompletionChannel { ctx: self.clone(), ch, fd }))
    }

    /// `ibv_create_cq` with at least `cqe` entries, its events going to `channel`.
    pub(crate) fn create_cq(
        self: &Arc<Self>,
        cqe: u32,
        channel: &Arc<CompletionChannel>,
    ) -> Result<Arc<CompletionQueue>> {
        let cq = self.verbs.create_cq(self.ctx, cqe, Some(channel.ch))?;
        Ok(Arc::new(CompletionQueue { ctx: self.clone(), _channel: channel.clone(), cq }))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: this value opened `ctx` and never hands it out, so it is live and released
        // once, here; every object made on it holds this context, so none is left.
        unsafe { self.verbs.close_device(self.ctx) };
    }
}

/// A protection domain (`ibv_alloc_pd`), deallocated when its last MR and QP are gone.
pub(crate) struct ProtectionDomain {
    ctx: Arc<Context>,
    pd: Pd,
    /// Its registered host memory, by lkey: `[addr, addr + len)` of each region made from a
    /// host `MemorySpan`. Inline data is read only from these ([`QueuePair::post_send`]); a
    /// region leaves this map (under the write lock, which waits for a post reading it) before
    /// it is deregistered.
    host_spans: RwLock<HashMap<u32, (u64, u64)>>,
}

impl ProtectionDomain {
    /// `ibv_reg_mr` of the span `mem` with the `access` bits. Safe: `mem` proves the memory
    /// stays valid until its region's deregistration hooks run, and the caller (the `rdma`
    /// backend) drops the region there, or at once when the registration fails.
    pub(crate) fn register(self: &Arc<Self>, mem: &MemorySpan, access: u32) -> Result<MemoryRegion> {
        // SAFETY: `reg_mr` needs the range mapped until the region is deregistered. A
        // `MemorySpan` is made only by its unsafe constructor (whose contract is
        // `Engine::register_mem`'s: valid until the region's deregistration hooks have run) or
        // from memory the engine allocated and keeps that long; the `rdma` backend's hooks
        // (`Nic::deregister`, and the release of a failed registration) deregister this region
        // then, before the memory may go. `pd` is live while `self` is.
        let (mr, lkey, rkey) = unsafe { self.ctx.verbs.reg_mr(self.pd, mem.addr(), mem.len(), access) }?;
        if mem.domain() == crate::wire::Domain::Host {
            self.host_spans.write().unwrap().insert(lkey, (mem.addr(), mem.len()));
        }
        Ok(MemoryRegion { pd: self.clone(), mr: Some(mr), lkey, rkey })
    }

    /// `ibv_reg_dmabuf_mr` of the span `mem` of device memory from `buf`, the dma-buf the
    /// driver exported for it: `mem.len()` bytes at `buf.offset()`, addressed as
    /// `[mem.addr(), mem.addr() + mem.len())` (the region holds its own reference to the
    /// dma-buf). PARAM_INVALID when `buf` was exported for another range. Safe as
    /// [`ProtectionDomain::register`] is.
    pub(crate) fn register_dmabuf(
        self: &Arc<Self>,
        mem: &MemorySpan,
        buf: &DmaBuf,
        access: u32,
    ) -> Result<MemoryRegion> {
        let (addr, len) = (mem.addr(), mem.len());
        if buf.range() != (addr, len) {
            return Err(Error::param(format!(
                "a dma-buf exported for 0x{:x}+{} cannot register 0x{addr:x}+{len}",
                buf.range().0,
                buf.range().1
            )));
        }
        // SAFETY: `reg_dmabuf_mr` needs a dma-buf of at least `offset + len` bytes that nothing
        // writes through in a way the caller did not agree to. `buf` is the driver's export of
        // the whole pages around exactly this range (checked above), so it holds `offset + len`
        // bytes; the device writes only the range, which `mem` proves the registrant gave peers
        // and devices until its region's deregistration hooks run, where the `rdma` backend
        // drops this region (as for `register`). `pd` is live while `self` is.
        let (mr, lkey, rkey) = unsafe {
            self.ctx.verbs.reg_dmabuf_mr(self.pd, buf.offset(), len, addr, buf.fd().as_raw_fd(), access)
        }?;
        Ok(MemoryRegion { pd: self.clone(), mr: Some(mr), lkey, rkey })
    }

    /// `ibv_create_qp` of an RC QP whose completions go to `cq` (a CQ of the same context).
    pub(crate) fn create_qp(self: &Arc<Self>, cq: &Arc<CompletionQueue>, caps: QpCaps) -> Result<QueuePair> {
        let created = self.ctx.verbs.create_qp(self.pd, cq.cq, caps)?;
        Ok(QueuePair {
            pd: self.clone(),
            _cq: cq.clone(),
            qp: created.qp,
            qpn: created.qpn,
            caps: created.caps,
        })
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: made by `alloc_pd` and never handed out: live, released once, here; every MR
        // and QP made on it holds it, so none is left.
        unsafe { self.ctx.verbs.dealloc_pd(self.pd) };
    }
}

/// A memory region (`ibv_reg_mr`, `ibv_reg_dmabuf_mr`), deregistered when dropped (or by
/// [`MemoryRegion::deregister`], which reports the error).
pub(crate) struct MemoryRegion {
    pd: Arc<ProtectionDomain>,
    /// None once deregistered.
    mr: Option<Mr>,
    lkey: u32,
    rkey: u32,
}

impl MemoryRegion {
    /// The key local work requests name it by.
    pub(crate) fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The key peers name it by.
    pub(crate) fn rkey(&self) -> u32 {
        self.rkey
    }

    /// `ibv_dereg_mr` now: returns once no operation uses the region any more.
    pub(crate) fn deregister(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        let Some(mr) = self.mr.take() else { return Ok(()) };
        // No post reads it inline any more: one that is reading it holds the read lock.
        self.pd.host_spans.write().unwrap().remove(&self.lkey);
        // SAFETY: made by `register*` and never handed out; taken out of `self.mr` just above,
        // so it is deregistered once; nothing depends on an MR.
        unsafe { self.pd.ctx.verbs.dereg_mr(mr) }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let _ = self.release();
    }
}

/// A completion channel (`ibv_create_comp_channel`), destroyed when its last CQ is gone.
pub(crate) struct CompletionChannel {
    ctx: Arc<Context>,
    ch: Channel,
    fd: RawFd,
}

impl CompletionChannel {
    /// Its descriptor: readable when an event is due (the channel owns it).
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
    }

    /// `ibv_get_cq_event` and `ibv_ack_cq_events` of that one event (call when [`Self::fd`] is
    /// readable; it blocks otherwise).
    pub(crate) fn get_cq_event(&self) -> Result<()> {
        self.ctx.verbs.get_cq_event(self.ch).map(drop)
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: made by `create_comp_channel` and never handed out: live, released once,
        // here; every CQ that sends it events holds it, so none is left.
        unsafe { self.ctx.verbs.destroy_comp_channel(self.ch) };
    }
}

/// A completion queue (`ibv_create_cq`), destroyed when its last QP is gone.
pub(crate) struct CompletionQueue {
    ctx: Arc<Context>,
    /// Kept while the CQ lives: the channel must outlive it.
    _channel: Arc<CompletionChannel>,
    cq: Cq,
}

impl CompletionQueue {
    /// `ibv_req_notify_cq`: the next completion sends one event to its channel.
    pub(crate) fn req_notify(&self) -> Result<()> {
        self.ctx.verbs.req_notify_cq(self.cq)
    }

    /// `ibv_poll_cq`: fills `out` with up to `out.len()` completions; returns how many.
    pub(crate) fn poll(&self, out: &mut [Wc]) -> Result<usize> {
        self.ctx.verbs.poll_cq(self.cq, out)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: made by `create_cq` and never handed out: live, released once, here; every
        // QP whose completions go to it holds it, so none is left.
        unsafe { self.ctx.verbs.destroy_cq(self.cq) };
    }
}

/// An RC queue pair (`ibv_create_qp`), destroyed when dropped.
pub(crate) struct QueuePair {
    pd: Arc<ProtectionDomain>,
    /// Kept while the QP lives: its CQ must outlive it.
    _cq: Arc<CompletionQueue>,
    qp: Qp,
    qpn: u32,
    caps: QpCaps,
}

impl QueuePair {
    /// Its number.
    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The capabilities it got (at least those asked for).
    pub(crate) fn caps(&self) -> QpCaps {
        self.caps
    }

    /// The provider's handle, to tell two QPs apart (only this value releases it).
    pub(crate) fn id(&self) -> Qp {
        self.qp
    }

    /// `ibv_modify_qp` through one step of the RC state machine.
    pub(crate) fn modify(&self, t: &QpTransition) -> Result<()> {
        self.pd.ctx.verbs.modify_qp(self.qp, t)
    }

    /// `ibv_post_send` of a chained list (one doorbell). Safe whatever the work requests say:
    /// the device moves bytes only through their lkeys and rkeys, and an inline request's
    /// bytes are read only where they lie in a registered host region of this QP's PD under
    /// the SGE's lkey (checked here; EINVAL naming the request and nothing posted otherwise),
    /// at most the QP's `max_inline_data` of them, WRITEs only (see the SAFETY note).
    pub(crate) fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let spans = wrs.iter().any(|w| w.inline).then(|| self.pd.host_spans.read().unwrap());
        if let Some(spans) = &spans {
            for (i, w) in wrs.iter().enumerate().filter(|(_, w)| w.inline) {
                let inside = |s: &super::Sge| {
                    spans.get(&s.lkey).is_some_and(|&(at, len)| {
                        s.addr >= at && s.addr.checked_add(s.length as u64).is_some_and(|e| e <= at + len)
                    })
                };
                let fits = w.op == super::WrOp::Write && w.bytes() <= self.caps.max_inline_data as u64;
                if !fits || !w.sges.iter().all(inside) {
                    return Err(PostError { bad_wr: i, errno: libc::EINVAL });
                }
            }
        }
        // SAFETY: `qp` is live while `self` is. [`Verbs::post_send`]'s contract is that every
        // SGE lies in memory registered under its lkey and valid until its completion (for an
        // inline request: while it is posted); here the provider holds it up itself. A
        // request that is not inline touches local memory only through an SGE's lkey, checked
        // by the device against that memory region (the NIC's protection check; the soft
        // provider's `local_regions`): an SGE outside its region completes with LOC_PROT_ERR
        // and moves nothing. An inline request's bytes are read by the provider during this
        // call, with no such check: each of its SGEs was checked above to lie inside a host
        // region registered on this PD under that lkey, and `spans` (the read lock) keeps every
        // such region registered until the call returns (`MemoryRegion::release` takes the
        // write lock before deregistering); device memory (GPUDirect) is never in `host_spans`.
        // A region's memory is valid while it is registered: a `MemoryRegion` is made only
        // from a `MemorySpan`, the registrant's promise, and deregistration stops the device
        // from touching it (the NIC invalidates the region, the soft provider's `dereg_mr`
        // waits for the operations moving its bytes). Remote addresses are the peer's NIC's to
        // check against its rkeys.
        let r = unsafe { self.pd.ctx.verbs.post_send(self.qp, wrs) };
        drop(spans);
        r
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: made by `create_qp` and never handed out: live, released once, here; nothing
        // depends on a QP.
        unsafe { self.pd.ctx.verbs.destroy_qp(self.qp) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::soft::SoftVerbs;
    use super::super::{access, Sge, WrOp};
    use super::*;
    use crate::wire::rdma::QpAddr;

    /// An inline request is posted only where each of its SGEs lies in a registered host
    /// region of the QP's PD under that lkey, it is a WRITE, and it fits the QP's
    /// `max_inline_data`; anything else is EINVAL naming it, and nothing of the list is posted.
    #[test]
    fn inline_sources_are_checked_against_registered_host_spans() {
        let verbs: Arc<dyn Verbs> = Arc::new(SoftVerbs::new());
        let ctx = Context::open(&verbs, "soft0").unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64, &ctx.create_comp_channel().unwrap()).unwrap();
        let caps =
            QpCaps { max_send_wr: 16, max_recv_wr: 1, max_send_sge: 2, max_recv_sge: 1, max_inline_data: 64 };
        let qp = pd.create_qp(&cq, caps).unwrap();
        assert_eq!(qp.caps().max_inline_data, 64);
        let remote =
            QpAddr { gid: [0xfe; 16], lid: 0, qpn: 5, psn: 1, mtu: 5, rail: 0, reads_out: 16, reads_in: 16 };
        qp.modify(&QpTransition::Init { port: 1, access: 0 }).unwrap();
        let rtr = QpTransition::Rtr {
            remote,
            mtu: 5,
            port: 1,
            gid_index: 0,
            traffic_class: 0,
            sl: 0,
            rd_atomic: 1,
        };
        qp.modify(&rtr).unwrap();
        qp.modify(&QpTransition::Rts { psn: 1, timeout: 1, retry_cnt: 0, rd_atomic: 1 }).unwrap();
        let buf = vec![7u8; 256];
        let other = [1u8; 64];
        let at = buf.as_ptr() as u64;
        // SAFETY: `buf` outlives the region (`mr` is dropped first, below).
        let span = unsafe {
            MemorySpan::new(at, 256, crate::wire::Domain::Host, crate::registry::Access::ReadWrite)
        };
        let mr = pd.register(&span, access::LOCAL_WRITE).unwrap();
        let wr = |addr: u64, length: u32, lkey: u32, op: WrOp| SendWr {
            wr_id: 1,
            op,
            sges: vec![Sge { addr, length, lkey }],
            signaled: true,
            remote_addr: 0x1000,
            rkey: 1,
            inline: true,
        };
        let lkey = mr.lkey();
        let ok = wr(at + 16, 64, lkey, WrOp::Write);
        assert_eq!(qp.post_send(std::slice::from_ref(&ok)), Ok(()), "inside the span, 64 bytes");
        let refused = |bad: SendWr| qp.post_send(&[ok.clone(), bad]).unwrap_err();
        let einval = PostError { bad_wr: 1, errno: libc::EINVAL };
        assert_eq!(refused(wr(at + 200, 64, lkey, WrOp::Write)), einval, "past the span's end");
        assert_eq!(refused(wr(other.as_ptr() as u64, 64, lkey, WrOp::Write)), einval, "not registered");
        assert_eq!(refused(wr(at, 64, lkey ^ 0x100, WrOp::Write)), einval, "another lkey");
        assert_eq!(refused(wr(at, 65, lkey, WrOp::Write)), einval, "over max_inline_data");
        assert_eq!(refused(wr(at, 64, lkey, WrOp::Read)), einval, "a READ cannot be inline");
        drop(mr);
        assert_eq!(
            qp.post_send(std::slice::from_ref(&ok)),
            Err(PostError { bad_wr: 0, errno: libc::EINVAL }),
            "deregistered"
        );
    }
}
