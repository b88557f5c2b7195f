//! rdma-core's C ABI as far as the `verbs` provider uses it: the structures it fills or reads,
//! the offsets of fields it reads from structures it does not define, and the constants. Checked
//! against the installed `<infiniband/verbs.h>` by `ibverbs::tests::layout_matches_the_installed_header`.

use std::ffi::{c_int, c_uint, c_void};

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvSge {
    /// Start address.
    pub addr: u64,
    /// Length.
    pub length: u32,
    /// Local key.
    pub lkey: u32,
}

/// `struct ibv_send_wr` with the `rdma` member of its `wr` union (the other members are
/// padding here).
#[repr(C)]
pub struct IbvSendWr {
    /// `wr_id`.
    pub wr_id: u64,
    /// `next`.
    pub next: *mut IbvSendWr,
    /// `sg_list`.
    pub sg_list: *mut IbvSge,
    /// `num_sge`.
    pub num_sge: c_int,
    /// `opcode` (`enum ibv_wr_opcode`).
    pub opcode: c_uint,
    /// `send_flags`.
    pub send_flags: c_uint,
    /// `imm_data` / `invalidate_rkey`.
    pub imm_data: u32,
    /// `wr.rdma.remote_addr`.
    pub remote_addr: u64,
    /// `wr.rdma.rkey`.
    pub rkey: u32,
    /// The rest of the `wr` union (its `atomic` member is 32 bytes).
    pub wr_rest: [u32; 5],
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// The `bind_mw` / `tso` union (48 bytes, 8-aligned).
    pub tail: [u64; 6],
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvWc {
    /// `wr_id`.
    pub wr_id: u64,
    /// `status`.
    pub status: c_uint,
    /// `opcode`.
    pub opcode: c_uint,
    /// `vendor_err`.
    pub vendor_err: u32,
    /// `byte_len`.
    pub byte_len: u32,
    /// `imm_data` / `invalidated_rkey`.
    pub imm_data: u32,
    /// `qp_num`.
    pub qp_num: u32,
    /// `src_qp`.
    pub src_qp: u32,
    /// `wc_flags`.
    pub wc_flags: c_uint,
    /// `pkey_index`.
    pub pkey_index: u16,
    /// `slid`.
    pub slid: u16,
    /// `sl`.
    pub sl: u8,
    /// `dlid_path_bits`.
    pub dlid_path_bits: u8,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpCap {
    /// `max_send_wr`.
    pub max_send_wr: u32,
    /// `max_recv_wr`.
    pub max_recv_wr: u32,
    /// `max_send_sge`.
    pub max_send_sge: u32,
    /// `max_recv_sge`.
    pub max_recv_sge: u32,
    /// `max_inline_data`.
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct IbvQpInitAttr {
    /// `qp_context`.
    pub qp_context: *mut c_void,
    /// `send_cq`.
    pub send_cq: *mut c_void,
    /// `recv_cq`.
    pub recv_cq: *mut c_void,
    /// `srq`.
    pub srq: *mut c_void,
    /// `cap`.
    pub cap: IbvQpCap,
    /// `qp_type`.
    pub qp_type: c_uint,
    /// `sq_sig_all`.
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route` (8-aligned: its `dgid` is `union ibv_gid`, which has two u64s).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    /// `dgid`.
    pub dgid: [u8; 16],
    /// `flow_label`.
    pub flow_label: u32,
    /// `sgid_index`.
    pub sgid_index: u8,
    /// `hop_limit`.
    pub hop_limit: u8,
    /// `traffic_class`.
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvAhAttr {
    /// `grh`.
    pub grh: IbvGlobalRoute,
    /// `dlid`.
    pub dlid: u16,
    /// `sl`.
    pub sl: u8,
    /// `src_path_bits`.
    pub src_path_bits: u8,
    /// `static_rate`.
    pub static_rate: u8,
    /// `is_global`.
    pub is_global: u8,
    /// `port_num`.
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IbvQpAttr {
    /// `qp_state`.
    pub qp_state: c_uint,
    /// `cur_qp_state`.
    pub cur_qp_state: c_uint,
    /// `path_mtu`.
    pub path_mtu: c_uint,
    /// `path_mig_state`.
    pub path_mig_state: c_uint,
    /// `qkey`.
    pub qkey: u32,
    /// `rq_psn`.
    pub rq_psn: u32,
    /// `sq_psn`.
    pub sq_psn: u32,
    /// `dest_qp_num`.
    pub dest_qp_num: u32,
    /// `qp_access_flags`.
    pub qp_access_flags: c_uint,
    /// `cap`.
    pub cap: IbvQpCap,
    /// `ah_attr`.
    pub ah_attr: IbvAhAttr,
    /// `alt_ah_attr`.
    pub alt_ah_attr: IbvAhAttr,
    /// `pkey_index`.
    pub pkey_index: u16,
    /// `alt_pkey_index`.
    pub alt_pkey_index: u16,
    /// `en_sqd_async_notify`.
    pub en_sqd_async_notify: u8,
    /// `sq_draining`.
    pub sq_draining: u8,
    /// `max_rd_atomic`.
    pub max_rd_atomic: u8,
    /// `max_dest_rd_atomic`.
    pub max_dest_rd_atomic: u8,
    /// `min_rnr_timer`.
    pub min_rnr_timer: u8,
    /// `port_num`.
    pub port_num: u8,
    /// `timeout`.
    pub timeout: u8,
    /// `retry_cnt`.
    pub retry_cnt: u8,
    /// `rnr_retry`.
    pub rnr_retry: u8,
    /// `alt_port_num`.
    pub alt_port_num: u8,
    /// `alt_timeout`.
    pub alt_timeout: u8,
    /// `rate_limit`.
    pub rate_limit: u32,
}

/// Offsets into rdma-core structures that are read, not defined, here.
pub mod offsets {
    /// `offsetof(struct ibv_context, ops.poll_cq)`: `device`, then 11 pointers of `ops`.
    pub(in crate::transport::backends::rdma) const CTX_POLL_CQ: usize = 8 + 11 * 8;
    /// `offsetof(struct ibv_context, ops.req_notify_cq)`.
    pub(in crate::transport::backends::rdma) const CTX_REQ_NOTIFY_CQ: usize = 8 + 12 * 8;
    /// `offsetof(struct ibv_context, ops.post_send)`.
    pub(in crate::transport::backends::rdma) const CTX_POST_SEND: usize = 8 + 25 * 8;
    /// `offsetof(struct ibv_qp, qp_num)`: context, qp_context, pd, send_cq, recv_cq, srq,
    /// handle.
    pub(in crate::transport::backends::rdma) const QP_NUM: usize = 52;
    /// `offsetof(struct ibv_mr, lkey)` and `rkey`.
    pub(in crate::transport::backends::rdma) const MR_LKEY: usize = 36;
    /// `offsetof(struct ibv_mr, rkey)`.
    pub(in crate::transport::backends::rdma) const MR_RKEY: usize = 40;
    /// `offsetof(struct ibv_comp_channel, fd)`.
    pub(in crate::transport::backends::rdma) const CHANNEL_FD: usize = 8;
    /// `offsetof(struct ibv_port_attr, ...)`: state, active_mtu, gid_tbl_len, max_msg_sz, lid,
    /// link_layer.
    pub(in crate::transport::backends::rdma) const PORT_STATE: usize = 0;
    /// See [`PORT_STATE`].
    pub(in crate::transport::backends::rdma) const PORT_ACTIVE_MTU: usize = 8;
    /// See [`PORT_STATE`].
    pub(in crate::transport::backends::rdma) const PORT_GID_TBL_LEN: usize = 12;
    /// See [`PORT_STATE`].
    pub(in crate::transport::backends::rdma) const PORT_MAX_MSG_SZ: usize = 20;
    /// See [`PORT_STATE`].
    pub(in crate::transport::backends::rdma) const PORT_LID: usize = 34;
    /// See [`PORT_STATE`].
    pub(in crate::transport::backends::rdma) const PORT_LINK_LAYER: usize = 46;
    /// `offsetof(struct ibv_device_attr, ...)`: fw_ver[64], node_guid, sys_image_guid, then
    /// max_mr_size, page_size_cap, vendor_id, vendor_part_id, hw_ver and the `int` limits.
    pub(in crate::transport::backends::rdma) const DEV_MAX_MR_SIZE: usize = 80;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_QP: usize = 108;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_QP_WR: usize = 112;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_SGE: usize = 120;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_SGE_RD: usize = 124;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_CQ: usize = 128;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_CQE: usize = 132;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_QP_RD_ATOM: usize = 144;
    /// See [`DEV_MAX_MR_SIZE`].
    pub(in crate::transport::backends::rdma) const DEV_MAX_QP_INIT_RD_ATOM: usize = 156;
}

pub(super) const IBV_QPT_RC: c_uint = 2;
pub(super) const IBV_WR_RDMA_WRITE: c_uint = 0;
pub(super) const IBV_WR_RDMA_READ: c_uint = 4;
pub(super) const IBV_SEND_SIGNALED: c_uint = 2;
pub(super) const IBV_SEND_INLINE: c_uint = 8;
pub(super) const QPS_RESET: c_uint = 0;
pub(super) const QPS_INIT: c_uint = 1;
pub(super) const QPS_RTR: c_uint = 2;
pub(super) const QPS_RTS: c_uint = 3;
pub(super) const QPS_ERR: c_uint = 6;
pub(super) mod mask {
    pub(in crate::transport::backends::rdma) const STATE: i32 = 1;
    pub(in crate::transport::backends::rdma) const ACCESS_FLAGS: i32 = 1 << 3;
    pub(in crate::transport::backends::rdma) const PKEY_INDEX: i32 = 1 << 4;
    pub(in crate::transport::backends::rdma) const PORT: i32 = 1 << 5;
    pub(in crate::transport::backends::rdma) const AV: i32 = 1 << 7;
    pub(in crate::transport::backends::rdma) const PATH_MTU: i32 = 1 << 8;
    pub(in crate::transport::backends::rdma) const TIMEOUT: i32 = 1 << 9;
    pub(in crate::transport::backends::rdma) const RETRY_CNT: i32 = 1 << 10;
    pub(in crate::transport::backends::rdma) const RNR_RETRY: i32 = 1 << 11;
    pub(in crate::transport::backends::rdma) const RQ_PSN: i32 = 1 << 12;
    pub(in crate::transport::backends::rdma) const MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    pub(in crate::transport::backends::rdma) const MIN_RNR_TIMER: i32 = 1 << 15;
    pub(in crate::transport::backends::rdma) const SQ_PSN: i32 = 1 << 16;
    pub(in crate::transport::backends::rdma) const MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
    pub(in crate::transport::backends::rdma) const DEST_QPN: i32 = 1 << 20;
}
