//! The software provider: a model of RC-capable NICs (`soft0`, or as many as
//! [`DEVICES_ENV`] says: `soft0`, `soft1`, ...), each reached by peers in other processes of
//! this host over an abstract Unix socket named after its own GID. It exists
//! so that the `rdma` backend's whole logic runs, and is tested, where no RDMA device exists.
//!
//! What it models (docs/RDMA.md lists the same): the RC queue-pair state machine (RESET, INIT,
//! RTR, RTS, ERR; invalid transitions and posts in the wrong state fail with EINVAL), send-queue
//! depth (ENOMEM with `bad_wr`) counting unsignaled requests until a later signaled one
//! completes, the SGE limit, asynchronous completion in posting order, completions generated
//! for signaled requests and for every error, one event per `req_notify_cq` on the completion
//! channel, CQ overrun, local checks (lkey, bounds, LOCAL_WRITE: LOC_PROT_ERR; message size:
//! LOC_LEN_ERR), checks at the responder with no help from the target process's application
//! (rkey, bounds, the region's and the QP's remote access: REM_ACCESS_ERR / REM_INV_REQ_ERR,
//! after which both QPs are in ERR), PSN and QP-address checks when a connection starts, a
//! peer that stops answering (RETRY_EXC_ERR after the QP's timeout and retry count), and on
//! any error the flush of every outstanding request (WR_FLUSH_ERR). `dereg_mr` waits for the
//! operations using the region. The responder's bytes go straight between the socket and the
//! registered memory (readv / sendmsg), never through a buffer.
//!
//! Inline WRITEs (up to a QP's `max_inline_data`, at most 256 bytes): their bytes are copied
//! at post time, with no lkey check.
//!
//! READ depth: up to `max_rd_atomic` READs outstanding per QP, and a responder QP sent more
//! than its `max_dest_rd_atomic` refuses them (REM_INV_REQ_ERR) and goes to ERR.
//!
//! What it does not model: the wire (it copies through the kernel, one WRITE or up to
//! `max_rd_atomic` READs at a time per QP), a NIC that answers while its process is stopped (this one is a thread of the target
//! process), memory pinning, atomics, sends and receives A test can make the NIC go silent (`fault`:
//! [`FAULT_ENV`]), as a NIC whose link went down.

mod attrs;
mod dmabuf;
mod fault;
mod qp;
mod responder;

pub use attrs::{DEVICE, DEVICES_ENV, MAX_MSG};
pub use fault::FAULT_ENV;
pub use responder::{FAIL_AFTER_ENV, LATENCY_ENV};

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::{
    access, Channel, Cq, Ctx, DeviceAttr, Mr, Pd, PortAttr, PostError, Qp, QpCaps, QpCreated, QpTransition,
    SendWr, Verbs, Wc, PORT_ACTIVE,
};
use crate::error::{Error, Result};
use crate::sys::eventfd;
use attrs::{device_attr, device_names};
use qp::SoftQp;

/// `IBV_MTU_4096`.
const MTU_4096: u8 = 5;
/// Most inline bytes a QP may ask for (`max_inline_data`; rdma_rxe allows about this much).
const MAX_INLINE: u32 = 256;

/// The abstract socket a device with `gid` listens on.
fn socket_name(gid: &[u8; 16]) -> String {
    format!("hixl-softrdma-{}", gid.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// A registered memory region.
struct SoftMr {
    addr: u64,
    len: u64,
    /// Where byte `addr` lies in this process: `addr` itself for `reg_mr`, the mapping of the
    /// file for `reg_dmabuf_mr` (whose `addr` is the iova).
    host: u64,
    /// That mapping, unmapped when the region is gone.
    _map: Option<dmabuf::Mapping>,
    access: u32,
    key: u32,
    pd: u64,
    /// Held (read) by every operation moving bytes of this region; `dereg_mr` takes it to write.
    busy: RwLock<bool>,
}

impl SoftMr {
    /// Whether `[addr, addr + len)` lies inside the region.
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.addr + self.len)
    }

    /// The address in this process of `addr`, which the region covers.
    fn host_of(&self, addr: u64) -> u64 {
        self.host + (addr - self.addr)
    }
}

/// One soft NIC: its GID, its memory regions by key, its QPs by number, and the socket peers'
/// requests arrive on.
struct Device {
    name: String,
    gid: [u8; 16],
    /// Requests its responder served, and after how many it goes dark ([`FAIL_AFTER_ENV`]).
    served: std::sync::atomic::AtomicU64,
    fail_after: Option<responder::FailAfter>,
    /// When it went dark.
    dark_since: std::sync::OnceLock<std::time::Instant>,
    mrs: RwLock<HashMap<u32, Arc<SoftMr>>>,
    qps: Mutex<HashMap<u32, Arc<SoftQp>>>,
    next_key: AtomicU32,
    next_qpn: AtomicU32,
    listener: std::os::unix::net::UnixListener,
    stopping: AtomicBool,
    /// Responder connections, shut down when the device closes.
    conns: Mutex<Vec<Arc<UnixStream>>>,
    /// Connections that have not sent their Hello yet.
    hello_pending: std::sync::atomic::AtomicUsize,
    /// A refused connection was logged already.
    refused_logged: AtomicBool,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Device {
    fn open(dev_name: &str) -> Result<Arc<Device>> {
        use std::os::linux::net::SocketAddrExt;
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        crate::auth::random_bytes(&mut gid[8..])?;
        let name = socket_name(&gid);
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::failed(format!("soft RDMA socket {name}: {e}")))?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)
            .map_err(|e| Error::failed(format!("soft RDMA device cannot listen on {name}: {e}")))?;
        let mut seed = [0u8; 4];
        crate::auth::random_bytes(&mut seed)?;
        let dev = Arc::new(Device {
            name: dev_name.to_string(),
            gid,
            served: std::sync::atomic::AtomicU64::new(0),
            fail_after: responder::fail_after(dev_name)?,
            dark_since: std::sync::OnceLock::new(),
            mrs: RwLock::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            // Keys are an index and a random byte, like a NIC's; QPNs start at a random point.
            next_key: AtomicU32::new(1 + (seed[0] as u32)),
            next_qpn: AtomicU32::new(0x100 + (u16::from_le_bytes([seed[1], seed[2]]) as u32)),
            listener,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            hello_pending: std::sync::atomic::AtomicUsize::new(0),
            refused_logged: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let d = dev.clone();
        let h = crate::place::spawn("hixl-softnic".into(), move || responder::listen(&d))
            .map_err(|e| Error::failed(format!("cannot start the soft NIC thread: {e}")))?;
        dev.threads.lock().unwrap().push(h);
        Ok(dev)
    }

    fn listener(&self) -> &std::os::unix::net::UnixListener {
        &self.listener
    }

    fn mr(&self, key: u32) -> Option<Arc<SoftMr>> {
        self.mrs.read().unwrap().get(&key).cloned()
    }

    fn close(&self) {
        self.stopping.store(true, Ordering::Release);
        crate::transport::io::shutdown(self.listener.as_raw_fd());
        for c in std::mem::take(&mut *self.conns.lock().unwrap()) {
            crate::transport::io::shutdown(c.as_raw_fd());
        }
        let qps: Vec<_> = self.qps.lock().unwrap().drain().map(|(_, q)| q).collect();
        for q in qps {
            q.destroy();
        }
        for h in std::mem::take(&mut *self.threads.lock().unwrap()) {
            let _ = h.join();
        }
    }
}

/// A completion channel: an eventfd readable while events wait, and the CQs they are for.
struct SoftChannel {
    efd: OwnedFd,
    events: Mutex<std::collections::VecDeque<u64>>,
}

impl SoftChannel {
    fn new() -> Result<SoftChannel> {
        let efd = eventfd::create().map_err(|e| Error::failed(format!("eventfd: {e}")))?;
        Ok(SoftChannel { efd, events: Mutex::new(Default::default()) })
    }

    fn notify(&self, cq: u64) {
        let mut ev = self.events.lock().unwrap();
        ev.push_back(cq);
        eventfd::add(&self.efd, 1);
    }

    fn take(&self) -> Option<u64> {
        let mut ev = self.events.lock().unwrap();
        let cq = ev.pop_front();
        if ev.is_empty() {
            // Resets the counter (0 when it was 0 already).
            eventfd::take(&self.efd);
        }
        cq
    }
}

/// A completion queue.
struct SoftCq {
    handle: u64,
    entries: Mutex<(std::collections::VecDeque<Wc>, bool)>,
    cap: usize,
    channel: Option<Arc<SoftChannel>>,
    armed: AtomicBool,
}

impl SoftCq {
    /// Adds a completion; more than the CQ holds is an overrun (the CQ is then unusable, as on a
    /// NIC, where it raises IBV_EVENT_CQ_ERR).
    fn push(&self, wc: Wc) {
        {
            let mut e = self.entries.lock().unwrap();
            if e.1 {
                return;
            }
            if e.0.len() >= self.cap {
                e.1 = true;
            } else {
                e.0.push_back(wc);
            }
        }
        if self.armed.swap(false, Ordering::AcqRel) {
            if let Some(ch) = &self.channel {
                ch.notify(self.handle);
            }
        }
    }
}

#[derive(Default)]
struct Objects {
    next: u64,
    /// The open devices by context handle (a device's index + 1).
    devs: HashMap<u64, Arc<Device>>,
    /// The devices' limits, read once when the first was opened (see [`attrs::LIMITS_ENV`]).
    attr: DeviceAttr,
    /// Protection domains, and the context each belongs to.
    pds: HashMap<u64, u64>,
    /// Memory regions, and the context each is on.
    mrs: HashMap<u64, (u64, Arc<SoftMr>)>,
    chans: HashMap<u64, Arc<SoftChannel>>,
    cqs: HashMap<u64, Arc<SoftCq>>,
    qps: HashMap<u64, Arc<SoftQp>>,
}

impl Objects {
    fn handle(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

/// The software provider (`soft0`, or the devices [`DEVICES_ENV`] asks for).
#[derive(Default)]
pub struct SoftVerbs {
    objs: Mutex<Objects>,
}

fn no(what: &str, h: u64) -> Error {
    Error::param(format!("soft verbs: no {what} with handle {h}"))
}

impl SoftVerbs {
    /// A provider with no device open yet.
    pub fn new() -> SoftVerbs {
        SoftVerbs::default()
    }

    fn device(&self, ctx: u64) -> Result<Arc<Device>> {
        self.objs.lock().unwrap().devs.get(&ctx).cloned().ok_or_else(|| no("open device", ctx))
    }

    fn qp(&self, qp: Qp) -> Result<Arc<SoftQp>> {
        self.objs.lock().unwrap().qps.get(&qp.0).cloned().ok_or_else(|| no("QP", qp.0))
    }

    /// Registers `[addr, addr + len)` (served from `map` when given, else from `addr` itself).
    fn add_mr(
        &self,
        pd: Pd,
        addr: u64,
        len: u64,
        acc: u32,
        map: Option<dmabuf::Mapping>,
    ) -> Result<(Mr, u32, u32)> {
        let ctx = self.objs.lock().unwrap().pds.get(&pd.0).copied().ok_or_else(|| no("PD", pd.0))?;
        let dev = self.device(ctx)?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::param(format!("soft verbs: cannot register 0x{addr:x}+{len}")));
        }
        if acc & access::REMOTE_WRITE != 0 && acc & access::LOCAL_WRITE == 0 {
            // As ibv_reg_mr: remote write needs local write (EINVAL).
            return Err(Error::param("soft verbs: REMOTE_WRITE without LOCAL_WRITE (EINVAL)"));
        }
        let mut o = self.objs.lock().unwrap();
        let idx = dev.next_key.fetch_add(1, Ordering::Relaxed);
        let mut salt = [0u8; 1];
        crate::auth::random_bytes(&mut salt)?;
        let key = (idx << 8) | salt[0] as u32;
        let host = map.as_ref().map_or(addr, |m| m.at());
        let mr = Arc::new(SoftMr {
            addr,
            len,
            host,
            _map: map,
            access: acc,
            key,
            pd: pd.0,
            busy: RwLock::new(true),
        });
        dev.mrs.write().unwrap().insert(key, mr.clone());
        let h = o.handle();
        o.mrs.insert(h, (ctx, mr));
        Ok((Mr(h), key, key))
    }
}

impl Verbs for SoftVerbs {
    fn provider(&self) -> &'static str {
        "soft"
    }

    fn get_device_list(&self) -> Result<Vec<String>> {
        device_names()
    }

    fn open_device(&self, name: &str) -> Result<Ctx> {
        let names = device_names()?;
        let Some(i) = names.iter().position(|n| n == name) else {
            return Err(Error::param(format!(
                "soft verbs: no device {name:?} (it has {})",
                names.join(", ")
            )));
        };
        let ctx = i as u64 + 1;
        let mut o = self.objs.lock().unwrap();
        if !o.devs.contains_key(&ctx) {
            if o.devs.is_empty() {
                o.attr = device_attr()?;
            }
            let d = Device::open(name)?;
            o.devs.insert(ctx, d);
        }
        Ok(Ctx(ctx))
    }

    unsafe fn close_device(&self, ctx: Ctx) {
        let dev = self.objs.lock().unwrap().devs.remove(&ctx.0);
        if let Some(d) = dev {
            d.close();
        }
    }

    fn query_device(&self, ctx: Ctx) -> Result<DeviceAttr> {
        self.device(ctx.0)?;
        Ok(self.objs.lock().unwrap().attr)
    }

    fn query_port(&self, _ctx: Ctx, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(Error::param(format!("soft verbs: {DEVICE} has port 1 only, not {port}")));
        }
        Ok(PortAttr {
            state: PORT_ACTIVE,
            active_mtu: MTU_4096,
            max_msg_sz: MAX_MSG,
            lid: 0,
            link_layer: 2,
            gid_tbl_len: 1,
        })
    }

    fn query_gid(&self, ctx: Ctx, port: u8, index: u8) -> Result<[u8; 16]> {
        if port != 1 || index != 0 {
            return Err(Error::param(format!(
                "soft verbs: {DEVICE} has GID index 0 on port 1 only, not {index} on port {port}"
            )));
        }
        Ok(self.device(ctx.0)?.gid)
    }

    fn alloc_pd(&self, ctx: Ctx) -> Result<Pd> {
        self.device(ctx.0)?;
        let mut o = self.objs.lock().unwrap();
        let h = o.handle();
        o.pds.insert(h, ctx.0);
        Ok(Pd(h))
    }

    unsafe fn dealloc_pd(&self, pd: Pd) {
        self.objs.lock().unwrap().pds.remove(&pd.0);
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, acc: u32) -> Result<(Mr, u32, u32)> {
        self.add_mr(pd, addr, len, acc, None)
    }

    /// The soft NIC's stand-in for a dma-buf: it maps `offset + len` bytes of the file `fd`
    /// (a memfd in tests) and serves `[iova, iova + len)` from the mapping, so the dma-buf
    /// registration path runs without a GPU. It is not GPU testing: a GPU's dma-buf cannot be
    /// mapped this way.
    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: RawFd,
        acc: u32,
    ) -> Result<(Mr, u32, u32)> {
        let map = dmabuf::Mapping::new(fd, offset, len, acc)?;
        self.add_mr(pd, iova, len, acc, Some(map))
    }

    fn gpu_dmabuf(&self) -> std::result::Result<(), String> {
        Err("the soft provider's reg_dmabuf_mr cannot reach GPU memory (it maps the file into this \
             process: a stand-in for tests)"
            .into())
    }

    unsafe fn dereg_mr(&self, mr: Mr) -> Result<()> {
        let (ctx, m) = self.objs.lock().unwrap().mrs.remove(&mr.0).ok_or_else(|| no("MR", mr.0))?;
        if let Ok(dev) = self.device(ctx) {
            dev.mrs.write().unwrap().remove(&m.key);
        }
        // Waits for every operation that still moves bytes of the region.
        *m.busy.write().unwrap() = false;
        Ok(())
    }

    fn create_comp_channel(&self, _ctx: Ctx) -> Result<(Channel, RawFd)> {
        let ch = Arc::new(SoftChannel::new()?);
        let fd = ch.efd.as_raw_fd();
        let mut o = self.objs.lock().unwrap();
        let h = o.handle();
        o.chans.insert(h, ch);
        Ok((Channel(h), fd))
    }

    unsafe fn destroy_comp_channel(&self, ch: Channel) {
        self.objs.lock().unwrap().chans.remove(&ch.0);
    }

    fn create_cq(&self, _ctx: Ctx, cqe: u32, ch: Option<Channel>) -> Result<Cq> {
        let max = self.objs.lock().unwrap().attr.max_cqe;
        if cqe == 0 || cqe > max.max(0) as u32 {
            // As a real device answers: EINVAL (rdma_rxe above its max_cqe).
            return Err(Error::failed(format!(
                "ibv_create_cq({cqe}) failed: Invalid argument (soft verbs: max_cqe is {max})"
            )));
        }
        let mut o = self.objs.lock().unwrap();
        let channel = match ch {
            Some(c) => Some(o.chans.get(&c.0).cloned().ok_or_else(|| no("completion channel", c.0))?),
            None => None,
        };
        let h = o.handle();
        let cq = SoftCq {
            handle: h,
            entries: Mutex::new((Default::default(), false)),
            cap: cqe.max(1) as usize,
            channel,
            armed: AtomicBool::new(false),
        };
        o.cqs.insert(h, Arc::new(cq));
        Ok(Cq(h))
    }

    unsafe fn destroy_cq(&self, cq: Cq) {
        self.objs.lock().unwrap().cqs.remove(&cq.0);
    }

    fn req_notify_cq(&self, cq: Cq) -> Result<()> {
        let c = self.objs.lock().unwrap().cqs.get(&cq.0).cloned().ok_or_else(|| no("CQ", cq.0))?;
        c.armed.store(true, Ordering::Release);
        Ok(())
    }

    fn get_cq_event(&self, ch: Channel) -> Result<Cq> {
        let c = self.objs.lock().unwrap().chans.get(&ch.0).cloned().ok_or_else(|| no("channel", ch.0))?;
        c.take().map(Cq).ok_or_else(|| Error::failed("soft verbs: no CQ event is due (EAGAIN)"))
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        let c = self.objs.lock().unwrap().cqs.get(&cq.0).cloned().ok_or_else(|| no("CQ", cq.0))?;
        let mut e = c.entries.lock().unwrap();
        if e.1 {
            return Err(Error::failed(format!("soft verbs: CQ overrun (more than {} completions)", c.cap)));
        }
        let n = out.len().min(e.0.len());
        for (slot, wc) in out.iter_mut().zip(e.0.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<QpCreated> {
        let ctx = self.objs.lock().unwrap().pds.get(&pd.0).copied().ok_or_else(|| no("PD", pd.0))?;
        let dev = self.device(ctx)?;
        let d = self.objs.lock().unwrap().attr;
        if caps.max_send_wr == 0
            || caps.max_send_wr > d.max_qp_wr.max(0) as u32
            || caps.max_send_sge > d.max_sge.max(0) as u32
            || caps.max_inline_data > MAX_INLINE
        {
            return Err(Error::param(format!(
                "soft verbs: QP capabilities {caps:?} exceed the device's ({} WRs, {} SGEs, {MAX_INLINE} \
                 inline bytes)",
                d.max_qp_wr, d.max_sge
            )));
        }
        let mut o = self.objs.lock().unwrap();
        let cq = o.cqs.get(&cq.0).cloned().ok_or_else(|| no("CQ", cq.0))?;
        let qpn = dev.next_qpn.fetch_add(1, Ordering::Relaxed) & crate::wire::rdma::MAX_QPN;
        let caps = QpCaps { max_send_sge: caps.max_send_sge.max(1), ..caps };
        let rd = |v: i32| v.clamp(1, u8::MAX as i32) as u8;
        let rd_max = (rd(d.max_qp_init_rd_atom), rd(d.max_qp_rd_atom));
        let q = SoftQp::new(qpn, pd.0, dev.clone(), cq, caps, rd_max)?;
        dev.qps.lock().unwrap().insert(qpn, q.clone());
        let h = o.handle();
        o.qps.insert(h, q);
        Ok(QpCreated { qp: Qp(h), qpn, caps })
    }

    fn modify_qp(&self, qp: Qp, t: &QpTransition) -> Result<()> {
        self.qp(qp)?.modify(t)
    }

    unsafe fn destroy_qp(&self, qp: Qp) {
        let q = self.objs.lock().unwrap().qps.remove(&qp.0);
        if let Some(q) = q {
            q.dev.qps.lock().unwrap().remove(&q.qpn);
            q.destroy();
        }
    }

    unsafe fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let q = self.qp(qp).map_err(|_| PostError { bad_wr: 0, errno: libc::EINVAL })?;
        // SAFETY: this function's contract is the one `post` needs.
        unsafe { q.post(wrs) }
    }
}

impl Drop for SoftVerbs {
    fn drop(&mut self) {
        let devs = std::mem::take(&mut self.objs.get_mut().unwrap().devs);
        for d in devs.into_values() {
            d.close();
        }
    }
}

#[cfg(test)]
mod tests;
