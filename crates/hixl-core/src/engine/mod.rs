//! The public engine: initialize / register / connect / transfer / status / notify / finalize.
//!
//! A transfer's path (`transfer`): validate every descriptor against the local registry and the
//! peer's region table (`validate`) -> merge adjacent descriptors -> cut the batch into one
//! part per worker share -> the chosen backend's data path moves them -> the completer settles
//! the request when the last part ends and wakes waiters. Each peer has one control channel
//! (the region table, notifications) and one data path, chosen when it connects (`open_link`).
//! Registration runs the backends' hooks first (`register`).

use std::collections::HashMap;
use std::net::{IpAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::notify::NotifyStore;
pub use crate::options::addr::parse_addr;
use crate::options::Options;
use crate::queue::Request;
use crate::registry::{Access, MemType, Region, Registry};
use crate::transport::backend::{Backend, MemorySpan};
use crate::transport::backends::shm::{self, SharedMem};
use crate::transport::control::channel::ControlChannel;
use crate::transport::reactor::Reactor;
use crate::transport::target_side::{Server, ServerCtx};
use crate::transport::DataPath;
use crate::wire::Domain;

mod connect;
mod failover;
pub(crate) mod option_table;
mod register;
mod sides;
mod transfer;
mod types;
mod validate;

use register::{register_region, run_deregister_hooks};
pub use types::{
    ConnectStatus, MemDesc, MemHandle, PeerSnapshot, RemoteRegion, StridedDesc, TransferOpDesc, TransferReq,
    Waiting,
};
use validate::with_fresh_table;
pub use validate::{push_merged, split};

struct PeerConn {
    /// The peer's name as `connect` was given it (the key of `peers`), shared by its requests.
    name: Arc<str>,
    /// The control channel: the peer's region table, notifications, liveness.
    control: Arc<dyn ControlChannel>,
    /// The chosen backend's data path.
    link: Arc<dyn DataPath>,
    /// The (local, remote) domain pairs that data path serves.
    domains: &'static [(Domain, Domain)],
    /// Why the backends before it were not chosen.
    not_chosen: String,
    /// The failover layer that `link` is, when the chosen path can fail over (see `failover`).
    failover: Option<Arc<failover::Failover>>,
    /// The backends after the chosen one, for memory domains it does not serve.
    sides: sides::Sides,
    /// Recent requests, so that a later notify can wait for their data.
    recent: Mutex<Vec<Weak<Request>>>,
}

impl PeerConn {
    /// The (local, remote) domain pairs the path that carries the link now serves.
    fn domains(&self) -> &'static [(Domain, Domain)] {
        self.failover.as_ref().map_or(self.domains, |f| f.domains())
    }

    /// The domain pairs of the backends after the chosen one that the peer offers, in order.
    fn later_domains(&self) -> Vec<&[(Domain, Domain)]> {
        self.sides.domains()
    }

    /// Closes the link: its data path, the control channel and any path opened besides.
    fn close(&self, why: Error) {
        self.sides.close(&why);
        self.link.close(why);
    }

    /// Failovers of the link (0 or 1) and why.
    fn failovers(&self) -> (u64, String) {
        self.failover.as_ref().map(|f| f.failovers()).unwrap_or_default()
    }
}

enum PeerSlot {
    Connecting,
    Connected(Arc<PeerConn>),
    Failed,
}

struct Running {
    local_engine: String,
    host: String,
    opts: Options,
    /// The backends of `hixl.backends`, in the order they are tried.
    backends: Vec<Arc<dyn Backend>>,
    pid: u32,
    registry: Arc<Registry>,
    notifies: Arc<NotifyStore>,
    server: Option<Arc<Server>>,
    peers: Mutex<HashMap<String, PeerSlot>>,
    next_req: AtomicU64,
    /// Memory from `alloc`, by address; dropped (unmapped unless referenced) on deregistration.
    allocated: Mutex<HashMap<u64, Arc<SharedMem>>>,
    /// Set by `finalize` (under the `peers` lock): a connect that ends later closes its link.
    closed: AtomicBool,
    /// Regions deregistered whose removal a same-host peer has not confirmed yet (their memory
    /// must stay allocated), by region id: a retried `deregister_mem` asks again.
    unconfirmed: Mutex<HashMap<u64, Arc<Region>>>,
    /// Transfers to peers this engine holds no link to (never connected, or disconnected),
    /// refused at submission: counted here, by status, since no peer's stats can hold them.
    unlinked: Arc<crate::stats::PeerStats>,
    /// Threads of `connect_async` calls; `finalize` waits for them (each ends by its deadline).
    connects: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The I/O workers and timer that run every TCP stream of the engine.
    reactor: Arc<Reactor>,
    /// Runs requests that stage device memory over `tcp` (threads made at the first one); the
    /// `tcp` paths hold it too (`transport::staging::StagedPath`).
    stager: Arc<crate::transport::staging::Stager>,
}

/// A transfer engine (one per process is typical). All methods take `&self` and are thread-safe.
pub struct Engine {
    state: Mutex<Option<Arc<Running>>>,
    finalized: std::sync::atomic::AtomicBool,
    /// Why finalize failed, when it did: a same-host peer may still copy into memory this
    /// engine registered, so every later finalize reports it again (and callers keep that
    /// memory alive) instead of succeeding.
    finalize_failed: Mutex<Option<Error>>,
}

impl Default for Engine {
    fn default() -> Self {
        Self::new()
    }
}

impl Engine {
    /// A new, uninitialized engine.
    pub fn new() -> Self {
        Engine { state: Mutex::new(None), finalized: Default::default(), finalize_failed: Mutex::new(None) }
    }

    fn running(&self) -> Result<Arc<Running>> {
        let r = self.state.lock().unwrap().clone();
        match r {
            Some(r) if r.pid != current_pid() => Err(Error::failed(format!(
                "this engine was initialized in process {}; its threads do not survive fork() \
                 (this is process {}): create a new engine in the child",
                r.pid,
                std::process::id()
            ))),
            Some(r) => Ok(r),
            None if self.finalized.load(Ordering::Acquire) => {
                Err(Error::failed("the engine was finalized; create a new one"))
            }
            None => Err(Error::failed("the engine is not initialized: call initialize() first")),
        }
    }

    /// Starts the engine. `local_engine` is "ip:port" to listen (port 0 = ephemeral) or "ip"
    /// alone for a client-only engine.
    pub fn initialize(&self, local_engine: &str, options: &HashMap<String, String>) -> Result<()> {
        let opts = Options::parse(options)?;
        let mut st = self.state.lock().unwrap();
        if st.is_some() {
            return Err(Error::failed("the engine is already initialized"));
        }
        if self.finalized.load(Ordering::Acquire) {
            return Err(Error::failed("the engine was finalized; create a new one"));
        }
        let registry = Arc::new(Registry::new());
        let cpus = crate::place::capture(opts.cpus.as_deref())?;
        let reactor = Reactor::start(opts.io_workers(), opts.busy_poll, Some(cpus))?;
        let notifies = Arc::new(NotifyStore::new(opts.notify_limits));
        let pid = std::process::id();
        let host = shm::host_id();
        let backends: Vec<Arc<dyn Backend>> =
            opts.backends.iter().filter_map(|n| crate::transport::backends::by_name(n, &opts)).collect();
        let bare = local_engine.trim_start_matches('[').trim_end_matches(']');
        let (local, server) = if let Ok(ip) = bare.parse::<IpAddr>() {
            // Client only: an id that is unique per process.
            (format!("{ip}#{pid}"), None)
        } else {
            let addr = parse_addr(local_engine)?;
            let l = TcpListener::bind(addr).map_err(|e| match e.kind() {
                std::io::ErrorKind::AddrInUse => Error::param(format!(
                    "cannot listen on {local_engine:?}: the address is already in use (another \
                         engine or program listens there); pick another port, or port 0 for any free one"
                )),
                _ => Error::param(format!("cannot listen on {local_engine:?}: {e}")),
            })?;
            let bound = l.local_addr().map_err(|e| Error::failed(e.to_string()))?.to_string();
            let ctx = Arc::new(ServerCtx {
                engine_id: bound.clone(),
                registry: registry.clone(),
                notifies: notifies.clone(),
                handshake_timeout: opts.handshake_timeout,
                slow_peer_timeout: opts.deregister_timeout.max(Duration::from_secs(1)),
                host: host.clone(),
                secret: opts.secret.clone(),
                max_pending: opts.max_pending_handshakes,
                max_pending_per_source: opts.max_pending_per_source,
                max_streams: opts.max_streams,
                max_streams_per_source: opts.max_streams_per_source,
                backends: backends.clone(),
                reactor: reactor.clone(),
                staging: Arc::new(crate::transport::staging::target::DeviceStaging::default()),
            });
            if opts.secret.is_none() && !addr.ip().is_loopback() {
                warn_open_listener(&bound);
            }
            match Server::start(l, ctx) {
                Ok(s) => (bound, Some(s)),
                Err(e) => {
                    reactor.stop();
                    return Err(e);
                }
            }
        };
        tracing::info!(engine = %local, "engine initialized");
        let auto_connect = opts.auto_connect.clone();
        let stager = Arc::new(crate::transport::staging::Stager::new(opts.stage_chunk, opts.stage_depth));
        *st = Some(Arc::new(Running {
            local_engine: local,
            host,
            backends,
            opts,
            pid,
            registry,
            notifies,
            server,
            peers: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            allocated: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            unconfirmed: Mutex::new(HashMap::new()),
            unlinked: Arc::default(),
            connects: Mutex::new(Vec::new()),
            reactor,
            stager,
        }));
        drop(st);
        // HIXL's AutoConnect: connect in the background; each result is the peer's connect
        // status (`get_async_connect_status`), and a failure is logged there.
        for peer in auto_connect {
            if let Err(e) = self.connect_async(&peer) {
                tracing::warn!(peer = %peer, "AutoConnect could not start: {e}");
            }
        }
        Ok(())
    }

    /// The CPUs every thread of the engine runs on (`hixl.cpus`, `HIXL_CPUS`, or the set the
    /// thread calling `initialize` could use), ascending: threads the host starts for the
    /// engine should run there too.
    pub fn cpus(&self) -> Result<Vec<usize>> {
        Ok(self.running()?.reactor.cpus().map(|c| c.to_vec()).unwrap_or_default())
    }

    /// The deadlines a call that gives none gets: (`hixl.transfer_timeout_ms`,
    /// `hixl.connect_timeout_ms`).
    pub fn default_timeouts(&self) -> Result<(Duration, Duration)> {
        let r = self.running()?;
        Ok((r.opts.transfer_timeout, r.opts.connect_timeout))
    }

    /// The bound "ip:port" (or "ip#pid" for a client-only engine).
    pub fn local_engine(&self) -> Result<String> {
        Ok(self.running()?.local_engine.clone())
    }

    /// Stops the engine: fails every pending request (FAILED), closes links and the listener,
    /// deregisters all memory. Later calls fail; a second finalize is a no-op.
    pub fn finalize(&self) -> Result<()> {
        let Some(r) = self.state.lock().unwrap().take() else {
            return match &*self.finalize_failed.lock().unwrap() {
                Some(e) => Err(e.clone().context("an earlier finalize failed, and its memory stays in use")),
                None => Ok(()),
            };
        };
        tracing::info!(engine = %r.local_engine, "engine finalizing");
        self.finalized.store(true, Ordering::Release);
        let slots: Vec<_> = {
            let mut peers = r.peers.lock().unwrap();
            r.closed.store(true, Ordering::Release);
            peers.drain().collect()
        };
        for (_, slot) in slots {
            if let PeerSlot::Connected(c) = slot {
                c.close(Error::failed("the engine was finalized"));
            }
        }
        // Connects still under way close what they open (see `finish_connect`); each ends by
        // its own deadline (hixl.connect_timeout_ms at most).
        for h in std::mem::take(&mut *r.connects.lock().unwrap()) {
            let _ = h.join();
        }
        // Empty the registry, then make same-host peers (direct copies) confirm the empty
        // table before the listener stops and memory may be freed.
        let (regions, cleared) = r.registry.clear(r.opts.deregister_timeout);
        let published = match &r.server {
            Some(s) => {
                let p = s.publish_regions(Some(r.opts.deregister_timeout));
                s.stop();
                p
            }
            None => Ok(()),
        };
        for region in &regions {
            run_deregister_hooks(&r, region);
        }
        r.reactor.stop();
        let allocated = std::mem::take(&mut *r.allocated.lock().unwrap());
        if published.is_err() || cleared.is_err() {
            // A peer may still copy into it: leak rather than free memory under it.
            std::mem::forget(allocated);
        }
        tracing::info!(engine = %r.local_engine, "engine finalized");
        let res = cleared.and(published);
        if let Err(e) = &res {
            *self.finalize_failed.lock().unwrap() = Some(e.clone());
        }
        res
    }

    /// Registers `[desc.addr, desc.addr + desc.len)` for peers to READ and WRITE.
    ///
    /// # Safety
    ///
    /// The caller promises what the engine cannot check: the range is memory of this process
    /// of `mem_type`, mapped, and stays valid until it is deregistered (or the engine
    /// finalized); peers and this engine's transfers may read and write it at any time until
    /// then, concurrently with the caller. For memory the engine owns instead, use
    /// [`Engine::alloc`] or [`Engine::register_static`] (safe).
    ///
    /// ```compile_fail
    /// # let e = hixl_core::Engine::new();
    /// # let mut buf = vec![0u8; 64];
    /// // A raw range is only registered inside `unsafe`: this does not compile.
    /// let d = hixl_core::MemDesc { addr: buf.as_mut_ptr() as u64, len: 64 };
    /// e.register_mem(d, hixl_core::MemType::Host);
    /// ```
    pub unsafe fn register_mem(&self, desc: MemDesc, mem_type: MemType) -> Result<MemHandle> {
        // SAFETY: the caller carries this function's contract, which is the callee's.
        unsafe { self.register_mem_access(desc, mem_type, Access::ReadWrite) }
    }

    /// Registers with an access mode: `Access::ReadOnly` regions may be READ by peers, and a
    /// peer's WRITE into them is refused by this engine (PARAM_INVALID, nothing written).
    ///
    /// # Safety
    ///
    /// As for [`Engine::register_mem`].
    pub unsafe fn register_mem_access(
        &self,
        desc: MemDesc,
        mem_type: MemType,
        access: Access,
    ) -> Result<MemHandle> {
        // SAFETY: the caller carries this function's contract, which is the callee's.
        unsafe { self.register_named(desc, mem_type, access, "") }
    }

    /// Registers host memory that lives for the rest of the program and that the caller gave
    /// up (`Box::leak` makes such a slice): safe, since nothing else can touch it. Peers may
    /// READ and WRITE it; `name` as in [`Engine::register_named`].
    pub fn register_static(&self, buf: &'static mut [u8], name: &str) -> Result<MemHandle> {
        let desc = MemDesc { addr: buf.as_mut_ptr() as u64, len: buf.len() as u64 };
        // SAFETY: a 'static exclusive borrow: the memory is host memory of this process, stays
        // mapped forever, and the caller can no longer access it.
        unsafe { self.register_named(desc, MemType::Host, Access::ReadWrite, name) }
    }

    /// Registers under a name (empty: none) that peers see in their region table and can look
    /// the region up by ([`Engine::remote_region`]); names are unique within an engine. A
    /// memory domain that no backend of `hixl.backends` serves is UNSUPPORTED.
    ///
    /// # Safety
    ///
    /// As for [`Engine::register_mem`].
    pub unsafe fn register_named(
        &self,
        desc: MemDesc,
        mem_type: MemType,
        access: Access,
        name: &str,
    ) -> Result<MemHandle> {
        let r = self.running()?;
        // SAFETY: the caller carries this function's contract (`Engine::register_mem`'s), which
        // is the span's.
        let span = unsafe { MemorySpan::new(desc.addr, desc.len, mem_type, access) };
        let region = register_region(&r, span, access, name)?;
        Ok(MemHandle { id: region.id, addr: region.addr, len: region.len, mem_type: region.mem_type })
    }

    /// Allocates `size` bytes of shared memory (memfd, 2 MiB aligned, size rounded up to 2 MiB)
    /// and registers it. The engine frees it on deregistration or finalize, unless the caller
    /// still holds the returned `Arc` (then it is freed when that goes).
    pub fn alloc(&self, size: u64) -> Result<(MemHandle, Arc<SharedMem>)> {
        self.alloc_named(size, "")
    }

    /// [`Engine::alloc`] under a name (see [`Engine::register_named`]).
    pub fn alloc_named(&self, size: u64, name: &str) -> Result<(MemHandle, Arc<SharedMem>)> {
        let r = self.running()?;
        let mem = Arc::new(SharedMem::new(size)?);
        // The engine keeps `mem` (`allocated`, below) until the region is deregistered.
        let span = MemorySpan::engine_owned(&mem);
        let region = register_region(&r, span, Access::ReadWrite, name)?;
        r.allocated.lock().unwrap().insert(mem.addr(), mem.clone());
        Ok((MemHandle { id: region.id, addr: region.addr, len: region.len, mem_type: MemType::Host }, mem))
    }

    /// Deregisters a region, waiting for (then aborting) transfers that use it. Idempotent:
    /// a handle already deregistered does nothing, even when the same range was registered
    /// again since (that registration has another id, which only its own handle names).
    pub fn deregister_mem(&self, h: &MemHandle) -> Result<()> {
        let r = self.running()?;
        let region = match r.registry.remove_exact(h.id, h.addr, h.len) {
            Some(region) => region,
            // Gone from the registry, but its pins had not drained or a same-host peer had
            // not confirmed it: try again.
            None => match r.unconfirmed.lock().unwrap().remove(&h.id) {
                Some(region) => region,
                None => return Ok(()),
            },
        };
        if let Err(e) = region.close_and_drain(r.opts.deregister_timeout) {
            // A transfer still holds it: peers must stop using it, and a retry must fail
            // again (not report success) until the pins are gone.
            if let Some(s) = &r.server {
                let _ = s.publish_regions(Some(r.opts.deregister_timeout));
            }
            r.unconfirmed.lock().unwrap().insert(h.id, region);
            return Err(e);
        }
        if let Some(s) = &r.server {
            // Same-host peers copy without a target-side check: they must drop the region
            // from their tables before its memory may be freed.
            if let Err(e) = s.publish_regions(Some(r.opts.deregister_timeout)) {
                // A retry must fail again until they confirm (or are gone): not report success.
                r.unconfirmed.lock().unwrap().insert(h.id, region);
                return Err(e);
            }
        }
        run_deregister_hooks(&r, &region);
        r.allocated.lock().unwrap().remove(&h.addr);
        Ok(())
    }

    /// The regions the peer has registered, by address: the peer's regions as of the last
    /// region-table update this engine received (the whole table when the link was made, then
    /// an update after every registration and deregistration; no round trip is made here).
    pub fn remote_mems(&self, remote: &str) -> Result<Vec<MemDesc>> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        let table = c.control.table();
        Ok(table.regions().map(|r| MemDesc { addr: r.addr, len: r.len }).collect())
    }

    /// The peer's regions with their names, domains and access, by address: the peer's regions
    /// as of the last region-table update this engine received (see [`Engine::remote_mems`]).
    pub fn remote_regions(&self, remote: &str) -> Result<Vec<RemoteRegion>> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        let table = c.control.table();
        Ok(table.regions().map(RemoteRegion::from).collect())
    }

    /// The peer's regions after asking it for its current table (one round trip, bounded by
    /// `hixl.handshake_timeout_ms`): what [`Engine::remote_regions`] gives, without waiting
    /// for an update the peer may not have sent yet.
    pub fn refresh_remote_regions(&self, remote: &str) -> Result<Vec<RemoteRegion>> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        c.control.refresh_table(r.opts.handshake_timeout)?;
        self.remote_regions(remote)
    }

    /// The peer's region registered under `name`, looked up in the peer's regions as of the last
    /// region-table update this engine received. A name not found there is asked for once (the
    /// peer may have registered it a moment ago); PARAM_INVALID naming it when the peer has no
    /// such region.
    pub fn remote_region(&self, remote: &str, name: &str) -> Result<RemoteRegion> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        let find = |miss: &mut bool| match c.control.table().by_name(name) {
            Some(e) => Ok(RemoteRegion::from(e)),
            None => {
                *miss = true;
                Err(Error::param(format!("{remote} has no region registered as name={name:?}")))
            }
        };
        with_fresh_table(&r, &c, find)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.finalize();
    }
}

/// Logs, once per process, that a listener reachable from other hosts has no cluster secret.
fn warn_open_listener(bound: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            listen = %bound,
            "listening on a non-loopback address without a cluster secret: anyone who can reach \
             this port can read and write registered memory; set hixl.secret or HIXL_SECRET"
        );
    });
}

#[cfg(test)]
mod stage_tests;

/// This process's id, without a system call on every transfer (`getpid` was a tenth of a
/// same-host 4 KiB transfer): cached, and forgotten in the child of a `fork()` by an atfork
/// handler, so that an engine used across a fork is still caught.
fn current_pid() -> u32 {
    use std::sync::atomic::AtomicU32;
    static PID: AtomicU32 = AtomicU32::new(0);
    static HANDLER: std::sync::Once = std::sync::Once::new();
    extern "C" fn forget_in_child() {
        PID.store(0, Ordering::Relaxed);
    }
    HANDLER.call_once(|| {
        // The handler only stores to an atomic (async-signal-safe).
        crate::sys::at_fork_child(forget_in_child);
    });
    match PID.load(Ordering::Relaxed) {
        0 => {
            let pid = std::process::id();
            PID.store(pid, Ordering::Relaxed);
            pid
        }
        pid => pid,
    }
}
