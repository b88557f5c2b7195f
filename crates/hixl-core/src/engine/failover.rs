//! Failover: when a peer's data path dies by itself while its control channel lives (the
//! `rdma` path: the peer's NIC stopped answering and a QP's retries ran out, or a failed QP
//! could not be replaced), the next backend of the negotiated `hixl.backends` order that the
//! peer offers (`tcp` in practice, over new streams next to the live control channel) takes
//! over: the dead path's parts that had not all landed are re-issued there (RDMA READ and
//! WRITE are idempotent: bytes that did land are moved again, unchanged), and later requests
//! go there too. A notification after the data still goes only when every part of its request
//! has ended well, wherever it ran (the completer counts parts per request, not per path).
//!
//! Bounded: one failover per link (the path that took over has no rescuer: if it dies, the
//! link dies, as without failover), within the connect timeout; if no next backend opens,
//! every waiting part fails and the link closes with an error naming both causes. The link
//! stays on the backend it moved to until it is reconnected; a new `connect` chooses afresh
//! (docs/RELIABILITY.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use crate::complete::Completer;
use crate::error::{Error, Result};
use crate::options::Options;
use crate::queue::{Part, Request};
use crate::registry::{new_holder_id, Abort};
use crate::stats::PeerStats;
use crate::transport::backend::{Backend, OpenCtx};
use crate::transport::control::channel::ControlChannel;
use crate::transport::staging::Stager;
use crate::transport::streams::ConnectParams;
use crate::transport::{DataPath, Rescue};
use crate::wire::Domain;

/// What the next backend is opened with.
pub(super) struct Opener {
    /// The backends of `hixl.backends` after the chosen one, in order.
    pub(super) next: Vec<Arc<dyn Backend>>,
    pub(super) opts: Options,
    pub(super) addr: std::net::SocketAddr,
    pub(super) params: ConnectParams,
    pub(super) host: String,
    /// Bound of the whole failover (the connect's timeout).
    pub(super) timeout: Duration,
    /// The engine's stager (see `OpenCtx::stager`).
    pub(super) stager: Arc<Stager>,
}

/// A data path that opened, and the domain pairs it serves.
type Opened = (Arc<dyn DataPath>, &'static [(Domain, Domain)]);

impl Opener {
    /// What a backend's `connect` is given.
    pub(super) fn ctx(&self) -> OpenCtx<'_> {
        OpenCtx {
            opts: &self.opts,
            addr: self.addr,
            params: &self.params,
            host: &self.host,
            timeout: self.timeout,
            stager: &self.stager,
        }
    }

    /// Opens the first backend of `next` that the peer offers for host memory and that opens;
    /// Err says why each could not.
    fn open(&self, control: &Arc<dyn ControlChannel>) -> std::result::Result<Opened, String> {
        let ctx = self.ctx();
        let mut why: Vec<String> = Vec::new();
        for b in &self.next {
            let res = match control.handshake().offer(b.name()) {
                None => Err("the peer does not offer it".to_string()),
                Some(o) if !o.domains.contains(&(Domain::Host, Domain::Host)) => {
                    Err("the peer offers it for other memory domains only".to_string())
                }
                Some(o) => b.connect(&ctx, control, o),
            };
            match res {
                Ok(p) => return Ok((p, b.domains())),
                Err(e) => why.push(format!("{}: {e}", b.name())),
            }
        }
        if why.is_empty() {
            why.push("hixl.backends names no backend after it".into());
        }
        Err(why.join("; "))
    }
}

enum State {
    /// Carried by `path`.
    Up { path: Arc<dyn DataPath>, domains: &'static [(Domain, Domain)] },
    /// `from` died with `why`; the next backend is being opened; `waiting` goes to it then.
    Moving { from: Arc<dyn DataPath>, waiting: Vec<Vec<Part>> },
    /// `from` died and no backend took over (or the link was closed): everything fails with `err`.
    Down { from: Arc<dyn DataPath>, err: Error },
}

/// A peer's data path that can fail over once (see the module doc); what `PeerConn::link` is
/// when the chosen backend can hand its parts over and a next backend is configured.
pub(super) struct Failover {
    peer: String,
    control: Arc<dyn ControlChannel>,
    first_domains: &'static [(Domain, Domain)],
    state: RwLock<State>,
    opener: Mutex<Option<Opener>>,
    /// Settles parts this layer fails itself (names the first backend in logs).
    done: Completer,
    holder_id: u64,
    failovers: AtomicU64,
    reason: Mutex<String>,
    closed: AtomicBool,
    mover: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Paths that carried the link before, closed with it.
    retired: Mutex<Vec<Arc<dyn DataPath>>>,
    me: Weak<Failover>,
}

impl Failover {
    /// Wraps `path` (of a backend serving `domains`); None when `path` cannot hand its parts
    /// over (the caller then uses `path` itself).
    pub(super) fn wrap(
        control: Arc<dyn ControlChannel>,
        path: Arc<dyn DataPath>,
        domains: &'static [(Domain, Domain)],
        opener: Opener,
    ) -> Option<Arc<Failover>> {
        let f = Arc::new_cyclic(|me: &Weak<Failover>| Failover {
            peer: control.peer().to_string(),
            done: Completer::new(path.backend(), &control.peer_info().engine_id, control.stats()),
            control: control.clone(),
            first_domains: domains,
            state: RwLock::new(State::Up { path: path.clone(), domains }),
            opener: Mutex::new(Some(opener)),
            holder_id: new_holder_id(),
            failovers: AtomicU64::new(0),
            reason: Mutex::new(String::new()),
            closed: AtomicBool::new(false),
            mover: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
            me: me.clone(),
        });
        let rescue: Weak<dyn Rescue> = f.me.clone();
        if !path.set_rescue(rescue) {
            return None;
        }
        // The control channel died while the next backend opens: what waits fails at once
        // (not when the opening gives up).
        let weak = f.me.clone();
        control.on_close(Box::new(move |why| {
            if let Some(f) = weak.upgrade() {
                f.control_closed(why);
            }
        }));
        Some(f)
    }

    /// The control channel closed with `why`: a failover in progress ends, failing what waits.
    fn control_closed(&self, why: Error) {
        let mut st = self.state.write().unwrap();
        let State::Moving { from, waiting } = &mut *st else { return };
        let (from, waiting) = (from.clone(), std::mem::take(waiting));
        *st = State::Down { from, err: why.clone() };
        drop(st);
        self.fail(waiting.into_iter().flatten().collect(), &why);
    }

    /// How many times the link moved to another backend (0 or 1), and why it did ("" if not).
    pub(super) fn failovers(&self) -> (u64, String) {
        (self.failovers.load(Ordering::Acquire), self.reason.lock().unwrap().clone())
    }

    /// The domain pairs the path that carries the link now serves.
    pub(super) fn domains(&self) -> &'static [(Domain, Domain)] {
        match &*self.state.read().unwrap() {
            State::Up { domains, .. } => domains,
            _ => self.first_domains,
        }
    }

    /// Ends parts here with `err` (their requests fail).
    fn fail(&self, parts: Vec<Part>, err: &Error) {
        for p in parts {
            self.control.finish_after(&self.done, p, Err(err.clone()));
        }
    }

    /// Hands parts to `path`; if it refuses them, their requests fail with its error.
    fn hand(&self, path: &Arc<dyn DataPath>, parts: Vec<Part>) {
        let mut reqs: Vec<Arc<Request>> = Vec::new();
        for p in &parts {
            if !reqs.iter().any(|r| Arc::ptr_eq(r, &p.req)) {
                reqs.push(p.req.clone());
            }
        }
        if let Err(e) = path.submit(parts) {
            for r in reqs {
                self.done.abandon(&r, e.clone());
            }
        }
    }

    /// Opens the next backend (on the mover thread) and moves the waiting parts there.
    fn move_on(&self, why: Error) {
        let opener = self.opener.lock().unwrap().take();
        let res = match opener {
            Some(o) => o.open(&self.control),
            None => Err("the link failed over once already".into()),
        };
        let mut st = self.state.write().unwrap();
        let (from, waiting) = match &mut *st {
            State::Moving { from, waiting } => (from.clone(), std::mem::take(waiting)),
            // The control channel closed meanwhile (`control_closed` failed what waited).
            _ => {
                drop(st);
                if let Ok((path, _)) = res {
                    path.close(Error::not_connected("the control channel closed while failing over"));
                }
                return;
            }
        };
        let waiting: Vec<Part> = waiting.into_iter().flatten().collect();
        match res {
            Ok((path, domains)) if !self.closed.load(Ordering::Acquire) => {
                let text = format!("{} -> {}: {}", from.backend(), path.backend(), why.message);
                tracing::warn!(peer = %self.peer, from = from.backend(), to = path.backend(), reason = %why.message,
                    parts = waiting.len(), "data path failed over");
                *self.reason.lock().unwrap() = text;
                self.failovers.fetch_add(1, Ordering::AcqRel);
                self.retired.lock().unwrap().push(from);
                *st = State::Up { path: path.clone(), domains };
                drop(st);
                if !waiting.is_empty() {
                    self.hand(&path, waiting);
                }
            }
            res => {
                let next = match res {
                    Ok((path, _)) => {
                        path.close(Error::failed("the engine closed the link while it failed over"));
                        "the link was closed meanwhile".to_string()
                    }
                    Err(e) => e,
                };
                let err = Error::not_connected(format!(
                    "the {} data path to {} died ({}) and no other backend took over ({next})",
                    from.backend(),
                    self.peer,
                    why.message
                ));
                tracing::warn!(peer = %self.peer, error = %err.message, "failover failed");
                *st = State::Down { from, err: err.clone() };
                drop(st);
                self.fail(waiting, &err);
                self.control.close(err);
            }
        }
    }
}

impl Rescue for Failover {
    fn rescue(&self, parts: Vec<Part>, why: &Error) {
        let mut st = self.state.write().unwrap();
        match &mut *st {
            State::Moving { waiting, .. } => {
                if !parts.is_empty() {
                    waiting.push(parts);
                }
            }
            State::Down { err, .. } => {
                let err = err.clone();
                drop(st);
                self.fail(parts, &err);
            }
            // Late parts of the path that died, after another took over: straight there.
            State::Up { path, .. } if self.failovers.load(Ordering::Acquire) > 0 => {
                let path = path.clone();
                drop(st);
                self.hand(&path, parts);
            }
            State::Up { path, .. } => {
                let from = path.clone();
                tracing::warn!(peer = %self.peer, backend = from.backend(), reason = %why.message,
                    "data path died while its control channel lives; failing over");
                let waiting = if parts.is_empty() { Vec::new() } else { vec![parts] };
                *st = State::Moving { from, waiting };
                drop(st);
                let (me, why) = (self.me.clone(), why.clone());
                let spawned = crate::place::spawn("hixl-failover".into(), move || {
                    if let Some(f) = me.upgrade() {
                        f.move_on(why);
                    }
                });
                match spawned {
                    Ok(h) => *self.mover.lock().unwrap() = Some(h),
                    Err(e) => {
                        let _ = self.opener.lock().unwrap().take();
                        tracing::warn!(error = %e, "cannot start the failover thread");
                        self.move_on(Error::failed(format!("cannot start the failover thread: {e}")));
                    }
                }
            }
        }
    }
}

impl DataPath for Failover {
    fn backend(&self) -> &'static str {
        match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.backend(),
            State::Moving { from, .. } | State::Down { from, .. } => from.backend(),
        }
    }

    fn parallelism(&self) -> usize {
        match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.parallelism(),
            State::Moving { from, .. } | State::Down { from, .. } => from.parallelism(),
        }
    }

    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        {
            // Held while the path takes the parts: the path's death (`rescue`) waits for it,
            // so a part it took is either rescued or lands; never lost in between.
            let st = self.state.read().unwrap();
            if let State::Up { path, .. } = &*st {
                return path.submit(parts);
            }
        }
        let mut st = self.state.write().unwrap();
        match &mut *st {
            State::Up { path, .. } => path.submit(parts),
            State::Down { err, .. } => Err(err.clone()),
            State::Moving { waiting, .. } => {
                waiting.push(parts);
                Ok(())
            }
        }
    }

    fn is_alive(&self) -> bool {
        match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.is_alive(),
            State::Moving { .. } => self.control.is_alive(),
            State::Down { .. } => false,
        }
    }

    fn dead_reason(&self) -> Option<String> {
        match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.dead_reason(),
            State::Moving { .. } => self.control.dead_reason(),
            State::Down { err, .. } => Some(err.message.clone()),
        }
    }

    fn close(&self, why: Error) {
        self.closed.store(true, Ordering::Release);
        let (path, waiting) = {
            let mut st = self.state.write().unwrap();
            match &mut *st {
                State::Up { path, .. } => (Some(path.clone()), Vec::new()),
                State::Moving { from, waiting } => {
                    (Some(from.clone()), std::mem::take(waiting).into_iter().flatten().collect())
                }
                State::Down { from, .. } => (Some(from.clone()), Vec::new()),
            }
        };
        self.fail(waiting, &why);
        if let Some(p) = path {
            p.close(why.clone());
        }
        // The mover ends by the connect deadline; it fails what it still holds (closed).
        let mover = self.mover.lock().unwrap().take();
        if let Some(h) = mover {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let retired = std::mem::take(&mut *self.retired.lock().unwrap());
        for p in retired {
            p.close(why.clone());
        }
        self.control.close(why);
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.control.stats()
    }

    fn wait_help(self: Arc<Self>) -> Option<Weak<dyn crate::queue::WaitHelp>> {
        let path = match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.clone(),
            _ => return None,
        };
        path.wait_help()
    }

    fn queue_slots(&self) -> (usize, usize) {
        match &*self.state.read().unwrap() {
            State::Up { path, .. } => path.queue_slots(),
            State::Moving { from, .. } | State::Down { from, .. } => from.queue_slots(),
        }
    }
}

impl Abort for Failover {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
