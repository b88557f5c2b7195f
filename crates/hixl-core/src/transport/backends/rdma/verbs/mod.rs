//! The `rdma` backend's FFI layer: everything that talks to a provider through raw handles.
//!
//! The verbs interface the backend is written against is here ([`Verbs`]): one method per
//! `ibv_*` call it uses, with the same meaning, arguments and failure modes, and its two
//! providers: `verbs` (libibverbs loaded at run time, `ibverbs.rs`) and `soft` (a software RC
//! NIC between processes, `soft/`). Objects are opaque handles that only the provider that
//! made them understands; the backend holds them as the owned types of `owned.rs`, which
//! release themselves on drop. A handle's value is private to this crate: only a provider
//! makes one, so safe code outside it cannot forge one for the providers' safe methods, which
//! dereference it. The backend outside this module has no unsafe code: registering takes a
//! `MemorySpan` (the registrant's promise, as a value) and posting is safe because the device
//! moves bytes only through the lkeys and rkeys of registered regions.

pub mod ibverbs;
mod owned;
pub mod soft;

use crate::error::Result;
use crate::wire::rdma::QpAddr;
pub(crate) use owned::{
    CompletionChannel, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QueuePair,
};

/// A device context (`struct ibv_context *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ctx(pub(crate) u64);
/// A protection domain (`struct ibv_pd *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pd(pub(crate) u64);
/// A memory region (`struct ibv_mr *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mr(pub(crate) u64);
/// A completion queue (`struct ibv_cq *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cq(pub(crate) u64);
/// A completion channel (`struct ibv_comp_channel *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Channel(pub(crate) u64);
/// A queue pair (`struct ibv_qp *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Qp(pub(crate) u64);

/// `IBV_ACCESS_*` bits.
pub mod access {
    /// The HCA may write the region (the destination of an RDMA READ).
    pub const LOCAL_WRITE: u32 = 1;
    /// Peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: u32 = 2;
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: u32 = 4;
}

/// `enum ibv_wc_status` values the backend distinguishes (the rest map to FAILED).
pub mod wc {
    /// The work request completed.
    pub const SUCCESS: u32 = 0;
    /// A message longer than the port allows (or an SGE list longer than the WR).
    pub const LOC_LEN_ERR: u32 = 1;
    /// Local QP operation error.
    pub const LOC_QP_OP_ERR: u32 = 2;
    /// A local SGE names no valid lkey, lies outside its region or lacks its access.
    pub const LOC_PROT_ERR: u32 = 4;
    /// Flushed: the QP was in the error state (another WR failed, or it was moved there).
    pub const WR_FLUSH_ERR: u32 = 5;
    /// The responder refused the request as invalid (e.g. its QP lacks remote access).
    pub const REM_INV_REQ_ERR: u32 = 9;
    /// The responder refused the rkey, the range or the access (a NIC's "remote access error").
    pub const REM_ACCESS_ERR: u32 = 10;
    /// The responder failed to carry out the operation.
    pub const REM_OP_ERR: u32 = 11;
    /// No answer from the responder after every retry.
    pub const RETRY_EXC_ERR: u32 = 12;

    /// The name `ibv_wc_status_str` gives a status.
    pub fn name(status: u32) -> &'static str {
        match status {
            SUCCESS => "success",
            LOC_LEN_ERR => "local length error",
            LOC_QP_OP_ERR => "local QP operation error",
            LOC_PROT_ERR => "local protection error",
            WR_FLUSH_ERR => "work request flushed error",
            REM_INV_REQ_ERR => "remote invalid request error",
            REM_ACCESS_ERR => "remote access error",
            REM_OP_ERR => "remote operation error",
            RETRY_EXC_ERR => "transport retry counter exceeded",
            _ => "other work completion error",
        }
    }
}

/// `enum ibv_port_state`: the one state a port carries traffic in.
pub const PORT_ACTIVE: u32 = 4;

/// The parts of `struct ibv_port_attr` the backend uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAttr {
    /// `enum ibv_port_state` ([`PORT_ACTIVE`] carries traffic).
    pub state: u32,
    /// `enum ibv_mtu` (1 = 256 ... 5 = 4096).
    pub active_mtu: u8,
    /// Largest message of one work request.
    pub max_msg_sz: u32,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// 1 = InfiniBand, 2 = Ethernet (RoCE).
    pub link_layer: u8,
    /// Entries in the GID table.
    pub gid_tbl_len: i32,
}

/// The parts of `struct ibv_device_attr` (`ibv_query_device`) the backend sizes its queues by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Most QPs.
    pub max_qp: i32,
    /// Most outstanding work requests of one queue.
    pub max_qp_wr: i32,
    /// Most scatter/gather entries of one send work request.
    pub max_sge: i32,
    /// Most scatter/gather entries of one RDMA READ (0 on some devices: then `max_sge`).
    pub max_sge_rd: i32,
    /// Most CQs.
    pub max_cq: i32,
    /// Most entries of one CQ.
    pub max_cqe: i32,
    /// Most outstanding RDMA READs a QP answers as the responder.
    pub max_qp_rd_atom: i32,
    /// Most outstanding RDMA READs a QP issues as the initiator.
    pub max_qp_init_rd_atom: i32,
}

/// `struct ibv_qp_cap`: what a QP was asked for, and (from `create_qp`) what it got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send WR.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive WR.
    pub max_recv_sge: u32,
    /// Bytes a send WR may carry inline (copied at post time).
    pub max_inline_data: u32,
}

/// A created queue pair.
#[derive(Clone, Copy, Debug)]
pub struct QpCreated {
    /// Its handle.
    pub qp: Qp,
    /// Its number.
    pub qpn: u32,
    /// The capabilities it got (at least those asked for).
    pub caps: QpCaps,
}

/// One `ibv_modify_qp` call of an RC QP's life, with the attributes (and mask) that state needs.
#[derive(Clone, Copy, Debug)]
pub enum QpTransition {
    /// RESET -> INIT: the port and the remote access the QP lets peers have.
    Init {
        /// Port number (from 1).
        port: u8,
        /// `IBV_ACCESS_REMOTE_*` bits.
        access: u32,
    },
    /// INIT -> RTR: the peer's address and the MTU.
    Rtr {
        /// The peer's QP (its GID, LID, QPN and first PSN).
        remote: QpAddr,
        /// Path MTU (`enum ibv_mtu`).
        mtu: u8,
        /// Our port.
        port: u8,
        /// Our GID index (a GRH is used: RoCE needs one).
        gid_index: u8,
        /// The GRH traffic class.
        traffic_class: u8,
        /// The service level.
        sl: u8,
        /// `max_dest_rd_atomic`: RDMA READs of the peer this QP answers at once.
        rd_atomic: u8,
    },
    /// RTR -> RTS: our first PSN and the retry budget.
    Rts {
        /// First PSN we send.
        psn: u32,
        /// Local ACK timeout: 4.096 us * 2^timeout per try.
        timeout: u8,
        /// Retries before RETRY_EXC_ERR.
        retry_cnt: u8,
        /// `max_rd_atomic`: RDMA READs this QP has outstanding at once.
        rd_atomic: u8,
    },
    /// Any state -> ERR: outstanding work requests are flushed.
    Err,
    /// Any state -> RESET: outstanding work requests are discarded without completions.
    #[allow(dead_code)] // one to one with the verbs; the backend replaces QPs rather than reset them
    Reset,
}

/// A scatter/gather entry (`struct ibv_sge`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    /// Local address.
    pub addr: u64,
    /// Bytes.
    pub length: u32,
    /// The lkey of the region it lies in.
    pub lkey: u32,
}

/// The one-sided operations the backend posts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrOp {
    /// IBV_WR_RDMA_WRITE: local SGEs -> remote range.
    Write,
    /// IBV_WR_RDMA_READ: remote range -> local SGEs.
    Read,
}

/// A send work request (`struct ibv_send_wr`) of an RDMA READ or WRITE; a slice of them is one
/// chained list, posted with one doorbell.
#[derive(Clone, Debug)]
pub struct SendWr {
    /// Returned in its completion.
    pub wr_id: u64,
    /// READ or WRITE.
    pub op: WrOp,
    /// Local scatter/gather list.
    pub sges: Vec<Sge>,
    /// IBV_SEND_SIGNALED: a completion is generated on success (errors always generate one).
    pub signaled: bool,
    /// Remote start address.
    pub remote_addr: u64,
    /// The remote region's rkey.
    pub rkey: u32,
    /// IBV_SEND_INLINE (a WRITE of at most the QP's `max_inline_data`): the provider copies the
    /// SGEs' bytes when it is posted, without the lkey check a NIC makes when it reads them
    /// itself; `QueuePair::post_send` checks them against the registered spans instead.
    pub inline: bool,
}

impl SendWr {
    /// Bytes the request moves.
    pub fn bytes(&self) -> u64 {
        self.sges.iter().map(|s| s.length as u64).sum()
    }
}

/// A work completion (`struct ibv_wc`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wc {
    /// The completed request's `wr_id`.
    pub wr_id: u64,
    /// `enum ibv_wc_status` (see [`wc`]).
    pub status: u32,
    /// Provider-specific detail of an error.
    pub vendor_err: u32,
    /// The QP it belongs to.
    pub qp_num: u32,
}

/// Why `post_send` refused a list: `bad_wr` is the index of the first request not posted (those
/// before it were), `errno` says why (ENOMEM: the send queue is full; EINVAL: a bad request or
/// a QP in the wrong state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostError {
    /// Index of the first request not posted.
    pub bad_wr: usize,
    /// The errno.
    pub errno: i32,
}

/// The verbs the `rdma` backend calls, one to one with `ibv_*`.
pub trait Verbs: Send + Sync {
    /// "verbs" or "soft".
    fn provider(&self) -> &'static str;
    /// `ibv_get_device_list` + `ibv_get_device_name`: the names of the devices present.
    fn get_device_list(&self) -> Result<Vec<String>>;
    /// `ibv_open_device` (of the device with that name).
    fn open_device(&self, name: &str) -> Result<Ctx>;
    /// `ibv_close_device`.
    ///
    /// # Safety
    /// `ctx` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it, and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn close_device(&self, ctx: Ctx);
    /// `ibv_query_device`: the device's limits.
    fn query_device(&self, ctx: Ctx) -> Result<DeviceAttr>;
    /// `ibv_query_port`.
    fn query_port(&self, ctx: Ctx, port: u8) -> Result<PortAttr>;
    /// `ibv_query_gid`.
    fn query_gid(&self, ctx: Ctx, port: u8, index: u8) -> Result<[u8; 16]>;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self, ctx: Ctx) -> Result<Pd>;
    /// `ibv_dealloc_pd`.
    ///
    /// # Safety
    /// `pd` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it (MRs, QPs), and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn dealloc_pd(&self, pd: Pd);
    /// `ibv_reg_mr`: returns the region and its (lkey, rkey).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay mapped until `dereg_mr` returns: the device reads and
    /// writes it on its own (a real NIC pins the pages; the soft one copies into them).
    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: u32) -> Result<(Mr, u32, u32)>;
    /// Whether [`Verbs::reg_dmabuf_mr`] can register a GPU's dma-buf here: Err names what is
    /// missing (libibverbs without `ibv_reg_dmabuf_mr`, or a provider that cannot reach GPU
    /// memory). The default: a provider without it.
    fn gpu_dmabuf(&self) -> std::result::Result<(), String> {
        Err(format!("the {} provider has no ibv_reg_dmabuf_mr", self.provider()))
    }
    /// `ibv_reg_dmabuf_mr`: registers `len` bytes at `offset` of the dma-buf `fd`, addressed by
    /// work requests and peers as `[iova, iova + len)`; returns the region and its (lkey, rkey).
    /// The region holds its own reference to the dma-buf: the caller may close `fd` after.
    /// The default: UNSUPPORTED, naming the missing call.
    ///
    /// # Safety
    /// `fd` must be a dma-buf (or, for the soft provider, a mappable file) of at least
    /// `offset + len` bytes that nothing else writes through in a way the caller did not agree to.
    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: std::os::fd::RawFd,
        access: u32,
    ) -> Result<(Mr, u32, u32)> {
        let _ = (pd, offset, len, iova, fd, access);
        Err(crate::error::Error::new(
            crate::error::Status::Unsupported,
            format!("the {} provider has no ibv_reg_dmabuf_mr", self.provider()),
        ))
    }
    /// `ibv_dereg_mr`: returns once no operation uses the region any more.
    ///
    /// # Safety
    /// `mr` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it, and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn dereg_mr(&self, mr: Mr) -> Result<()>;
    /// `ibv_create_comp_channel`: the channel and its file descriptor (readable when an event
    /// is due; the caller may poll it).
    fn create_comp_channel(&self, ctx: Ctx) -> Result<(Channel, std::os::fd::RawFd)>;
    /// `ibv_destroy_comp_channel`.
    ///
    /// # Safety
    /// `ch` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it (CQs), and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn destroy_comp_channel(&self, ch: Channel);
    /// `ibv_create_cq` with at least `cqe` entries, its events going to `ch`.
    fn create_cq(&self, ctx: Ctx, cqe: u32, ch: Option<Channel>) -> Result<Cq>;
    /// `ibv_destroy_cq`.
    ///
    /// # Safety
    /// `cq` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it (QPs), and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn destroy_cq(&self, cq: Cq);
    /// `ibv_req_notify_cq`: the next completion on `cq` sends one event to its channel.
    fn req_notify_cq(&self, cq: Cq) -> Result<()>;
    /// `ibv_get_cq_event` (call when the channel's fd is readable; it blocks otherwise) followed
    /// by `ibv_ack_cq_events` for that one event: the CQ it was for.
    fn get_cq_event(&self, ch: Channel) -> Result<Cq>;
    /// `ibv_poll_cq`: fills `out` with up to `out.len()` completions; returns how many.
    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize>;
    /// `ibv_create_qp` of an RC QP whose send and receive completions go to `cq`.
    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<QpCreated>;
    /// `ibv_modify_qp` through one step of the RC state machine.
    fn modify_qp(&self, qp: Qp, t: &QpTransition) -> Result<()>;
    /// `ibv_destroy_qp`.
    ///
    /// # Safety
    /// `qp` must come from this provider, be live (not released yet), have nothing left
    /// that depends on it, and never be used again after the call: the handle is a
    /// plain number, and releasing a forged or stale one frees what another owner still uses.
    unsafe fn destroy_qp(&self, qp: Qp);
    /// `ibv_post_send` of a chained list (one doorbell).
    ///
    /// # Safety
    /// Every SGE must lie in memory registered under its lkey, valid until the request's
    /// completion (or, for an unsignaled one, a later one's) has been polled.
    unsafe fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError>;
}
