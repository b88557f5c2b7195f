//! An engine's rails: the devices `hixl.rdma.device` names (one, a list, or `all`), each a
//! [`Nic`], a region registered on every one of them (one rkey per rail), and the engine's one
//! poller thread, which drains every rail's CQ for every link and sleeps on all their
//! completion channels at once when idle.

use std::cell::Cell;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError, Weak};
use std::time::{Duration, Instant};

use super::nic::Nic;
use super::verbs::{Context, Verbs, Wc};
use crate::error::{Error, Result};
use crate::options::rdma::{Devices, RdmaOptions, MAX_RAILS};
use crate::sys::eventfd;
use crate::transport::backend::MemorySpan;

/// How long the poller sleeps on the channels before it looks again (it is woken at once by a
/// completion event or by `stop`; this only bounds a missed wake-up).
const IDLE_WAIT: Duration = Duration::from_secs(5);

thread_local! {
    /// Set while this thread hands completions to links (the poller, or a thread waiting for
    /// its own request).
    static DISPATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as handing out completions while it lives (cleared on unwind too).
struct Dispatching;

impl Dispatching {
    fn enter() -> Dispatching {
        DISPATCHING.with(|d| d.set(true));
        Dispatching
    }
}

impl Drop for Dispatching {
    fn drop(&mut self) {
        DISPATCHING.with(|d| d.set(false));
    }
}

/// What the poller hands a link's completions to (the RDMA link, which registers itself with
/// `add_link`), and how it fails the link when a device fails.
pub(super) trait CompletionSink: Send + Sync {
    /// Work completions of this link's work requests on rail `rail`, in the device's order.
    fn on_completions(self: Arc<Self>, rail: usize, wcs: &[Wc]);
    /// The rails failed with `e`: the link closes.
    fn fail(&self, e: Error);
}

/// The engine's devices and its poller.
pub(super) struct Rails {
    pub(super) nics: Vec<Arc<Nic>>,
    links: Mutex<HashMap<u32, Weak<dyn CompletionSink>>>,
    next_link: AtomicU32,
    /// Held while a CQ is polled (or armed) and its completions handed to links, so that they
    /// reach each link in the order the device gave them, whichever thread polls.
    drain: Mutex<()>,
    stop: AtomicBool,
    wake: OwnedFd,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Opens `name` and sets it up as rail `rail`; Err says why it cannot be one (the device is
/// closed again then).
fn open_one(verbs: &Arc<dyn Verbs>, name: &str, o: &RdmaOptions, rail: u8) -> Result<Arc<Nic>> {
    Nic::setup(Context::open(verbs, name)?, name, o, rail)
}

impl Rails {
    /// Opens the devices `o.device` names. Err says why RDMA cannot be used here: no device, a
    /// named one absent or unusable (naming it and the option's value), none usable for `all`.
    pub(super) fn open(verbs: Arc<dyn Verbs>, o: &RdmaOptions) -> Result<Arc<Rails>> {
        let names = verbs.get_device_list()?;
        if names.is_empty() {
            return Err(super::unsupported("no RDMA device is present (ibv_get_device_list found none)"));
        }
        let mut nics: Vec<Arc<Nic>> = Vec::new();
        let mut why: Vec<String> = Vec::new();
        match &o.device {
            Devices::First | Devices::All => {
                for name in &names {
                    if nics.len() == MAX_RAILS || (o.device == Devices::First && !nics.is_empty()) {
                        break;
                    }
                    match open_one(&verbs, name, o, nics.len() as u8) {
                        Ok(n) => nics.push(n),
                        Err(e) => why.push(format!("{name}: {}", e.message)),
                    }
                }
                if nics.is_empty() {
                    return Err(super::unsupported(format!("no usable RDMA device: {}", why.join("; "))));
                }
            }
            Devices::Named(wanted) => {
                let value = wanted.join(",");
                for name in wanted {
                    if !names.contains(name) {
                        return Err(super::unsupported(format!(
                            "hixl.rdma.device={value:?}: device {name:?} is not present (devices: {})",
                            names.join(", ")
                        )));
                    }
                    match open_one(&verbs, name, o, nics.len() as u8) {
                        Ok(n) => nics.push(n),
                        Err(e) => {
                            return Err(super::unsupported(format!(
                                "hixl.rdma.device={value:?}: device {name:?} is not usable: {}",
                                e.message
                            )))
                        }
                    }
                }
            }
        }
        let wake = eventfd::create().map_err(|e| Error::failed(format!("eventfd: {e}")))?;
        Ok(Arc::new(Rails {
            nics,
            links: Mutex::new(HashMap::new()),
            next_link: AtomicU32::new(1),
            drain: Mutex::new(()),
            stop: AtomicBool::new(false),
            wake,
            poller: Mutex::new(None),
        }))
    }

    /// Registers the span `mem` on every rail; returns the rkeys in rail order. If one
    /// rail refuses, those made are released and its error is returned.
    pub(super) fn register(&self, mem: &MemorySpan) -> Result<Vec<u32>> {
        self.register_with(mem.addr(), |nic| nic.register(mem))
    }

    /// As [`Rails::register`], with `reg` making each rail's region at `addr` (from a GPU's
    /// dma-buf, say); if one rail refuses, those made are released.
    pub(super) fn register_with(&self, addr: u64, reg: impl Fn(&Nic) -> Result<u32>) -> Result<Vec<u32>> {
        let mut rkeys = Vec::with_capacity(self.nics.len());
        for nic in &self.nics {
            match reg(nic) {
                Ok(k) => rkeys.push(k),
                Err(e) => {
                    self.deregister(addr, &rkeys);
                    let e = if self.nics.len() > 1 {
                        Error::new(e.status, format!("{}: {}", nic.device, e.message))
                    } else {
                        e
                    };
                    return Err(e);
                }
            }
        }
        Ok(rkeys)
    }

    /// Deregisters the region at `addr` on each rail with its rkey.
    pub(super) fn deregister(&self, addr: u64, rkeys: &[u32]) {
        for (nic, k) in self.nics.iter().zip(rkeys) {
            nic.deregister(addr, *k);
        }
    }

    /// A link id for wr_ids, and the link registered for completions.
    pub(super) fn add_link<L: CompletionSink + 'static>(
        self: &Arc<Self>,
        make: impl FnOnce(u32) -> Arc<L>,
    ) -> Result<Arc<L>> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed) & 0x00FF_FFFF;
        let link = make(id);
        let sink: Arc<dyn CompletionSink> = link.clone();
        self.links.lock().unwrap().insert(id, Arc::downgrade(&sink));
        self.start_poller()?;
        Ok(link)
    }

    pub(super) fn remove_link(&self, id: u32) {
        self.links.lock().unwrap().remove(&id);
    }

    fn start_poller(self: &Arc<Self>) -> Result<()> {
        let mut p = self.poller.lock().unwrap();
        if p.is_some() {
            return Ok(());
        }
        for nic in &self.nics {
            nic.cq.req_notify()?;
        }
        let rails = self.clone();
        let h = crate::place::spawn("hixl-rdma-cq".into(), move || rails.poll_loop())
            .map_err(|e| Error::failed(format!("cannot start the RDMA completion thread: {e}")))?;
        *p = Some(h);
        Ok(())
    }

    /// Whether the calling thread is the poller, or hands out completions now (then what it
    /// waits for may need the very CQ it drains: it must not wait for flushed completions).
    pub(super) fn on_poller(&self) -> bool {
        DISPATCHING.with(Cell::get)
            || self
                .poller
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|h| h.thread().id() == std::thread::current().id())
    }

    /// The drain lock; None when `wait` is false and another thread holds it. A panic while
    /// handing out completions (on a user's thread) poisons it; the CQs are as consistent as
    /// after any dispatch, so polling goes on.
    fn drain_lock(&self, wait: bool) -> Option<MutexGuard<'_, ()>> {
        if wait {
            return Some(self.drain.lock().unwrap_or_else(PoisonError::into_inner));
        }
        match self.drain.try_lock() {
            Ok(g) => Some(g),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Polls rail `r`'s CQ once and hands what it returns to the links: the count (0 also when
    /// `wait` is false and another thread drains), or the CQ's error.
    fn drain_once(&self, r: usize, wcs: &mut [Wc], wait: bool) -> Result<usize> {
        let Some(_g) = self.drain_lock(wait) else { return Ok(0) };
        let nic = &self.nics[r];
        let n = nic.cq.poll(wcs)?;
        if n > 0 {
            let _d = Dispatching::enter();
            self.dispatch(r, &wcs[..n]);
        }
        Ok(n)
    }

    /// A thread waiting for `ended` polls every rail's CQ itself until it holds, `until`
    /// passes or a CQ fails (the poller then reports it): the request completes on this
    /// thread, which need not be woken for it. (An armed CQ still raises an event for the
    /// poller, which then finds nothing: that wake-up is off the waiter's path.)
    pub(super) fn poll_until(&self, ended: &dyn Fn() -> bool, until: Instant) {
        let mut wcs = [Wc::default(); 16];
        let mut idle = 0u32;
        while !ended() && !self.stop.load(Ordering::Acquire) && Instant::now() < until {
            let mut got = 0;
            for r in 0..self.nics.len() {
                match self.drain_once(r, &mut wcs, false) {
                    Ok(n) => got += n,
                    Err(_) => return,
                }
            }
            if got > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle % 64 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The poller: drains every CQ while completions come; when all are empty, arms those not
    /// armed, looks once more (a completion between the last poll and the arming raises no
    /// event), then sleeps on every rail's channel descriptor and the stop descriptor.
    fn poll_loop(self: Arc<Self>) {
        let mut wcs = vec![Wc::default(); 64];
        let mut armed = vec![true; self.nics.len()];
        while !self.stop.load(Ordering::Acquire) {
            let mut busy = false;
            for (r, nic) in self.nics.iter().enumerate() {
                match self.drain_once(r, &mut wcs, true) {
                    Ok(0) => {}
                    Ok(_) => busy = true,
                    Err(e) => {
                        tracing::error!(device = %nic.device, "RDMA completion queue failed: {e}; closing every RDMA link");
                        self.fail_links(e);
                        return;
                    }
                }
            }
            if busy {
                continue;
            }
            let mut rearmed = false;
            for (r, nic) in self.nics.iter().enumerate() {
                if armed[r] {
                    continue;
                }
                // Armed under the drain lock: never while a waiter is inside ibv_poll_cq
                // (providers read the CQ's consumer index to arm it).
                let arming = {
                    let _g = self.drain_lock(true);
                    nic.cq.req_notify()
                };
                if let Err(e) = arming {
                    tracing::error!(device = %nic.device, "ibv_req_notify_cq failed: {e}; closing every RDMA link");
                    self.fail_links(e);
                    return;
                }
                armed[r] = true;
                rearmed = true;
            }
            if rearmed {
                continue; // poll once more before sleeping
            }
            let mut fds: Vec<libc::pollfd> = self
                .nics
                .iter()
                .map(|n| libc::pollfd { fd: n.channel.fd(), events: libc::POLLIN, revents: 0 })
                .collect();
            fds.push(libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            if !matches!(crate::sys::poll(&mut fds, IDLE_WAIT.as_millis() as i32), Ok(1..)) {
                continue;
            }
            for (i, nic) in self.nics.iter().enumerate() {
                // Consumes and acknowledges the event; the CQ must be armed again for the next.
                if fds[i].revents & libc::POLLIN != 0 && nic.channel.get_cq_event().is_ok() {
                    armed[i] = false;
                }
            }
        }
    }

    fn dispatch(&self, rail: usize, wcs: &[Wc]) {
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
                Some(l) => l.on_completions(rail, &v),
                None => tracing::debug!(link = id, n = v.len(), "completions of a closed RDMA link dropped"),
            }
        }
    }

    fn fail_links(&self, e: Error) {
        let links: Vec<_> = self.links.lock().unwrap().values().filter_map(Weak::upgrade).collect();
        for l in links {
            l.fail(e.clone());
        }
    }

    /// Stops the poller (the engine is going away). The devices are released when the last
    /// holder (a link, a target's QPs) lets go of them.
    pub(super) fn stop_poller(&self) {
        self.stop.store(true, Ordering::Release);
        eventfd::add(&self.wake, 1);
        let h = self.poller.lock().unwrap().take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}
