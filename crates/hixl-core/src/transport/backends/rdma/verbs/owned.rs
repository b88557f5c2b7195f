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

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

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
        Ok(Arc::new(ProtectionDomain { ctx: self.clone(), pd }))
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
    /// the device moves bytes only through their lkeys and rkeys (see the SAFETY note).
    pub(crate) fn post_send(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        // SAFETY: `qp` is live while `self` is. [`Verbs::post_send`]'s contract is that every
        // SGE lies in memory registered under its lkey and valid until its completion; here
        // the provider holds it up itself. It touches local memory only through an SGE's
        // lkey, checked against that memory region (the NIC's protection check; the soft
        // provider's `local_regions`): an SGE outside its region completes with LOC_PROT_ERR
        // and moves nothing. A `SendWr` carries no inline data, so nothing is read at post
        // time. A region's memory is valid while it is registered: a `MemoryRegion` is made
        // only from a `MemorySpan`, the registrant's promise, and deregistration stops the
        // device from touching it (the NIC invalidates the region, the soft provider's
        // `dereg_mr` waits for the operations moving its bytes). Remote addresses are the
        // peer's NIC's to check against its rkeys.
        unsafe { self.pd.ctx.verbs.post_send(self.qp, wrs) }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: made by `create_qp` and never handed out: live, released once, here; nothing
        // depends on a QP.
        unsafe { self.pd.ctx.verbs.destroy_qp(self.qp) };
    }
}
