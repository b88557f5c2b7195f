//! Same-host backend: cross-memory attach. `process_vm_writev` / `process_vm_readv` copy
//! between this process's registered memory and the peer's in one system call per 1024
//! segments, with the peer doing nothing: one-sided, no intermediate copy.
//!
//! Trust model: CMA needs ptrace permission over the peer (same user, or CAP_SYS_PTRACE), which
//! already allows reading and writing all of its memory. The peer is the process that proved it
//! accepted this link's stream (`same_host::proof::prove`), never one named by a claim, and one whose
//! later exec cannot turn our copies into access it lacks (`exec_rule`). There is no
//! target-side check on this path, so the initiator checks every remote range against the
//! table that process sent, while it holds that table's read guard; the target publishes
//! changes and waits for the acknowledgement before memory is freed (see
//! `Server::publish_regions`).

pub mod shared_mem;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLockReadGuard};
use std::time::Duration;

use crate::complete::Completer;
use crate::error::{Error, Result, Status};
use crate::options::{int, spec, BackendDecl, HostFacts, Reach};
use crate::queue::{Part, PartBody, Request, SegPair, TransferOp, TransferStatus, WaitHelp, WorkQueue};
use crate::registry::{new_holder_id, Abort, RemoteTable};
use crate::stats::PeerStats;
use crate::sys;
use crate::sys::memfd::{self, Mapping};
use crate::transport::backend::{with_local_socket, Backend, MemorySpan, OpenCtx, HOST_TO_HOST};
use crate::transport::control::channel::ControlChannel;
use crate::transport::io::IOV_MAX;
use crate::transport::reactor::copy_pool::{CopyPool, Task};
use crate::transport::same_host::proof::{exited, get_fd, Proven};
use crate::transport::same_host::prove_same_host;
use crate::transport::DataPath;
use crate::wire::RegionEntry;
use crate::wire::{Capability, Domain};

pub use self::shared_mem::SharedMem;
use self::shared_mem::REQUIRED_SEALS;

/// The backend's name, as `hixl.backends` and `stats()` spell it.
pub(crate) const NAME: &str = "shm";

/// The `shm` backend's declaration: its entry in the one table (`transport::backends`).
pub(crate) const DECL: BackendDecl = BackendDecl {
    name: NAME,
    meaning: "same host",
    reach: Reach::Host,
    domains: "host",
    offered: "",
    cli: true,
    baseline: "cma",
    options: &[spec(
        "hixl.shm.threads",
        "0",
        "copy threads of the engine, shared by every same-host link (0 = one per two cores, 2 to 8)",
        |o, k, v| {
            o.shm_threads = int(k, v, 0, 64)? as usize;
            Ok(())
        },
    )],
    host_facts,
};
/// What `hixl info` tells of `shm` here: with Yama's `ptrace_scope` above 0, cross-memory
/// attach reaches only this process's descendants (others need a direct mapping or fall back).
fn host_facts() -> HostFacts {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok();
    let note = match scope.as_deref().map(str::trim) {
        None | Some("0") => String::new(),
        Some(s) => format!(
            "kernel.yama.ptrace_scope={s}: peers that are not this process's descendants may fall back to tcp"
        ),
    };
    HostFacts { usable: None, note }
}

/// A part of up to this size is small: a copy worker busy with it looks at the run queue again
/// within microseconds, so another small part need not wake a second worker. Fixed, like the
/// ones below; `hixl.shm.threads` is the knob for large copies.
const INLINE_BYTES: u64 = 256 * 1024;
/// The largest part a calling or waiting thread copies itself (a synchronous request of one
/// part on the calling thread, queued parts by a waiter): about a millisecond here, so that a
/// waiter's timeout and Ctrl-C (checked every 50 ms from Python) are never held up by a copy
/// much longer than that. Larger parts go to the copy workers while the caller sleeps.
const HELP_BYTES: u64 = 8 << 20;
/// How often a copy asks the peer's pidfd whether the process still lives (see `peer_exited`).
const EXIT_CHECK_EVERY: Duration = Duration::from_millis(10);
/// A worker stops taking parts once it holds this many bytes.
const BATCH_BYTES: u64 = 4 << 20;

/// This machine's identity: kernel boot id and host name. Equal strings mean the same kernel.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let node = crate::sys::nodename();
    format!("{}/{}", boot.trim(), node)
}

use crate::sys::mem::PinnedMemory;
use crate::sys::vm::cma;

/// A peer's engine-allocated region mapped into this process.
pub(crate) struct PeerMapping {
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// Unmapped when the last `Arc` drops.
    _map: Mapping,
}

// SAFETY: the mapping (`map_peer_region`) is of a memfd sealed against shrinking and growing
// and at least `len` bytes long, so every byte of `[base, base+len)` stays mapped, readable
// and writable (never SIGBUS) until the value drops and unmaps it; Rust holds no references
// into it (peers and this process reach it only by address).
unsafe impl PinnedMemory for PeerMapping {
    #[inline]
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|e| e <= self.base + self.len)
    }
}

/// The owner's memfd descriptor of a region it allocated: the `shm` backend's registration key.
pub(crate) fn memfd_key(e: &RegionEntry) -> Option<i32> {
    let fd = i32::from_le_bytes(e.key(NAME)?.try_into().ok()?);
    (fd >= 0).then_some(fd)
}

/// Maps a same-host peer's memfd region. The descriptor is taken from the proven process itself
/// (`pidfd_getfd`: the very object it holds, never a path reopened), and mapped only when it is
/// a memfd sealed against shrinking and growing, at least as long as the region.
pub(crate) fn map_peer_region(pidfd: &OwnedFd, e: &RegionEntry, fd: i32) -> std::io::Result<PeerMapping> {
    let f = std::fs::File::from(get_fd(pidfd, fd)?);
    // Fails (EINVAL) on anything but a memfd/shmem file.
    let Ok(seals) = memfd::seals(&f) else {
        return Err(std::io::Error::other(format!("descriptor {} of the peer is not a memfd", fd)));
    };
    if seals & REQUIRED_SEALS != REQUIRED_SEALS {
        return Err(std::io::Error::other(format!(
            "the peer's memfd {} is not sealed against shrinking and growing",
            fd
        )));
    }
    if f.metadata()?.len() < e.len {
        return Err(std::io::Error::other(format!("the peer's memfd {} is smaller than the region", fd)));
    }
    let map = Mapping::shared(&f, e.len)?;
    Ok(PeerMapping { base: map.addr(), len: map.len(), _map: map })
}

/// A same-host link: data by CMA (or by memcpy through a mapping, for the peer's
/// engine-allocated regions), control (handshake, notifications) over the TCP link.
pub struct ShmLink {
    /// This link as a holder of region pins.
    holder_id: u64,
    tcp: Arc<dyn ControlChannel>,
    pid: i32,
    /// Mapped peer regions by registry id (ids are never reused, so a stale entry can never
    /// stand for new memory at the same address).
    maps: Mutex<std::collections::HashMap<u64, Arc<PeerMapping>>>,
    /// Cleared after a mapping failed: CMA only from then on.
    direct_ok: AtomicBool,
    /// The proven peer process.
    pidfd: OwnedFd,
    /// The engine's copy workers, shared by every same-host link.
    pool: Arc<CopyPool>,
    /// This link, as the pool's task (set at construction).
    me: std::sync::Weak<ShmLink>,
    queue: WorkQueue<Part>,
    closed: AtomicBool,
    /// Settles the requests whose data this link copied.
    done: Completer,
    /// When the link was made, and (nanoseconds after that) when the peer was last seen alive.
    born: std::time::Instant,
    alive_at: std::sync::atomic::AtomicU64,
}

impl ShmLink {
    /// Wraps a connected TCP link whose peer proved it is the process `proven`; its copies
    /// larger than a small request run on `pool`.
    pub fn new(
        tcp: Arc<dyn ControlChannel>,
        proven: Proven,
        pool: Arc<CopyPool>,
        queue_depth: usize,
    ) -> Result<Arc<ShmLink>> {
        let Proven { pid, pidfd, .. } = proven;
        let done = Completer::new(NAME, &tcp.peer_info().engine_id, tcp.stats());
        Ok(Arc::new_cyclic(|me| ShmLink {
            holder_id: new_holder_id(),
            tcp,
            pid,
            maps: Mutex::new(std::collections::HashMap::new()),
            direct_ok: AtomicBool::new(true),
            pidfd,
            pool,
            me: me.clone(),
            queue: WorkQueue::new(queue_depth),
            closed: AtomicBool::new(false),
            done,
            born: std::time::Instant::now(),
            alive_at: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Whether the peer process has exited, asked of its pidfd at most every
    /// `EXIT_CHECK_EVERY`. A copy to a process that is gone fails with ESRCH by itself; the
    /// check is there so that its pid cannot meanwhile name another process, and a pid is
    /// reused only after the kernel has handed out every other free one (at least thousands of
    /// forks), which takes far longer than the interval.
    fn peer_exited(&self) -> bool {
        let now = self.born.elapsed().as_nanos() as u64;
        let last = self.alive_at.load(Ordering::Relaxed);
        if now.saturating_sub(last) < EXIT_CHECK_EVERY.as_nanos() as u64 {
            return false;
        }
        if exited(&self.pidfd) {
            return true;
        }
        self.alive_at.store(now, Ordering::Relaxed);
        false
    }

    /// Copies one part, holding the peer's region table so that it cannot change meanwhile.
    fn execute(&self, part: &Part) -> Result<()> {
        if matches!(part.body, PartBody::Notify(_)) {
            return Err(Error::failed("a notification reached the copy path"));
        }
        if !self.is_alive() {
            return Err(self.reason());
        }
        if self.peer_exited() {
            let err = Error::not_connected(format!("peer process {} exited", self.pid));
            self.close(err.clone());
            return Err(err);
        }
        let op = part.req.op;
        let Some(local) = part.memory() else {
            return Err(crate::queue::unpinned_part());
        };
        let table: RwLockReadGuard<'_, RemoteTable> = self.tcp.table();
        let res = match &part.body {
            PartBody::Data(segs) => self.copy_segs(&table, op, &**local, segs),
            PartBody::Strided(st) => st.for_each_chunk(IOV_MAX, |c| self.copy_segs(&table, op, &**local, c)),
            PartBody::Notify(_) => Ok(()),
        };
        drop(table);
        if let Err(e) = &res {
            if e.status == Status::NotConnected {
                self.close(e.clone());
            }
        }
        res
    }

    /// Checks the segments against the peer's table (whose guard the caller holds), then
    /// copies them through mappings of the peer's memory where possible, else by CMA. Each
    /// local range must lie in `local` (the part's pins), or nothing more is copied.
    fn copy_segs(
        &self,
        table: &RemoteTable,
        op: TransferOp,
        local: &dyn PinnedMemory,
        segs: &[SegPair],
    ) -> Result<()> {
        for s in segs {
            match table.find(s.remote, s.len) {
                None => {
                    return Err(Error::param(format!(
                        "remote range 0x{:x}+{} is no longer registered at the peer",
                        s.remote, s.len
                    )))
                }
                // Checked here as well as at submit: the region may have been registered again,
                // read-only, since.
                Some(e) if op == TransferOp::Write && !e.writable => {
                    return Err(crate::registry::read_only(s.remote, s.len))
                }
                Some(_) => {}
            }
        }
        match self.direct_mappings(table, segs) {
            Some(maps) => {
                self.copy_direct(op, local, segs, &maps)?;
                self.tcp.stats().direct_parts.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            None => cma(self.pid, op, local, segs),
        }
    }

    /// For every segment, the mapping of the peer region it lies in, when all of them lie in
    /// engine-allocated regions that could be mapped; None means: use CMA.
    fn direct_mappings(&self, table: &RemoteTable, segs: &[SegPair]) -> Option<Vec<(Arc<PeerMapping>, u64)>> {
        if !self.direct_ok.load(Ordering::Relaxed) {
            return None;
        }
        // Most copies go to memory the peer registered, not allocated: CMA, decided before any
        // lock or allocation (the loop below asks every segment again).
        memfd_key(table.find(segs.first()?.remote, segs[0].len)?)?;
        let mut maps = self.maps.lock().unwrap();
        if maps.len() > table.len() {
            let ids: std::collections::HashSet<u64> = table.regions().map(|r| r.id).collect();
            maps.retain(|id, _| ids.contains(id));
        }
        let mut out: Vec<(Arc<PeerMapping>, u64)> = Vec::with_capacity(segs.len());
        let mut last: Option<(u64, Arc<PeerMapping>, u64)> = None; // (id, mapping, region addr)
        for s in segs {
            let e = table.find(s.remote, s.len)?;
            let fd = memfd_key(e)?;
            if let Some((id, m, base)) = &last {
                if *id == e.id {
                    out.push((m.clone(), *base));
                    continue;
                }
            }
            // A cached mapping serves only an entry it covers whole: the peer may have sent a
            // table that changed this id's length since (a hostile peer), and the copy must
            // never run past what was mapped; a fresh mapping checks the memfd's size again.
            let m = match maps.get(&e.id) {
                Some(m) if m.len >= e.len => m.clone(),
                _ => match map_peer_region(&self.pidfd, e, fd) {
                    Ok(m) => {
                        let m = Arc::new(m);
                        maps.insert(e.id, m.clone());
                        m
                    }
                    Err(err) => {
                        tracing::info!(pid = self.pid, error = %err, "cannot map the peer's memory; using CMA");
                        self.direct_ok.store(false, Ordering::Relaxed);
                        return None;
                    }
                },
            };
            last = Some((e.id, m.clone(), e.addr));
            out.push((m, e.addr));
        }
        Some(out)
    }

    /// Copies every segment through the mapping of its peer region (the remote range lies in
    /// the region, checked against the table under its read guard, so in the mapping; both
    /// sides are checked again by `copy_covered`). Memmove tolerates the odd case of both
    /// sides naming one memfd.
    fn copy_direct(
        &self,
        op: TransferOp,
        local: &dyn PinnedMemory,
        segs: &[SegPair],
        maps: &[(Arc<PeerMapping>, u64)],
    ) -> Result<()> {
        for (s, (m, base)) in segs.iter().zip(maps) {
            let remote = m.base + (s.remote - base);
            let copied = match op {
                TransferOp::Write => sys::mem::copy_covered(&**m, remote, local, s.local, s.len),
                TransferOp::Read => sys::mem::copy_covered(local, s.local, &**m, remote, s.len),
            };
            if !copied {
                return Err(sys::mem::not_covered(s.local, s.len));
            }
        }
        Ok(())
    }

    /// Why the link is closed, with the status of the close (FAILED after finalize,
    /// NOT_CONNECTED when the peer went away or was disconnected).
    fn reason(&self) -> Error {
        let why = self.tcp.close_reason();
        Error::new(why.status, format!("the link to pid {} is closed: {}", self.pid, why.message))
    }

    fn finish_part(&self, part: Part, res: Result<()>) {
        self.tcp.finish_after(&self.done, part, res);
    }

    /// Puts a part a waiter popped but will not copy back in the queue (at its end) for the
    /// workers; copies it here after all if its slot was taken meanwhile or the link closed.
    fn requeue(&self, part: Part) {
        if self.queue.reserve(1).is_err() || self.queue.is_closed() {
            self.run_part(part);
            return;
        }
        self.queue.push_reserved(part);
        if self.queue.is_closed() {
            // Closed meanwhile: `close` may have drained the queue before this push.
            self.fail_queued();
            return;
        }
        if let Some(me) = self.me.upgrade() {
            let task: Arc<dyn Task> = me;
            self.pool.push(&task, 1, false);
        }
    }

    /// Copies one queued part (unless its request already ended) and settles it.
    fn run_part(&self, part: Part) {
        let res = if part.req.status() == TransferStatus::Waiting {
            self.execute(&part)
        } else {
            Err(part.req.error().unwrap_or_else(|| Error::timeout("request ended before it ran")))
        };
        self.finish_part(part, res);
    }

    fn fail_queued(&self) {
        let err = self.reason();
        while let Some(p) = self.queue.pop() {
            self.finish_part(p, Err(err.clone()));
        }
    }
}

impl DataPath for ShmLink {
    fn backend(&self) -> &'static str {
        NAME
    }

    fn parallelism(&self) -> usize {
        self.pool.workers()
    }

    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        if !self.is_alive() {
            return Err(self.reason());
        }
        // A one-part request (up to HELP_BYTES) whose caller waits for it at once is copied
        // here: a hand-off to a worker would only add a wake-up. Otherwise the workers copy,
        // so that the parts of a split request run in parallel and the caller's next requests
        // overlap this one (and a thread that waits for it helps: `WaitHelp`).
        let one = parts.len() == 1 && !matches!(parts[0].body, PartBody::Notify(_));
        if one && parts[0].req.waited_at_once && parts[0].body.bytes() <= HELP_BYTES {
            let part = parts.into_iter().next().unwrap();
            let res = self.execute(&part);
            self.finish_part(part, res);
            return Ok(());
        }
        self.queue.reserve(parts.len())?;
        let n = parts.len();
        let small = parts.iter().all(|p| p.body.bytes() <= INLINE_BYTES);
        for p in parts {
            self.queue.push_reserved(p);
        }
        if self.queue.is_closed() {
            self.fail_queued();
            return Ok(());
        }
        if let Some(me) = self.me.upgrade() {
            let task: Arc<dyn Task> = me;
            self.pool.push(&task, n, small);
        }
        Ok(())
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && self.tcp.is_alive()
    }

    fn dead_reason(&self) -> Option<String> {
        self.tcp.dead_reason()
    }

    fn close(&self, why: Error) {
        // The control link first: it records why, so that a caller that sees this link closed
        // gets that reason.
        self.tcp.close(why);
        self.closed.store(true, Ordering::Release);
        self.queue.close();
        self.fail_queued();
        self.maps.lock().unwrap().clear();
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.tcp.stats()
    }

    fn queue_slots(&self) -> (usize, usize) {
        (self.queue.in_use(), self.queue.capacity())
    }

    fn wait_help(self: Arc<Self>) -> Option<std::sync::Weak<dyn WaitHelp>> {
        let me: Arc<dyn WaitHelp> = self;
        Some(Arc::downgrade(&me))
    }
}

/// A thread that waits for a request copies queued parts itself (its own among them) rather
/// than sleep until a worker did: a request submitted and then waited for costs no hand-off
/// when no worker is free, the shares of a split request start at once even while a worker
/// still wakes up (on this VM a wake-up took 50-100 µs, a fifth of an 8 MiB share), and a
/// waiter never idles while copies are queued.
impl WaitHelp for ShmLink {
    fn help(&self, req: &Request, until: std::time::Instant) {
        while req.status() == TransferStatus::Waiting && std::time::Instant::now() < until {
            let Some(part) = self.queue.pop() else { return };
            if part.body.bytes() > HELP_BYTES {
                // Too long to copy here (see HELP_BYTES): back to the workers, and wait.
                self.requeue(part);
                return;
            }
            self.run_part(part);
        }
    }
}

impl Task for ShmLink {
    /// Copies one batch of queued parts (a few MiB at most, so that links take turns).
    fn run_batch(&self) -> bool {
        let mut taken = 0u64;
        let mut batch = Vec::new();
        while batch.len() < 64 && taken < BATCH_BYTES {
            match self.queue.pop() {
                Some(p) => {
                    taken += p.body.bytes();
                    batch.push(p);
                }
                None => break,
            }
        }
        // A long batch holds this worker for a while: small parts pushed meanwhile wake another.
        let _long = (taken > INLINE_BYTES).then(|| self.pool.long_batch());
        for part in batch {
            self.run_part(part);
        }
        !self.queue.is_empty()
    }
}

impl Abort for ShmLink {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}

/// Same host: cross-memory attach and sealed memfd mappings, after the same-host proof. Its
/// registration key is the memfd's descriptor number in the owner (for `alloc`ed memory).
pub(crate) struct Shm;

impl Backend for Shm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        HOST_TO_HOST
    }

    fn capability(&self, local_socket: &str) -> Option<Capability> {
        with_local_socket(self, local_socket)
    }

    fn register(&self, mem: &MemorySpan) -> Result<Option<Vec<u8>>> {
        Ok(mem.memfd().map(|fd| fd.to_le_bytes().to_vec()))
    }

    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        let proven = prove_same_host(ctx, control.as_ref(), &offer.param)?;
        let pool = ctx.params.reactor.copy_pool(ctx.opts.shm_workers()).map_err(|e| e.message)?;
        let link =
            ShmLink::new(control.clone(), proven, pool, ctx.opts.queue_depth).map_err(|e| e.message)?;
        Ok(link)
    }
}
