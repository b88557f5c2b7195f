//! The `verbs` provider: libibverbs.so.1 loaded at run time (`dlopen`), so that one build (and
//! one prebuilt wheel) carries RDMA without a link-time dependency and still loads where
//! rdma-core is missing (then the backend reports why and offers nothing).
//!
//! Most calls are exported functions of libibverbs, found with `dlsym`. Three are not:
//! `ibv_post_send`, `ibv_poll_cq` and `ibv_req_notify_cq` are static inline functions of
//! `<infiniband/verbs.h>` that call through the device context's operation table
//! (`ctx->ops.post_send`, ...), the provider's fast path. They are called the same way here,
//! which needs the C layouts of `struct ibv_context` (up to its `ops`), `ibv_send_wr`, `ibv_sge`,
//! `ibv_wc`, `ibv_qp_attr` and the fields read from `ibv_qp`, `ibv_mr`, `ibv_cq` and
//! `ibv_comp_channel`. They are defined below (rdma-core's ABI, stable since libibverbs 1.1) and
//! checked against the installed header by `layout_matches_the_installed_header` (a C program
//! compiled with the header prints the sizes and offsets).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

mod abi;
mod dmabuf;
pub use abi::*;
use abi::{
    mask, IBV_QPT_RC, IBV_SEND_INLINE, IBV_SEND_SIGNALED, IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, QPS_ERR,
    QPS_INIT, QPS_RESET, QPS_RTR, QPS_RTS,
};
use std::os::fd::RawFd;

use super::{
    Channel, Cq, Ctx, DeviceAttr, Mr, Pd, PortAttr, PostError, Qp, QpCaps, QpCreated, QpTransition, SendWr,
    Verbs, Wc, WrOp,
};
use crate::error::{Error, Result};

/// The library's soname.
pub const LIBRARY: &str = "libibverbs.so.1";

type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut IbvWc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut c_void, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;

/// The exported functions, resolved once.
struct Fns {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void,
    free_device_list: unsafe extern "C" fn(*mut *mut c_void),
    get_device_name: unsafe extern "C" fn(*mut c_void) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    close_device: unsafe extern "C" fn(*mut c_void) -> c_int,
    query_device: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int,
    query_port: unsafe extern "C" fn(*mut c_void, u8, *mut c_void) -> c_int,
    query_gid: unsafe extern "C" fn(*mut c_void, u8, c_int, *mut [u8; 16]) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut c_void,
    dereg_mr: unsafe extern "C" fn(*mut c_void) -> c_int,
    create_comp_channel: unsafe extern "C" fn(*mut c_void) -> *mut c_void,
    destroy_comp_channel: unsafe extern "C" fn(*mut c_void) -> c_int,
    create_cq: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, *mut c_void, c_int) -> *mut c_void,
    destroy_cq: unsafe extern "C" fn(*mut c_void) -> c_int,
    get_cq_event: unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut c_void, c_uint),
    create_qp: unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut c_void,
    modify_qp: unsafe extern "C" fn(*mut c_void, *mut IbvQpAttr, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut c_void) -> c_int,
    /// `ibv_reg_dmabuf_mr` (rdma-core >= 34), or why it is not there.
    reg_dmabuf_mr: std::result::Result<dmabuf::RegDmabufMr, String>,
}

/// libibverbs, loaded.
pub struct LibVerbs {
    f: Fns,
    /// The last `ibv_get_device_list` (kept until the next: `ibv_open_device` needs its
    /// entries; contexts opened from it stay valid after it is freed) and its devices by name.
    devices: std::sync::Mutex<(u64, Vec<(String, u64)>)>,
}

fn errno_err(call: &str) -> Error {
    let e = std::io::Error::last_os_error();
    Error::failed(format!("{call} failed: {e}"))
}

fn rc_err(call: &str, rc: c_int) -> Error {
    // Verbs calls return the errno itself (positive) or -1 with errno set.
    let e = if rc > 0 { std::io::Error::from_raw_os_error(rc) } else { std::io::Error::last_os_error() };
    Error::failed(format!("{call} failed: {e}"))
}

fn ptr(h: u64) -> *mut c_void {
    h as usize as *mut c_void
}

impl LibVerbs {
    /// Loads `libibverbs.so.1`; UNSUPPORTED naming the loader's reason when it is not there.
    pub fn load() -> Result<LibVerbs> {
        // SAFETY: LIBRARY is rdma-core's soname, whose ABI is the one this module declares.
        unsafe { Self::load_from(LIBRARY) }
    }

    /// Loads the library `name` (a soname or a path).
    ///
    /// # Safety
    /// `name` must be a libibverbs of the ABI this module declares: its constructors run at
    /// load, and its `ibv_*` symbols are called with the signatures of `verbs.h`.
    pub unsafe fn load_from(name: &str) -> Result<LibVerbs> {
        let c = CString::new(name).map_err(|_| Error::param(format!("library name {name:?} has a NUL")))?;
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for the process's life
        // (never dlclose'd: providers it loads register global state).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message (or NULL) owned by libc.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "unknown error".to_string()
            } else {
                // SAFETY: non-null, NUL-terminated, valid until the next dl* call.
                unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
            };
            return Err(crate::transport::backends::rdma::unsupported(format!(
                "{name} cannot be loaded (rdma-core's libibverbs is not installed?): {why}"
            )));
        }
        macro_rules! sym {
            ($n:literal) => {{
                // SAFETY: a symbol lookup in a handle we hold, with a NUL-terminated name.
                let p = unsafe { libc::dlsym(h, concat!($n, "\0").as_ptr().cast()) };
                if p.is_null() {
                    return Err(crate::transport::backends::rdma::unsupported(format!(
                        "{name} has no symbol {}",
                        $n
                    )));
                }
                // SAFETY: the symbol is the libibverbs function of that name, whose C signature
                // the field's type spells (rdma-core's verbs.h).
                unsafe { fn_ptr(p) }
            }};
        }
        let f = Fns {
            get_device_list: sym!("ibv_get_device_list"),
            free_device_list: sym!("ibv_free_device_list"),
            get_device_name: sym!("ibv_get_device_name"),
            open_device: sym!("ibv_open_device"),
            close_device: sym!("ibv_close_device"),
            query_device: sym!("ibv_query_device"),
            query_port: sym!("ibv_query_port"),
            query_gid: sym!("ibv_query_gid"),
            alloc_pd: sym!("ibv_alloc_pd"),
            dealloc_pd: sym!("ibv_dealloc_pd"),
            reg_mr: sym!("ibv_reg_mr"),
            dereg_mr: sym!("ibv_dereg_mr"),
            create_comp_channel: sym!("ibv_create_comp_channel"),
            destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
            create_cq: sym!("ibv_create_cq"),
            destroy_cq: sym!("ibv_destroy_cq"),
            get_cq_event: sym!("ibv_get_cq_event"),
            ack_cq_events: sym!("ibv_ack_cq_events"),
            create_qp: sym!("ibv_create_qp"),
            modify_qp: sym!("ibv_modify_qp"),
            destroy_qp: sym!("ibv_destroy_qp"),
            // SAFETY: a handle we hold (never closed).
            reg_dmabuf_mr: unsafe { dmabuf::resolve(h, name) },
        };
        Ok(LibVerbs { f, devices: std::sync::Mutex::new((0, Vec::new())) })
    }

    /// The function at `offset` of the operation table of the context `obj` points to (`obj`'s
    /// first field is its `struct ibv_context *`).
    ///
    /// # Safety
    /// `obj` must be a live verbs object whose first field is its context.
    unsafe fn op(obj: *mut c_void, offset: usize) -> *const c_void {
        // SAFETY: the caller's contract: the first field is the context pointer, and the
        // context's layout up to its ops table is `offsets::CTX_*` (checked against the header).
        unsafe {
            let ctx = *(obj as *const *const u8);
            *(ctx.add(offset) as *const *const c_void)
        }
    }

    fn modify(&self, qp: Qp, attr: &mut IbvQpAttr, m: i32) -> Result<()> {
        // SAFETY: a live QP and a fully initialised attribute structure.
        let rc = unsafe { (self.f.modify_qp)(ptr(qp.0), attr, m) };
        if rc != 0 {
            return Err(rc_err("ibv_modify_qp", rc));
        }
        Ok(())
    }
}

impl Verbs for LibVerbs {
    fn provider(&self) -> &'static str {
        "verbs"
    }

    fn get_device_list(&self) -> Result<Vec<String>> {
        let mut n: c_int = 0;
        // SAFETY: writes the count into `n`; returns a NULL-terminated array or NULL.
        let list = unsafe { (self.f.get_device_list)(&mut n) };
        if list.is_null() {
            // ENOSYS: the kernel has no RDMA support at all.
            return Err(errno_err("ibv_get_device_list"));
        }
        let mut out = Vec::new();
        let mut g = self.devices.lock().unwrap();
        if g.0 != 0 {
            // SAFETY: the previous list, from ibv_get_device_list, freed once; devices opened
            // from it stay valid (ibv_free_device_list(3)).
            unsafe { (self.f.free_device_list)(ptr(g.0).cast()) };
        }
        *g = (list as u64, Vec::new());
        let devs = &mut g.1;
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` holds `n` device pointers; each has a NUL-terminated name.
            let (d, name) = unsafe {
                let d = *list.add(i);
                (d, CStr::from_ptr((self.f.get_device_name)(d)).to_string_lossy().into_owned())
            };
            devs.push((name.clone(), d as u64));
            out.push(name);
        }
        Ok(out)
    }

    fn open_device(&self, name: &str) -> Result<Ctx> {
        let g = self.devices.lock().unwrap();
        let d = g.1.iter().find(|(n, _)| n == name).map(|(_, d)| *d);
        let d = d.ok_or_else(|| Error::param(format!("no RDMA device {name:?} (list the devices first)")))?;
        // SAFETY: a device of the live list.
        let c = unsafe { (self.f.open_device)(ptr(d)) };
        if c.is_null() {
            return Err(errno_err(&format!("ibv_open_device({name})")));
        }
        Ok(Ctx(c as u64))
    }

    unsafe fn close_device(&self, ctx: Ctx) {
        // SAFETY: a context we opened, closed once.
        unsafe { (self.f.close_device)(ptr(ctx.0)) };
    }

    fn query_device(&self, ctx: Ctx) -> Result<DeviceAttr> {
        // Larger than any version's struct ibv_device_attr (232 bytes), zeroed.
        let mut buf = [0u64; 64];
        // SAFETY: a live context and a writable buffer larger than the structure.
        let rc = unsafe { (self.f.query_device)(ptr(ctx.0), buf.as_mut_ptr().cast()) };
        if rc != 0 {
            return Err(rc_err("ibv_query_device", rc));
        }
        let b: &[u8] = bytemuck_bytes(&buf);
        let i32_at = |o: usize| i32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        use offsets::*;
        Ok(DeviceAttr {
            max_mr_size: u64::from_ne_bytes(b[DEV_MAX_MR_SIZE..DEV_MAX_MR_SIZE + 8].try_into().unwrap()),
            max_qp: i32_at(DEV_MAX_QP),
            max_qp_wr: i32_at(DEV_MAX_QP_WR),
            max_sge: i32_at(DEV_MAX_SGE),
            max_sge_rd: i32_at(DEV_MAX_SGE_RD),
            max_cq: i32_at(DEV_MAX_CQ),
            max_cqe: i32_at(DEV_MAX_CQE),
            max_qp_rd_atom: i32_at(DEV_MAX_QP_RD_ATOM),
            max_qp_init_rd_atom: i32_at(DEV_MAX_QP_INIT_RD_ATOM),
        })
    }

    fn query_port(&self, ctx: Ctx, port: u8) -> Result<PortAttr> {
        // Larger than any version's struct ibv_port_attr, zeroed.
        let mut buf = [0u64; 32];
        // SAFETY: a live context and a writable buffer larger than the structure.
        let rc = unsafe { (self.f.query_port)(ptr(ctx.0), port, buf.as_mut_ptr().cast()) };
        if rc != 0 {
            return Err(rc_err(&format!("ibv_query_port(port {port})"), rc));
        }
        let b: &[u8] = bytemuck_bytes(&buf);
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().unwrap());
        use offsets::*;
        Ok(PortAttr {
            state: u32_at(PORT_STATE),
            active_mtu: u32_at(PORT_ACTIVE_MTU) as u8,
            max_msg_sz: u32_at(PORT_MAX_MSG_SZ),
            lid: u16::from_ne_bytes([b[PORT_LID], b[PORT_LID + 1]]),
            link_layer: b[PORT_LINK_LAYER],
            gid_tbl_len: u32_at(PORT_GID_TBL_LEN) as i32,
        })
    }

    fn query_gid(&self, ctx: Ctx, port: u8, index: u8) -> Result<[u8; 16]> {
        let mut gid = [0u8; 16];
        // SAFETY: a live context and a 16-byte union ibv_gid.
        let rc = unsafe { (self.f.query_gid)(ptr(ctx.0), port, index as c_int, &mut gid) };
        if rc != 0 {
            return Err(rc_err(&format!("ibv_query_gid(port {port}, index {index})"), rc));
        }
        Ok(gid)
    }

    fn alloc_pd(&self, ctx: Ctx) -> Result<Pd> {
        // SAFETY: a live context.
        let p = unsafe { (self.f.alloc_pd)(ptr(ctx.0)) };
        if p.is_null() {
            return Err(errno_err("ibv_alloc_pd"));
        }
        Ok(Pd(p as u64))
    }

    unsafe fn dealloc_pd(&self, pd: Pd) {
        // SAFETY: a PD we allocated, freed once.
        unsafe { (self.f.dealloc_pd)(ptr(pd.0)) };
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: u32) -> Result<(Mr, u32, u32)> {
        // SAFETY: the caller guarantees the range stays mapped until dereg_mr.
        let m = unsafe {
            (self.f.reg_mr)(ptr(pd.0), addr as usize as *mut c_void, len as usize, access as c_int)
        };
        if m.is_null() {
            return Err(errno_err(&format!("ibv_reg_mr(0x{addr:x}+{len})")));
        }
        // SAFETY: a live struct ibv_mr; lkey and rkey at their offsets (checked against the header).
        let (lkey, rkey) = unsafe {
            let b = m as *const u8;
            (*(b.add(offsets::MR_LKEY) as *const u32), *(b.add(offsets::MR_RKEY) as *const u32))
        };
        Ok((Mr(m as u64), lkey, rkey))
    }

    fn gpu_dmabuf(&self) -> std::result::Result<(), String> {
        self.f.reg_dmabuf_mr.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: RawFd,
        acc: u32,
    ) -> Result<(Mr, u32, u32)> {
        // SAFETY: the caller's contract (a dma-buf of at least offset + len bytes).
        unsafe { self.dmabuf_mr(pd, offset, len, iova, fd, acc) }
    }

    unsafe fn dereg_mr(&self, mr: Mr) -> Result<()> {
        // SAFETY: an MR we registered, deregistered once.
        let rc = unsafe { (self.f.dereg_mr)(ptr(mr.0)) };
        if rc != 0 {
            return Err(rc_err("ibv_dereg_mr", rc));
        }
        Ok(())
    }

    fn create_comp_channel(&self, ctx: Ctx) -> Result<(Channel, RawFd)> {
        // SAFETY: a live context.
        let c = unsafe { (self.f.create_comp_channel)(ptr(ctx.0)) };
        if c.is_null() {
            return Err(errno_err("ibv_create_comp_channel"));
        }
        // SAFETY: a live struct ibv_comp_channel; its fd at its offset.
        let fd = unsafe { *((c as *const u8).add(offsets::CHANNEL_FD) as *const c_int) };
        Ok((Channel(c as u64), fd))
    }

    unsafe fn destroy_comp_channel(&self, ch: Channel) {
        // SAFETY: a channel we created, destroyed once (after its CQ).
        unsafe { (self.f.destroy_comp_channel)(ptr(ch.0)) };
    }

    fn create_cq(&self, ctx: Ctx, cqe: u32, ch: Option<Channel>) -> Result<Cq> {
        let ch = ch.map_or(std::ptr::null_mut(), |c| ptr(c.0));
        // SAFETY: a live context and channel (or none); no CQ context; vector 0.
        let c = unsafe { (self.f.create_cq)(ptr(ctx.0), cqe as c_int, std::ptr::null_mut(), ch, 0) };
        if c.is_null() {
            return Err(errno_err(&format!("ibv_create_cq({cqe})")));
        }
        Ok(Cq(c as u64))
    }

    unsafe fn destroy_cq(&self, cq: Cq) {
        // SAFETY: a CQ we created, destroyed once (after its QPs).
        unsafe { (self.f.destroy_cq)(ptr(cq.0)) };
    }

    fn req_notify_cq(&self, cq: Cq) -> Result<()> {
        // SAFETY: a live CQ, whose first field is its context; the op has this signature.
        let rc = unsafe {
            let f: ReqNotifyCq = fn_ptr(Self::op(ptr(cq.0), offsets::CTX_REQ_NOTIFY_CQ));
            f(ptr(cq.0), 0)
        };
        if rc != 0 {
            return Err(rc_err("ibv_req_notify_cq", rc));
        }
        Ok(())
    }

    fn get_cq_event(&self, ch: Channel) -> Result<Cq> {
        let mut cq: *mut c_void = std::ptr::null_mut();
        let mut cq_ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: a live channel whose fd the caller found readable (so this does not block).
        let rc = unsafe { (self.f.get_cq_event)(ptr(ch.0), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return Err(rc_err("ibv_get_cq_event", rc));
        }
        // SAFETY: the CQ the event was for; one event acknowledged.
        unsafe { (self.f.ack_cq_events)(cq, 1) };
        Ok(Cq(cq as u64))
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        let mut raw = [IbvWc::default(); 64];
        let n = out.len().min(raw.len());
        // SAFETY: a live CQ whose first field is its context; `raw` holds `n` entries.
        let got = unsafe {
            let f: PollCq = fn_ptr(Self::op(ptr(cq.0), offsets::CTX_POLL_CQ));
            f(ptr(cq.0), n as c_int, raw.as_mut_ptr())
        };
        if got < 0 {
            return Err(rc_err("ibv_poll_cq", got));
        }
        for (o, r) in out.iter_mut().zip(&raw[..got as usize]) {
            *o = Wc { wr_id: r.wr_id, status: r.status, vendor_err: r.vendor_err, qp_num: r.qp_num };
        }
        Ok(got as usize)
    }

    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<QpCreated> {
        let mut init = IbvQpInitAttr {
            qp_context: std::ptr::null_mut(),
            send_cq: ptr(cq.0),
            recv_cq: ptr(cq.0),
            srq: std::ptr::null_mut(),
            cap: IbvQpCap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a live PD and CQ; `init` is fully initialised (the call writes the caps back).
        let q = unsafe { (self.f.create_qp)(ptr(pd.0), &mut init) };
        if q.is_null() {
            return Err(errno_err(&format!("ibv_create_qp({caps:?})")));
        }
        // SAFETY: a live struct ibv_qp; qp_num at its offset.
        let qpn = unsafe { *((q as *const u8).add(offsets::QP_NUM) as *const u32) };
        let got = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        Ok(QpCreated { qp: Qp(q as u64), qpn, caps: got })
    }

    fn modify_qp(&self, qp: Qp, t: &QpTransition) -> Result<()> {
        let mut a = IbvQpAttr::default();
        match *t {
            QpTransition::Init { port, access } => {
                a.qp_state = QPS_INIT;
                a.port_num = port;
                a.qp_access_flags = access;
                self.modify(qp, &mut a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS)
            }
            QpTransition::Rtr { remote, mtu, port, gid_index, traffic_class, sl, rd_atomic } => {
                a.qp_state = QPS_RTR;
                a.path_mtu = mtu as c_uint;
                a.dest_qp_num = remote.qpn;
                a.rq_psn = remote.psn;
                a.min_rnr_timer = 12;
                a.ah_attr = IbvAhAttr {
                    grh: IbvGlobalRoute {
                        dgid: remote.gid,
                        sgid_index: gid_index,
                        hop_limit: 64,
                        traffic_class,
                        ..Default::default()
                    },
                    dlid: remote.lid,
                    sl,
                    is_global: 1,
                    port_num: port,
                    ..Default::default()
                };
                let m = mask::STATE
                    | mask::AV
                    | mask::PATH_MTU
                    | mask::DEST_QPN
                    | mask::RQ_PSN
                    | mask::MAX_DEST_RD_ATOMIC
                    | mask::MIN_RNR_TIMER;
                // Outstanding RDMA READs the peer may have towards us (from the device's limits).
                a.max_dest_rd_atomic = rd_atomic;
                self.modify(qp, &mut a, m)
            }
            QpTransition::Rts { psn, timeout, retry_cnt, rd_atomic } => {
                a.qp_state = QPS_RTS;
                a.sq_psn = psn;
                a.timeout = timeout;
                a.retry_cnt = retry_cnt;
                a.rnr_retry = 7;
                let m = mask::STATE
                    | mask::TIMEOUT
                    | mask::RETRY_CNT
                    | mask::RNR_RETRY
                    | mask::SQ_PSN
                    | mask::MAX_QP_RD_ATOMIC;
                a.max_rd_atomic = rd_atomic;
                self.modify(qp, &mut a, m)
            }
            QpTransition::Err => {
                a.qp_state = QPS_ERR;
                self.modify(qp, &mut a, mask::STATE)
            }
            QpTransition::Reset => {
                a.qp_state = QPS_RESET;
                self.modify(qp, &mut a, mask::STATE)
            }
        }
    }

    unsafe fn destroy_qp(&self, qp: Qp) {
        // SAFETY: a QP we created, destroyed once.
        unsafe { (self.f.destroy_qp)(ptr(qp.0)) };
    }

    unsafe fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<IbvSge> = Vec::with_capacity(wrs.iter().map(|w| w.sges.len()).sum());
        for w in wrs {
            sges.extend(w.sges.iter().map(|s| IbvSge { addr: s.addr, length: s.length, lkey: s.lkey }));
        }
        let mut list: Vec<IbvSendWr> = Vec::with_capacity(wrs.len());
        let mut at = 0usize;
        for w in wrs {
            list.push(IbvSendWr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                // SAFETY: `at` stays within `sges`, which is not reallocated from here on.
                sg_list: unsafe { sges.as_mut_ptr().add(at) },
                num_sge: w.sges.len() as c_int,
                opcode: match w.op {
                    WrOp::Write => IBV_WR_RDMA_WRITE,
                    WrOp::Read => IBV_WR_RDMA_READ,
                },
                send_flags: if w.signaled { IBV_SEND_SIGNALED } else { 0 }
                    | if w.inline { IBV_SEND_INLINE } else { 0 },
                imm_data: 0,
                remote_addr: w.remote_addr,
                rkey: w.rkey,
                wr_rest: [0; 5],
                remote_srqn: 0,
                tail: [0; 6],
            });
            at += w.sges.len();
        }
        let base = list.as_mut_ptr();
        for i in 0..list.len() - 1 {
            // SAFETY: both indices lie in `list`, which is not reallocated from here on.
            list[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: a live QP whose first field is its context; a chained list of initialised
        // requests whose SGEs the caller guarantees (registered, valid until completion).
        let rc = unsafe {
            let f: PostSend = fn_ptr(Self::op(ptr(qp.0), offsets::CTX_POST_SEND));
            f(ptr(qp.0), base, &mut bad)
        };
        if rc == 0 {
            return Ok(());
        }
        let bad_wr = if bad.is_null() {
            0
        } else {
            // SAFETY: the provider points `bad` at an element of our list.
            (unsafe { bad.offset_from(base) }).clamp(0, list.len() as isize) as usize
        };
        Err(PostError { bad_wr, errno: if rc > 0 { rc } else { libc::EINVAL } })
    }
}

/// A function pointer of type `F` from an address.
///
/// # Safety
/// `p` must be a function whose C signature `F` (an `unsafe extern "C" fn` type) spells.
unsafe fn fn_ptr<F: Copy>(p: *const c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*const c_void>());
    // SAFETY: same size; the caller guarantees `p` is a function of type `F`.
    unsafe { std::mem::transmute_copy(&p) }
}

fn bytemuck_bytes<const N: usize>(b: &[u64; N]) -> &[u8] {
    // SAFETY: a u64 array viewed as its bytes (u8 has no alignment or validity requirements).
    unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), std::mem::size_of_val(b)) }
}

#[cfg(test)]
mod tests;
