//! One engine's RDMA device: its context, protection domain, memory regions (one per
//! registered region), its one completion queue and channel, and the one poller thread that
//! drains that CQ for every link of the engine and sleeps on the channel when idle.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use super::limits::Limits;
use super::link::RdmaLink;
use super::verbs::{access, Channel, Cq, Ctx, Mr, Pd, PortAttr, Verbs, Wc, PORT_ACTIVE};
use crate::error::{Error, Result};
use crate::registry::Access;

/// How long the poller sleeps on the channel before it looks again (it is woken at once by a
/// completion event or by `stop`; this only bounds a missed wake-up).
const IDLE_WAIT: Duration = Duration::from_secs(5);

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
    ctx: Ctx,
    pub(super) pd: Pd,
    ch: Channel,
    ch_fd: RawFd,
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
    links: Mutex<HashMap<u32, Weak<RdmaLink>>>,
    next_link: AtomicU32,
    /// Send-queue slots of the initiator QPs open now (at most `limits.cq_depth`).
    pub(super) sq_slots: AtomicUsize,
    stop: AtomicBool,
    wake: OwnedFd,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Nic {
    /// Opens `device` (empty: the first whose `port` is active), its PD, a completion channel
    /// and the CQ. Err says why RDMA cannot be used here.
    pub(super) fn open(verbs: Arc<dyn Verbs>, o: &crate::options::rdma::RdmaOptions) -> Result<Arc<Nic>> {
        let (device, port, gid_index) = (o.device.as_str(), o.port, o.gid_index);
        let names = verbs.get_device_list()?;
        if names.is_empty() {
            return Err(super::unsupported("no RDMA device is present (ibv_get_device_list found none)"));
        }
        let candidates: Vec<&String> = if device.is_empty() {
            names.iter().collect()
        } else {
            let n = names.iter().filter(|n| *n == device).collect::<Vec<_>>();
            if n.is_empty() {
                return Err(super::unsupported(format!(
                    "hixl.rdma.device={device:?} is not present (devices: {})",
                    names.join(", ")
                )));
            }
            n
        };
        let mut why: Vec<String> = Vec::new();
        for name in candidates {
            let ctx = match verbs.open_device(name) {
                Ok(c) => c,
                Err(e) => {
                    why.push(format!("{name}: {}", e.message));
                    continue;
                }
            };
            match Self::setup(&verbs, name, ctx, port, gid_index) {
                Ok(mut nic) => {
                    let n = Arc::get_mut(&mut nic).expect("just made");
                    (n.traffic_class, n.sl) = (o.traffic_class, o.service_level);
                    return Ok(nic);
                }
                Err(e) => {
                    verbs.close_device(ctx);
                    why.push(format!("{name}: {}", e.message));
                }
            }
        }
        Err(super::unsupported(format!("no usable RDMA device: {}", why.join("; "))))
    }

    fn setup(verbs: &Arc<dyn Verbs>, name: &str, ctx: Ctx, port: u8, gid_index: u8) -> Result<Arc<Nic>> {
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
                verbs.dealloc_pd(pd);
                return Err(e);
            }
        };
        let cq = match verbs.create_cq(ctx, limits.cq_depth, Some(ch)) {
            Ok(cq) => cq,
            Err(e) => {
                verbs.destroy_comp_channel(ch);
                verbs.dealloc_pd(pd);
                return Err(e);
            }
        };
        // SAFETY: eventfd with constant flags returns a new descriptor or -1.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            verbs.destroy_cq(cq);
            verbs.destroy_comp_channel(ch);
            verbs.dealloc_pd(pd);
            return Err(Error::failed(format!("eventfd: {}", std::io::Error::last_os_error())));
        }
        Ok(Arc::new(Nic {
            verbs: verbs.clone(),
            device: name.to_string(),
            ctx,
            pd,
            ch,
            ch_fd,
            cq,
            port,
            gid_index,
            traffic_class: 0,
            sl: 0,
            gid,
            attr,
            limits,
            mrs: RwLock::new(BTreeMap::new()),
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU32::new(1),
            sq_slots: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            // SAFETY: a fresh descriptor we own from here on.
            wake: unsafe { OwnedFd::from_raw_fd(wake) },
            poller: Mutex::new(None),
        }))
    }

    /// Registers `[addr, addr + len)`: remote read always, remote write only for a writable
    /// region (so the NIC refuses what the TCP target refuses), local write (a READ lands in
    /// it) unless the memory is immutable. Returns the rkey.
    pub(super) fn register(&self, addr: u64, len: u64, how: Access) -> Result<u32> {
        let acc = match how {
            Access::ReadWrite => access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_WRITE,
            Access::ReadOnly => access::LOCAL_WRITE | access::REMOTE_READ,
            // Possibly read-only pages: the NIC may not even write them locally.
            Access::Immutable => access::REMOTE_READ,
        };
        // SAFETY: the engine registers only memory it checked is mapped, and deregisters it
        // (this region's `deregister`) before the memory may be freed.
        let (mr, lkey, rkey) = unsafe { self.verbs.reg_mr(self.pd, addr, len, acc) }?;
        self.mrs.write().unwrap().insert((addr, rkey), LocalMr { len, mr, lkey });
        Ok(rkey)
    }

    /// Deregisters the region at `addr` with `rkey` (the NIC waits for operations still using it).
    pub(super) fn deregister(&self, addr: u64, rkey: u32) {
        let m = self.mrs.write().unwrap().remove(&(addr, rkey));
        if let Some(m) = m {
            if let Err(e) = self.verbs.dereg_mr(m.mr) {
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

    /// A link id for wr_ids, and the link registered for completions.
    pub(super) fn add_link(
        self: &Arc<Self>,
        make: impl FnOnce(u32) -> Arc<RdmaLink>,
    ) -> Result<Arc<RdmaLink>> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed) & 0x00FF_FFFF;
        let link = make(id);
        self.links.lock().unwrap().insert(id, Arc::downgrade(&link));
        self.start_poller()?;
        Ok(link)
    }

    /// Destroys a QP; an initiator's gives its send-queue slots back.
    pub(super) fn destroy_qp(&self, qp: super::verbs::Qp, initiator: bool) {
        self.verbs.destroy_qp(qp);
        if initiator {
            self.sq_slots.fetch_sub(self.limits.sq_depth as usize, Ordering::AcqRel);
        }
    }

    pub(super) fn remove_link(&self, id: u32) {
        self.links.lock().unwrap().remove(&id);
    }

    fn start_poller(self: &Arc<Self>) -> Result<()> {
        let mut p = self.poller.lock().unwrap();
        if p.is_some() {
            return Ok(());
        }
        self.verbs.req_notify_cq(self.cq)?;
        let nic = self.clone();
        let h = std::thread::Builder::new()
            .name("hixl-rdma-cq".into())
            .spawn(move || nic.poll_loop())
            .map_err(|e| Error::failed(format!("cannot start the RDMA completion thread: {e}")))?;
        *p = Some(h);
        Ok(())
    }

    /// Whether its port is active now (a port that went down fails sends as local errors).
    pub(super) fn port_active(&self) -> bool {
        self.verbs.query_port(self.ctx, self.port).is_ok_and(|a| a.state == PORT_ACTIVE)
    }

    /// Whether the calling thread is the poller.
    pub(super) fn on_poller(&self) -> bool {
        self.poller.lock().unwrap().as_ref().is_some_and(|h| h.thread().id() == std::thread::current().id())
    }

    /// The poller: drains the CQ while completions come; when it is empty, arms it, looks once
    /// more (a completion between the last poll and the arming raises no event), then sleeps on
    /// the channel's descriptor and the stop descriptor.
    fn poll_loop(self: Arc<Self>) {
        let mut wcs = vec![Wc::default(); 64];
        let mut armed = true;
        while !self.stop.load(Ordering::Acquire) {
            let n = match self.verbs.poll_cq(self.cq, &mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!("RDMA completion queue failed: {e}; closing every RDMA link");
                    self.fail_links(e);
                    return;
                }
            };
            if n > 0 {
                self.dispatch(&wcs[..n]);
                continue;
            }
            if !armed {
                if let Err(e) = self.verbs.req_notify_cq(self.cq) {
                    tracing::error!("ibv_req_notify_cq failed: {e}; closing every RDMA link");
                    self.fail_links(e);
                    return;
                }
                armed = true;
                continue; // poll once more before sleeping
            }
            let mut fds = [
                libc::pollfd { fd: self.ch_fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            // SAFETY: two valid pollfds and a bounded timeout.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, IDLE_WAIT.as_millis() as i32) };
            if r > 0 && fds[0].revents & libc::POLLIN != 0 {
                // Consumes and acknowledges the event; the CQ must be armed again for the next.
                if self.verbs.get_cq_event(self.ch).is_ok() {
                    armed = false;
                }
            }
        }
    }

    fn dispatch(&self, wcs: &[Wc]) {
        let mut by_link: Vec<(u32, Vec<Wc>)> = Vec::new();
        for w in wcs {
            let link = (w.wr_id >> 40) as u32;
            match by_link.iter_mut().find(|(l, _)| *l == link) {
                Some((_, v)) => v.push(*w),
                None => by_link.push((link, vec![*w])),
            }
        }
        for (id, v) in by_link {
            let link = self.links.lock().unwrap().get(&id).and_then(Weak::upgrade);
            match link {
                Some(l) => l.on_completions(&v),
                None => tracing::debug!(link = id, n = v.len(), "completions of a closed RDMA link dropped"),
            }
        }
    }

    fn fail_links(&self, e: Error) {
        let links: Vec<_> = self.links.lock().unwrap().values().filter_map(Weak::upgrade).collect();
        for l in links {
            crate::transport::DataPath::close(&*l, e.clone());
        }
    }

    /// Stops the poller (the engine is going away). The device is released when the last
    /// holder (a link, a target's QPs) lets go of the `Nic`.
    pub(super) fn stop_poller(&self) {
        self.stop.store(true, Ordering::Release);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        let h = self.poller.lock().unwrap().take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Nic {
    /// Every QP is gone by now (links and target QPs hold the `Nic`): release the rest in the
    /// order the verbs require.
    fn drop(&mut self) {
        let mrs = std::mem::take(&mut *self.mrs.write().unwrap());
        for (_, m) in mrs {
            let _ = self.verbs.dereg_mr(m.mr);
        }
        self.verbs.destroy_cq(self.cq);
        self.verbs.destroy_comp_channel(self.ch);
        self.verbs.dealloc_pd(self.pd);
        self.verbs.close_device(self.ctx);
    }
}
