//! The public engine: initialize / register / connect / transfer / status / notify / finalize.
//!
//! A transfer's path: validate every descriptor against the local registry and the peer's
//! region table -> merge adjacent descriptors -> cut the batch into one part per stream share ->
//! queue the parts on the peer's link (lock-free, bounded) -> the link's workers submit them
//! -> the last completion settles the request and wakes waiters.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::notify::NotifyStore;
use crate::options::Options;
use crate::queue::{NotifyDesc, Part, PartBody, Request, SegPair, Strided, TransferOp, TransferStatus};
use crate::registry::{read_only, Abort, Access, MemType, Pin, Region, RegionSpec, Registry};
use crate::stats::LatencySummary;
use crate::transport::backend::{self, Backend, MemorySpan};
use crate::transport::server::{Server, ServerCtx};
use crate::transport::shm::{self, SharedMem};
use crate::transport::tcp::{ConnectParams, TcpLink};
use crate::transport::DataPath;
use crate::wire::{BackendKey, Domain, RegionEntry, MAX_DESCS};

/// A memory range: start address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemDesc {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A registered region, as returned by `register_mem`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MemHandle {
    /// Registry id.
    pub id: u64,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Memory type.
    pub mem_type: MemType,
}

/// One descriptor of a batch: `len` bytes between `local_addr` and `remote_addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferOpDesc {
    /// Address in this engine's registered memory.
    pub local_addr: u64,
    /// Address in the peer's registered memory.
    pub remote_addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A strided descriptor: `count` elements of `size` bytes; element i sits at
/// `base + i * stride` locally and at `remote_base + i * remote_stride` (default: `stride`)
/// at the peer, so a layout can be re-packed on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StridedDesc {
    /// Number of elements (>= 1).
    pub count: u64,
    /// Bytes per element (>= 1).
    pub size: u64,
    /// Local distance between elements (>= size).
    pub stride: u64,
    /// Remote distance between elements (>= size); None means `stride`.
    pub remote_stride: Option<u64>,
}

/// State of an asynchronous connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConnectStatus {
    /// No connect was made (or the peer was disconnected).
    NotConnect,
    /// A connect is running.
    Connecting,
    /// Connected and alive.
    Connected,
    /// The last connect failed, or the link died.
    ConnectFailed,
}

/// Per-peer figures returned by [`Engine::stats`].
#[derive(Clone, Debug, PartialEq)]
pub struct PeerSnapshot {
    /// Peer address.
    pub peer: String,
    /// Backend name.
    pub backend: &'static str,
    /// Why the backends tried before it were not chosen ("shm: ...; ..."; empty: it was first).
    pub not_chosen: String,
    /// Whether the link is usable.
    pub alive: bool,
    /// Bytes written to the peer.
    pub bytes_write: u64,
    /// Bytes read from it.
    pub bytes_read: u64,
    /// Completed WRITE requests.
    pub ops_write: u64,
    /// Completed READ requests.
    pub ops_read: u64,
    /// Failed or timed-out requests.
    pub errors: u64,
    /// Notifications sent.
    pub notifies: u64,
    /// Same-host copies done through a mapping of the peer's memory (not CMA).
    pub direct_parts: u64,
    /// Latency of recent requests.
    pub latency: LatencySummary,
}

/// A region a peer registered, as [`Engine::remote_regions`] shows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The name the peer registered it under (empty: none).
    pub name: String,
    /// Its memory domain.
    pub mem_type: MemType,
    /// Whether this engine may WRITE it (false: registered read-only).
    pub writable: bool,
}

impl From<&RegionEntry> for RemoteRegion {
    fn from(e: &RegionEntry) -> Self {
        RemoteRegion {
            addr: e.addr,
            len: e.len,
            name: e.name.clone(),
            mem_type: e.domain,
            writable: e.writable,
        }
    }
}

/// A transfer request handle.
pub type TransferReq = Arc<Request>;

struct PeerConn {
    /// The control channel: the peer's region table, notifications, liveness.
    control: Arc<TcpLink>,
    /// The chosen backend's data path.
    link: Arc<dyn DataPath>,
    /// The (local, remote) domain pairs that data path serves.
    domains: &'static [(Domain, Domain)],
    /// Why the backends before it were not chosen.
    not_chosen: String,
    /// Recent requests, so that a later notify can wait for their data.
    recent: Mutex<Vec<Weak<Request>>>,
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
}

/// A transfer engine (one per process is typical). All methods take `&self` and are thread-safe.
pub struct Engine {
    state: Mutex<Option<Arc<Running>>>,
    finalized: std::sync::atomic::AtomicBool,
}

impl Default for Engine {
    fn default() -> Self {
        Self::new()
    }
}

/// Parses "ip:port", "[v6]:port", "host:port" into one socket address.
pub fn parse_addr(s: &str) -> Result<SocketAddr> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    match s.to_socket_addrs() {
        Ok(mut it) => it.next().ok_or_else(|| Error::param(format!("address {s:?} resolves to nothing"))),
        Err(_) => Err(Error::param(format!("address {s:?} is not \"ip:port\" (IPv6 as \"[::1]:port\")"))),
    }
}

impl Engine {
    /// A new, uninitialized engine.
    pub fn new() -> Self {
        crate::log::init();
        Engine { state: Mutex::new(None), finalized: Default::default() }
    }

    fn running(&self) -> Result<Arc<Running>> {
        let r = self.state.lock().unwrap().clone();
        match r {
            Some(r) if r.pid != std::process::id() => Err(Error::failed(format!(
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
        let notifies = Arc::new(NotifyStore::new(opts.notify_limits));
        let pid = std::process::id();
        let host = shm::host_id();
        let backends: Vec<Arc<dyn Backend>> =
            opts.backends.iter().filter_map(|n| backend::by_name(n)).collect();
        let bare = local_engine.trim_start_matches('[').trim_end_matches(']');
        let (local, server) = if let Ok(ip) = bare.parse::<IpAddr>() {
            // Client only: an id that is unique per process.
            (format!("{ip}#{pid}"), None)
        } else {
            let addr = parse_addr(local_engine)?;
            let l = TcpListener::bind(addr)
                .map_err(|e| Error::param(format!("cannot listen on {local_engine:?}: {e}")))?;
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
                backends: backends.clone(),
            });
            if opts.secret.is_none() && !addr.ip().is_loopback() {
                warn_open_listener(&bound);
            }
            (bound, Some(Server::start(l, ctx)?))
        };
        tracing::info!(engine = %local, "engine initialized");
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
        }));
        Ok(())
    }

    /// The bound "ip:port" (or "ip#pid" for a client-only engine).
    pub fn local_engine(&self) -> Result<String> {
        Ok(self.running()?.local_engine.clone())
    }

    /// Stops the engine: fails every pending request (FAILED), closes links and the listener,
    /// deregisters all memory. Later calls fail; a second finalize is a no-op.
    pub fn finalize(&self) -> Result<()> {
        let Some(r) = self.state.lock().unwrap().take() else { return Ok(()) };
        self.finalized.store(true, Ordering::Release);
        let slots: Vec<_> = r.peers.lock().unwrap().drain().collect();
        for (_, slot) in slots {
            if let PeerSlot::Connected(c) = slot {
                c.link.close(Error::failed("the engine was finalized"));
            }
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
        let allocated = std::mem::take(&mut *r.allocated.lock().unwrap());
        if published.is_err() {
            // A peer may still copy into it: leak rather than free memory under it.
            std::mem::forget(allocated);
        }
        tracing::info!(engine = %r.local_engine, "engine finalized");
        cleared.and(published)
    }

    /// Registers `[desc.addr, desc.addr + desc.len)` for peers to READ and WRITE.
    pub fn register_mem(&self, desc: MemDesc, mem_type: MemType) -> Result<MemHandle> {
        self.register_mem_access(desc, mem_type, Access::ReadWrite)
    }

    /// Registers with an access mode: `Access::ReadOnly` regions may be READ by peers, and a
    /// peer's WRITE into them is refused by this engine (PARAM_INVALID, nothing written).
    pub fn register_mem_access(&self, desc: MemDesc, mem_type: MemType, access: Access) -> Result<MemHandle> {
        self.register_named(desc, mem_type, access, "")
    }

    /// Registers under a name (empty: none) that peers see in their region table and can look
    /// the region up by ([`Engine::remote_region`]); names are unique within an engine. A
    /// memory domain that no backend of `hixl.backends` serves is UNSUPPORTED.
    pub fn register_named(
        &self,
        desc: MemDesc,
        mem_type: MemType,
        access: Access,
        name: &str,
    ) -> Result<MemHandle> {
        let r = self.running()?;
        let span = MemorySpan { addr: desc.addr, len: desc.len, domain: mem_type, memfd: None };
        let region = register_region(&r, span, access, name)?;
        Ok(MemHandle { id: region.id, addr: region.addr, len: region.len, mem_type })
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
        let span =
            MemorySpan { addr: mem.addr(), len: mem.len(), domain: MemType::Host, memfd: Some(mem.fd()) };
        let region = register_region(&r, span, Access::ReadWrite, name)?;
        r.allocated.lock().unwrap().insert(mem.addr(), mem.clone());
        Ok((MemHandle { id: region.id, addr: region.addr, len: region.len, mem_type: MemType::Host }, mem))
    }

    /// Deregisters a region, waiting for (then aborting) transfers that use it. Idempotent.
    pub fn deregister_mem(&self, h: &MemHandle) -> Result<()> {
        let r = self.running()?;
        let Some(region) = r.registry.deregister(h.addr, h.len, r.opts.deregister_timeout)? else {
            return Ok(());
        };
        if let Some(s) = &r.server {
            // Same-host peers copy without a target-side check: they must drop the region
            // from their tables before its memory may be freed.
            s.publish_regions(Some(r.opts.deregister_timeout))?;
        }
        run_deregister_hooks(&r, &region);
        r.allocated.lock().unwrap().remove(&h.addr);
        Ok(())
    }

    fn link_params(r: &Running, timeout: Duration) -> ConnectParams {
        ConnectParams {
            local_id: r.local_engine.clone(),
            streams: r.opts.streams,
            queue_depth: r.opts.queue_depth,
            timeout,
            host: r.host.clone(),
            coalesce: r.opts.coalesce,
            coalesce_max_ops: r.opts.coalesce_max_ops,
            secret: r.opts.secret.clone(),
            heartbeat: r.opts.heartbeat,
            data_mac: r.opts.data_mac,
            data_path: false,
        }
    }

    fn begin_connect(r: &Running, key: &str) -> Result<()> {
        let mut peers = r.peers.lock().unwrap();
        match peers.get(key) {
            Some(PeerSlot::Connected(c)) if c.link.is_alive() => {
                Err(Error::new(Status::AlreadyConnected, format!("already connected to {key}")))
            }
            Some(PeerSlot::Connecting) => Err(Error::new(
                Status::AlreadyConnected,
                format!("a connect to {key} is already in progress"),
            )),
            Some(PeerSlot::Connected(c)) => {
                // The old link died: close it (joins its threads) and connect anew.
                c.link.close(Error::not_connected(format!("link to {key} replaced")));
                peers.insert(key.to_string(), PeerSlot::Connecting);
                Ok(())
            }
            _ => {
                peers.insert(key.to_string(), PeerSlot::Connecting);
                Ok(())
            }
        }
    }

    /// Connects the control channel, then asks each backend of `hixl.backends` that the peer
    /// offers, in order, for a data path to it; the first that can serve it wins.
    fn open_link(r: &Running, key: &str, addr: SocketAddr, timeout: Duration) -> Result<PeerConn> {
        // The control channel needs one stream; a backend that moves data over TCP opens its own.
        let params = ConnectParams { streams: 1, ..Self::link_params(r, timeout) };
        let control = TcpLink::connect(key, addr, &params)?;
        let ctx = backend::OpenCtx { opts: &r.opts, addr, params: &params, host: &r.host, timeout };
        let mut not_chosen: Vec<String> = Vec::new();
        for b in &r.backends {
            let offer = match control.handshake().offer(b.name()) {
                None => Err("the peer does not offer it".to_string()),
                Some(o) if !o.domains.contains(&(Domain::Host, Domain::Host)) => {
                    Err("the peer offers it for other memory domains only".to_string())
                }
                Some(o) => b.connect(&ctx, &control, o),
            };
            match offer {
                Ok(link) => {
                    if not_chosen.is_empty() {
                        tracing::info!(peer = %key, backend = b.name(), "data path chosen");
                    } else {
                        tracing::info!(peer = %key, backend = b.name(), not_chosen = %not_chosen.join("; "), "data path chosen");
                    }
                    let (domains, not_chosen) = (b.domains(), not_chosen.join("; "));
                    return Ok(PeerConn {
                        control,
                        link,
                        domains,
                        not_chosen,
                        recent: Mutex::new(Vec::new()),
                    });
                }
                Err(why) => not_chosen.push(format!("{}: {why}", b.name())),
            }
        }
        let e = Error::new(
            Status::Unsupported,
            format!(
                "{key} cannot be reached directly or otherwise by hixl.backends={}: {}",
                r.opts.backends.join(","),
                not_chosen.join("; ")
            ),
        );
        control.close(e.clone());
        Err(e)
    }

    fn finish_connect(r: &Running, key: &str, res: Result<PeerConn>, keep_failure: bool) -> Result<()> {
        let mut peers = r.peers.lock().unwrap();
        match res {
            Ok(conn) => {
                tracing::info!(peer = %key, backend = conn.link.backend(), "connected");
                peers.insert(key.to_string(), PeerSlot::Connected(Arc::new(conn)));
                Ok(())
            }
            Err(e) => {
                if keep_failure {
                    tracing::warn!(peer = %key, error = %e, "async connect failed");
                    peers.insert(key.to_string(), PeerSlot::Failed);
                } else {
                    peers.remove(key);
                }
                Err(e)
            }
        }
    }

    /// Connects to the engine listening at `remote` ("ip:port"): handshake, region table.
    pub fn connect(&self, remote: &str, timeout: Duration) -> Result<()> {
        let r = self.running()?;
        let addr = parse_addr(remote)?;
        let key = remote.to_string();
        Self::begin_connect(&r, &key)?;
        let res = Self::open_link(&r, &key, addr, timeout);
        Self::finish_connect(&r, &key, res, false)
    }

    /// Starts a connect in the background; poll with [`Engine::get_async_connect_status`].
    pub fn connect_async(&self, remote: &str) -> Result<()> {
        let r = self.running()?;
        let addr = parse_addr(remote)?;
        let key = remote.to_string();
        Self::begin_connect(&r, &key)?;
        let timeout = r.opts.connect_timeout;
        let r2 = r.clone();
        std::thread::Builder::new()
            .name("hixl-connect".into())
            .spawn(move || {
                let res = Self::open_link(&r2, &key, addr, timeout);
                let _ = Self::finish_connect(&r2, &key, res, true);
            })
            .map_err(|e| Error::failed(format!("cannot start the connect thread: {e}")))?;
        Ok(())
    }

    /// The state of a connect to `remote`.
    pub fn get_async_connect_status(&self, remote: &str) -> Result<ConnectStatus> {
        let r = self.running()?;
        let peers = r.peers.lock().unwrap();
        Ok(match peers.get(remote) {
            None => ConnectStatus::NotConnect,
            Some(PeerSlot::Connecting) => ConnectStatus::Connecting,
            Some(PeerSlot::Connected(c)) if c.link.is_alive() => ConnectStatus::Connected,
            Some(_) => ConnectStatus::ConnectFailed,
        })
    }

    /// Closes the link to `remote`; its pending requests fail with NOT_CONNECTED.
    pub fn disconnect(&self, remote: &str, _timeout: Duration) -> Result<()> {
        let r = self.running()?;
        let slot = r.peers.lock().unwrap().remove(remote);
        match slot {
            Some(PeerSlot::Connected(c)) => {
                c.link.close(Error::not_connected(format!("disconnected from {remote}")));
                Ok(())
            }
            Some(PeerSlot::Failed) => Ok(()),
            Some(PeerSlot::Connecting) => {
                r.peers.lock().unwrap().insert(remote.to_string(), PeerSlot::Connecting);
                Err(Error::failed(format!("a connect to {remote} is in progress; wait for it first")))
            }
            None => Err(Error::not_connected(format!("not connected to {remote}"))),
        }
    }

    fn conn(r: &Running, remote: &str) -> Result<Arc<PeerConn>> {
        match r.peers.lock().unwrap().get(remote) {
            Some(PeerSlot::Connected(c)) if c.link.is_alive() => Ok(c.clone()),
            Some(PeerSlot::Connected(c)) => Err(Error::not_connected(format!(
                "the link to {remote} died: {}",
                c.link.dead_reason().unwrap_or_default()
            ))),
            _ => Err(Error::not_connected(format!("not connected to {remote}: call connect() first"))),
        }
    }

    /// The regions the peer has registered, as of the last region-table update this engine
    /// received from it (the peer pushes one after every registration and deregistration).
    pub fn remote_mems(&self, remote: &str) -> Result<Vec<MemDesc>> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        let table = c.control.table();
        Ok(table.regions().map(|r| MemDesc { addr: r.addr, len: r.len }).collect())
    }

    /// The peer's regions with their names, domains and access, as of its last region-table
    /// update.
    pub fn remote_regions(&self, remote: &str) -> Result<Vec<RemoteRegion>> {
        let r = self.running()?;
        let c = Self::conn(&r, remote)?;
        let table = c.control.table();
        Ok(table.regions().map(RemoteRegion::from).collect())
    }

    /// The peer's region registered under `name`. A name not in this engine's copy of the
    /// peer's table is asked for once (the peer may have registered it a moment ago);
    /// PARAM_INVALID naming it when the peer has no such region.
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

    /// Runs a batch and waits for it (up to `timeout`).
    pub fn transfer_sync(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        timeout: Duration,
    ) -> Result<()> {
        let req = self.transfer_async(remote, op, descs, None, Some(timeout))?;
        req.wait(None);
        req.result()
    }

    /// Validates and queues a batch; returns at once. `notify` is delivered to the peer after
    /// all of the batch's bytes are there. `timeout` (default `hixl.transfer_timeout_ms`) is the
    /// request's deadline.
    pub fn transfer_async(
        &self,
        remote: &str,
        op: TransferOp,
        descs: &[TransferOpDesc],
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        let r = self.running()?;
        let conn = Self::conn(&r, remote)?;
        if descs.is_empty() {
            return Err(Error::param("the descriptor list is empty"));
        }
        if let Some(n) = &notify {
            check_notify(n)?;
        }
        let write = op == TransferOp::Write;
        let (segs, pins, bytes) =
            with_fresh_table(&r, &conn, |miss| validate(&r, &conn, remote, descs, write, miss))?;
        let parts = split(segs, bytes, conn.link.parallelism(), r.opts.split_bytes);
        let bodies = parts.into_iter().map(PartBody::Data).collect();
        self.submit(&r, &conn, remote, op, bodies, bytes, descs.len(), pins, notify, timeout)
    }

    /// Makes the request for validated parts and queues them on the peer's link.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        r: &Running,
        conn: &PeerConn,
        remote: &str,
        op: TransferOp,
        bodies: Vec<PartBody>,
        bytes: u64,
        descs: usize,
        pins: Vec<Pin>,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        let timeout = timeout.unwrap_or(r.opts.transfer_timeout);
        let id = r.next_req.fetch_add(1, Ordering::Relaxed);
        let extra = usize::from(notify.is_some());
        let n = bodies.len();
        let req = Arc::new(Request::new(id, op, remote.to_string(), bytes, descs, n, timeout, pins, notify));
        let parts: Vec<Part> = bodies.into_iter().map(|body| Part { req: req.clone(), body }).collect();
        if let Err(e) = conn.link.submit(parts, extra) {
            req.settle(TransferStatus::Failed, Some(e.clone()));
            req.release_pins();
            return Err(e);
        }
        remember(conn, &req);
        Ok(req)
    }

    /// One-sided WRITE of `len` bytes, waiting up to `timeout`.
    pub fn put(
        &self,
        remote: &str,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_sync(
            remote,
            TransferOp::Write,
            &[TransferOpDesc { local_addr, remote_addr, len }],
            timeout,
        )
    }

    /// One-sided READ of `len` bytes, waiting up to `timeout`.
    pub fn get(
        &self,
        remote: &str,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<()> {
        self.transfer_sync(
            remote,
            TransferOp::Read,
            &[TransferOpDesc { local_addr, remote_addr, len }],
            timeout,
        )
    }

    /// Strided WRITE (see [`StridedDesc`]), waiting up to `timeout`.
    pub fn put_strided(
        &self,
        remote: &str,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        self.strided_sync(remote, TransferOp::Write, local_base, remote_base, d, timeout)
    }

    /// Strided READ (see [`StridedDesc`]), waiting up to `timeout`.
    pub fn get_strided(
        &self,
        remote: &str,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        self.strided_sync(remote, TransferOp::Read, local_base, remote_base, d, timeout)
    }

    fn strided_sync(
        &self,
        remote: &str,
        op: TransferOp,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        timeout: Duration,
    ) -> Result<()> {
        let req = self.strided_async(remote, op, local_base, remote_base, d, None, Some(timeout))?;
        req.wait(None);
        req.result()
    }

    /// Queues a strided transfer and returns at once: one request, one descriptor on the wire,
    /// expanded into segments only by the backend, a chunk at a time.
    #[allow(clippy::too_many_arguments)]
    pub fn strided_async(
        &self,
        remote: &str,
        op: TransferOp,
        local_base: u64,
        remote_base: u64,
        d: &StridedDesc,
        notify: Option<NotifyDesc>,
        timeout: Option<Duration>,
    ) -> Result<TransferReq> {
        let r = self.running()?;
        let conn = Self::conn(&r, remote)?;
        if let Some(n) = &notify {
            check_notify(n)?;
        }
        let write = op == TransferOp::Write;
        let (st, pins) = with_fresh_table(&r, &conn, |miss| {
            validate_strided(&r, &conn, remote, (local_base, remote_base), d, write, miss)
        })?;
        let shares = if st.bytes() >= r.opts.split_bytes { conn.link.parallelism() } else { 1 };
        let bodies: Vec<PartBody> = st.split(shares).into_iter().map(PartBody::Strided).collect();
        self.submit(&r, &conn, remote, op, bodies, st.bytes(), 1, pins, notify, timeout)
    }

    /// Status of a request (WAITING turns into TIMEOUT past its deadline).
    pub fn get_transfer_status(&self, req: &TransferReq) -> Result<TransferStatus> {
        Ok(req.status())
    }

    /// Sends a notification; it is delivered after the data of every transfer to the same peer
    /// submitted before it.
    pub fn send_notify(&self, remote: &str, n: NotifyDesc, timeout: Duration) -> Result<()> {
        let r = self.running()?;
        let conn = Self::conn(&r, remote).map_err(|e| {
            let died = matches!(r.peers.lock().unwrap().get(remote), Some(PeerSlot::Connected(_)));
            if died {
                Error::new(
                    Status::NotifyFailed,
                    format!("notify to {remote} cannot be delivered: {}", e.message),
                )
            } else {
                e
            }
        })?;
        check_notify(&n)?;
        let deadline = Instant::now() + timeout;
        let earlier: Vec<_> = conn.recent.lock().unwrap().iter().filter_map(|w| w.upgrade()).collect();
        for q in earlier {
            let left = deadline.saturating_duration_since(Instant::now());
            if q.wait(Some(left)) == TransferStatus::Waiting {
                return Err(Error::timeout(format!(
                    "notify to {remote}: an earlier transfer was still in flight after {timeout:?}"
                )));
            }
        }
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let id = r.next_req.fetch_add(1, Ordering::Relaxed);
        let req = Arc::new(Request::new(id, TransferOp::Write, remote.into(), 0, 0, 1, left, vec![], None));
        conn.link.submit(vec![Part { req: req.clone(), body: PartBody::Notify(n) }], 0)?;
        req.wait(None);
        req.result().map_err(|e| match e.status {
            Status::Timeout | Status::ResourceExhausted => e,
            _ => Error::new(Status::NotifyFailed, format!("notify to {remote} failed: {}", e.message)),
        })
    }

    /// Returns and clears the notifications received so far.
    pub fn get_notifies(&self) -> Result<Vec<NotifyDesc>> {
        Ok(self.running()?.notifies.take())
    }

    /// Per-peer counters.
    pub fn stats(&self) -> Result<Vec<PeerSnapshot>> {
        let r = self.running()?;
        let peers = r.peers.lock().unwrap();
        let mut out = Vec::new();
        for (peer, slot) in peers.iter() {
            if let PeerSlot::Connected(c) = slot {
                let s = c.link.stats();
                let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
                out.push(PeerSnapshot {
                    peer: peer.clone(),
                    backend: c.link.backend(),
                    not_chosen: c.not_chosen.clone(),
                    alive: c.link.is_alive(),
                    bytes_write: l(&s.bytes_write),
                    bytes_read: l(&s.bytes_read),
                    ops_write: l(&s.ops_write),
                    ops_read: l(&s.ops_read),
                    errors: l(&s.errors),
                    notifies: l(&s.notifies),
                    direct_parts: l(&s.direct_parts),
                    latency: s.latency(),
                });
            }
        }
        out.sort_by(|a, b| a.peer.cmp(&b.peer));
        Ok(out)
    }

    /// Number of registered regions.
    pub fn registered_count(&self) -> Result<usize> {
        Ok(self.running()?.registry.len())
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

/// Registers a region: every backend's registration hook first (its key travels in the region
/// table), then the registry, then the peers are told. A domain no backend serves is
/// UNSUPPORTED; a failed registration releases the keys already made.
fn register_region(r: &Running, span: MemorySpan, access: Access, name: &str) -> Result<Arc<Region>> {
    if !r.backends.iter().any(|b| b.domains().iter().any(|(local, _)| *local == span.domain)) {
        return Err(Error::new(
            Status::Unsupported,
            format!(
                "memory domain {} (MemType.{}) is served by no backend of hixl.backends={} (this build has: {})",
                span.domain.as_str(),
                span.domain.as_str().to_uppercase(),
                r.opts.backends.join(","),
                backend::BUILT.join(", ")
            ),
        ));
    }
    let mut keys: Vec<BackendKey> = Vec::new();
    let release = |keys: &[BackendKey]| {
        for k in keys {
            if let Some(b) = r.backends.iter().find(|b| b.name() == k.backend) {
                b.deregister(&span, &k.key);
            }
        }
    };
    for b in &r.backends {
        match b.register(&span) {
            Ok(Some(key)) => keys.push(BackendKey { backend: b.name().into(), key }),
            Ok(None) => {}
            Err(e) => {
                release(&keys);
                return Err(e);
            }
        }
    }
    let spec = RegionSpec {
        addr: span.addr,
        len: span.len,
        mem_type: span.domain,
        access,
        name: name.to_string(),
        keys: keys.clone(),
    };
    let (region, created) = match r.registry.register_spec(spec) {
        Ok(x) => x,
        Err(e) => {
            release(&keys);
            return Err(e);
        }
    };
    if !created {
        // The same range again: the existing region keeps its own keys.
        release(&keys);
        return Ok(region);
    }
    if let Some(s) = &r.server {
        s.publish_regions(None)?;
    }
    Ok(region)
}

/// Runs the backends' deregistration hooks for a region that left the registry.
fn run_deregister_hooks(r: &Running, region: &Region) {
    let span = MemorySpan { addr: region.addr, len: region.len, domain: region.mem_type, memfd: None };
    for k in &region.keys {
        if let Some(b) = r.backends.iter().find(|b| b.name() == k.backend) {
            b.deregister(&span, &k.key);
        }
    }
}

/// Whether the peer's data path moves data between these two memory domains.
fn check_domains(conn: &PeerConn, remote: &str, local: Domain, theirs: Domain) -> Result<()> {
    if conn.domains.contains(&(local, theirs)) {
        return Ok(());
    }
    Err(Error::new(
        Status::Unsupported,
        format!(
            "the {} backend chosen for {remote} does not move data between {} memory here and {} \
             memory there",
            conn.link.backend(),
            local.as_str(),
            theirs.as_str()
        ),
    ))
}

fn check_notify(n: &NotifyDesc) -> Result<()> {
    if n.name.len() > crate::wire::MAX_NAME || n.msg.len() > crate::wire::MAX_MSG {
        return Err(Error::param(format!(
            "notify name ({} bytes) or msg ({} bytes) is too long: the limits are {} and {} bytes",
            n.name.len(),
            n.msg.len(),
            crate::wire::MAX_NAME,
            crate::wire::MAX_MSG
        )));
    }
    Ok(())
}

fn remember(conn: &PeerConn, req: &Arc<Request>) {
    let mut recent = conn.recent.lock().unwrap();
    if recent.len() >= 256 {
        recent.retain(|w| w.upgrade().is_some_and(|q| q.status() == TransferStatus::Waiting));
    }
    recent.push(Arc::downgrade(req));
}

/// Runs a validation; when it failed only because a remote range is missing from our copy of
/// the peer's table, asks the peer for its current table once and validates again. A range
/// the peer registered a moment ago (and announced through another channel) then works,
/// while a wrong range still fails, one round trip later.
fn with_fresh_table<T>(
    r: &Running,
    conn: &PeerConn,
    mut check: impl FnMut(&mut bool) -> Result<T>,
) -> Result<T> {
    let mut miss = false;
    match check(&mut miss) {
        Err(e) if miss => {
            if conn.control.refresh_table(r.opts.handshake_timeout).is_err() {
                return Err(e);
            }
            check(&mut false)
        }
        other => other,
    }
}

/// Checks every descriptor, pins the local regions, merges adjacent descriptors.
fn validate(
    r: &Running,
    conn: &PeerConn,
    remote: &str,
    descs: &[TransferOpDesc],
    write: bool,
    remote_miss: &mut bool,
) -> Result<(Vec<SegPair>, Vec<Pin>, u64)> {
    let table = conn.control.table();
    let holder: Arc<dyn Abort> = conn.link.clone();
    let mut pins: Vec<Pin> = Vec::new();
    let mut segs: Vec<SegPair> = Vec::with_capacity(descs.len());
    let mut bytes = 0u64;
    for (i, d) in descs.iter().enumerate() {
        if d.len == 0 {
            return Err(Error::param(format!("descriptor {i}: length is 0")));
        }
        let pinned = pins.iter().position(|p| p.region().contains(d.local_addr, d.len));
        let local = match pinned {
            Some(k) => pins[k].region().mem_type,
            None => {
                let region = r
                    .registry
                    .lookup(d.local_addr, d.len, "local")
                    .map_err(|e| Error::param(format!("descriptor {i}: {}", e.message)))?;
                pins.push(region.pin(holder.clone())?);
                region.mem_type
            }
        };
        match table.find(d.remote_addr, d.len) {
            None => {
                *remote_miss = true;
                return Err(Error::param(format!(
                    "descriptor {i}: remote range 0x{:x}+{} is not inside a region registered at \
                     {remote} (as of its last region-table update)",
                    d.remote_addr, d.len
                )));
            }
            Some(e) if write && !e.writable => {
                return Err(Error::param(format!(
                    "descriptor {i}: {}",
                    read_only(d.remote_addr, d.len).message
                )))
            }
            Some(e) => check_domains(conn, remote, local, e.domain)
                .map_err(|e| e.context(&format!("descriptor {i}")))?,
        }
        bytes += d.len;
        push_merged(&mut segs, d);
    }
    Ok((segs, pins, bytes))
}

/// Checks a strided descriptor (counts, strides, 64-byte alignment, both spans inside one
/// registered region) and pins the local region.
fn validate_strided(
    r: &Running,
    conn: &PeerConn,
    remote: &str,
    (local_base, remote_base): (u64, u64),
    d: &StridedDesc,
    write: bool,
    remote_miss: &mut bool,
) -> Result<(Strided, Vec<Pin>)> {
    let rstride = d.remote_stride.unwrap_or(d.stride);
    if d.count == 0 {
        return Err(Error::param("count=0: a strided descriptor needs at least one element"));
    }
    if d.size == 0 {
        return Err(Error::param("size=0: elements need at least one byte"));
    }
    for (name, v) in [("stride", d.stride), ("remote_stride", rstride)] {
        if v < d.size {
            return Err(Error::param(format!(
                "{name}={v} is smaller than size={}: elements would overlap",
                d.size
            )));
        }
    }
    if r.opts.strict_alignment {
        for (name, v) in [
            ("local_base", local_base),
            ("remote_base", remote_base),
            ("stride", d.stride),
            ("remote_stride", rstride),
        ] {
            if v % 64 != 0 {
                return Err(Error::param(format!(
                    "{name}=0x{v:x} ({v}) is not a multiple of 64 bytes (hixl.strict_alignment=0 relaxes this)"
                )));
            }
        }
    }
    let span = |stride: u64| (d.count - 1).checked_mul(stride).and_then(|x| x.checked_add(d.size));
    let (Some(lspan), Some(rspan)) = (span(d.stride), span(rstride)) else {
        return Err(Error::param(format!(
            "count={} with these strides overflows the address space",
            d.count
        )));
    };
    d.count
        .checked_mul(d.size)
        .ok_or_else(|| Error::param(format!("count={} x size={} overflows", d.count, d.size)))?;
    let region = r.registry.lookup(local_base, lspan, "local strided").map_err(|e| {
        Error::param(format!("{} (the whole strided range must lie in one region)", e.message))
    })?;
    let pin = region.pin(conn.link.clone())?;
    match conn.control.table().find(remote_base, rspan) {
        None => {
            *remote_miss = true;
            return Err(Error::param(format!(
            "remote strided range 0x{remote_base:x}+{rspan} is not inside one region registered at {remote}"
        )));
        }
        Some(e) if write && !e.writable => return Err(read_only(remote_base, rspan)),
        Some(e) => check_domains(conn, remote, region.mem_type, e.domain)?,
    }
    let st = Strided {
        local: local_base,
        remote: remote_base,
        count: d.count,
        size: d.size,
        lstride: d.stride,
        rstride,
    };
    Ok((st, vec![pin]))
}

/// Appends a descriptor, extending the last segment when both sides continue it (public for
/// the hot-path benches).
pub fn push_merged(segs: &mut Vec<SegPair>, d: &TransferOpDesc) {
    match segs.last_mut() {
        Some(p) if p.local + p.len == d.local_addr && p.remote + p.len == d.remote_addr => p.len += d.len,
        _ => segs.push(SegPair { local: d.local_addr, remote: d.remote_addr, len: d.len }),
    }
}

/// Cuts merged segments into parts: one per stream for large batches (splitting segments at
/// the boundaries), never more than `MAX_DESCS` segments per part.
pub fn split(segs: Vec<SegPair>, bytes: u64, streams: usize, split_bytes: u64) -> Vec<Vec<SegPair>> {
    let shares = if bytes >= split_bytes && streams > 1 { streams as u64 } else { 1 };
    let per = bytes.div_ceil(shares).max(1);
    let mut parts = Vec::new();
    let mut cur: Vec<SegPair> = Vec::new();
    let mut cur_bytes = 0u64;
    for mut s in segs {
        while s.len > 0 {
            let room = per - cur_bytes;
            let take = s.len.min(room);
            cur.push(SegPair { local: s.local, remote: s.remote, len: take });
            cur_bytes += take;
            s.local += take;
            s.remote += take;
            s.len -= take;
            if cur_bytes == per || cur.len() == MAX_DESCS {
                parts.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        parts.push(cur);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(local: u64, remote: u64, len: u64) -> SegPair {
        SegPair { local, remote, len }
    }

    #[test]
    fn adjacent_descriptors_merge_into_one_segment() {
        let d = |l, r, n| TransferOpDesc { local_addr: l, remote_addr: r, len: n };
        let mut segs = Vec::new();
        // 4 blocks contiguous on both sides, then one contiguous only locally, then a gap.
        for x in
            [d(0, 1000, 10), d(10, 1010, 10), d(20, 1020, 5), d(25, 1025, 5), d(30, 2000, 8), d(50, 2008, 2)]
        {
            push_merged(&mut segs, &x);
        }
        assert_eq!(segs, vec![sp(0, 1000, 30), sp(30, 2000, 8), sp(50, 2008, 2)]);
    }

    #[test]
    fn split_small_batch_is_one_part() {
        let p = split(vec![sp(0, 100, 10), sp(50, 200, 10)], 20, 2, 1 << 20);
        assert_eq!(p, vec![vec![sp(0, 100, 10), sp(50, 200, 10)]]);
    }

    #[test]
    fn split_large_batch_cuts_segments_evenly() {
        let p = split(vec![sp(0, 1000, 30), sp(100, 2000, 10)], 40, 2, 16);
        assert_eq!(p, vec![vec![sp(0, 1000, 20)], vec![sp(20, 1020, 10), sp(100, 2000, 10)]]);
        let total: u64 = p.iter().flatten().map(|s| s.len).sum();
        assert_eq!(total, 40);
    }

    #[test]
    fn split_caps_segments_per_part() {
        let segs: Vec<_> = (0..(MAX_DESCS as u64 + 5)).map(|i| sp(i * 2, i * 2, 1)).collect();
        let n = segs.len() as u64;
        let p = split(segs, n, 1, u64::MAX);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].len(), MAX_DESCS);
        assert_eq!(p[1].len(), 5);
    }
}
