//! The `cuda_ipc` data path to one same-host peer. Parts between host memory on both sides go
//! to an inner `ShmLink` (cross-memory attach, unchanged); every part that touches device
//! memory is translated into copies between addresses of this process and issued on the
//! engine's stream pool (`cuda::runtime::Gpu`), whose one completion thread reports it:
//!
//! - a peer's device region: its allocation opened once by IPC handle (`cuIpcOpenMemHandle`,
//!   cached in `HandleCache`), plus the region's offset from the key;
//! - a peer's host region, when this side's memory is on the device: the peer's memfd (only
//!   `alloc`ed regions have one), mapped as `shm` maps it and pinned with `cuMemHostRegister`,
//!   so the GPU copies straight into it. A peer host region without a memfd cannot be reached
//!   from device memory (the documented exception: the GPU cannot reach another process's
//!   pageable memory) and is refused with UNSUPPORTED.
//!
//! As for `shm`, there is no target-side check: every remote range is checked against the
//! proven peer's table, under its read guard, before a copy is issued.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::complete::Completer;
use crate::cuda::cache::HandleCache;
use crate::cuda::driver::owned::HostRegistration;
use crate::cuda::driver::{self, CuDevicePtr};
use crate::cuda::hold::try_hold;
use crate::cuda::key::IpcKey;
use crate::cuda::runtime::{Gpu, GpuSlot};
use crate::cuda::{ipc_open, ipc_release, CtxGuard};
use crate::error::{Error, Result, Status};
use crate::queue::{Part, PartBody, SegPair, TransferOp};
use crate::registry::{new_holder_id, Abort, RemoteTable};
use crate::stats::PeerStats;
use crate::transport::backends::shm::{map_peer_region, memfd_key, PeerMapping, ShmLink};
use crate::transport::control::channel::ControlChannel;
use crate::transport::DataPath;
use crate::wire::{Domain, RegionEntry};

/// How long `close` waits for copies already on the GPU before it gives up on releasing
/// the peer's mappings (they are then left open: a leak, never a use after free).
const DRAIN: Duration = Duration::from_secs(10);

/// A peer's memfd region mapped here and pinned for the GPU: the registration is declared
/// first, so it is dropped (unregistered) before the mapping is unmapped.
struct PinnedPeerHost {
    _registration: HostRegistration,
    map: PeerMapping,
}

/// The data path (see the module doc).
pub(crate) struct CudaIpcLink {
    holder_id: u64,
    tcp: Arc<dyn ControlChannel>,
    shm: Arc<ShmLink>,
    /// The engine's `Gpu`, made on the first device copy.
    slot: Arc<GpuSlot>,
    streams: usize,
    pid: i32,
    pidfd: OwnedFd,
    /// Peer allocations opened by IPC handle: (handle, base address here, bytes the driver
    /// mapped from there).
    opened: Mutex<HandleCache<([u8; 64], CuDevicePtr, u64)>>,
    /// Peer memfd regions mapped and pinned, by region id.
    hosts: Mutex<HashMap<u64, Arc<PinnedPeerHost>>>,
    done: Arc<Completer>,
    closed: AtomicBool,
    /// Held (shared) while a submit issues copies, taken (exclusive) by `close` before it
    /// waits for them: no copy can be issued after `close` started waiting.
    issuing: RwLock<()>,
}

impl CudaIpcLink {
    /// Wraps a proven same-host link (`shm` carries its host-to-host parts); `pidfd` is a
    /// descriptor of the proven peer process (for its memfds).
    pub(crate) fn new(
        tcp: Arc<dyn ControlChannel>,
        shm: Arc<ShmLink>,
        slot: Arc<GpuSlot>,
        streams: usize,
        pid: i32,
        pidfd: OwnedFd,
    ) -> Arc<Self> {
        let done = Arc::new(Completer::new(super::NAME, &tcp.peer_info().engine_id, tcp.stats()));
        Arc::new(CudaIpcLink {
            holder_id: new_holder_id(),
            tcp,
            shm,
            slot,
            streams,
            pid,
            pidfd,
            opened: Mutex::new(HandleCache::new()),
            hosts: Mutex::new(HashMap::new()),
            done,
            closed: AtomicBool::new(false),
            issuing: RwLock::new(()),
        })
    }

    /// The engine's Gpu (made on the first device copy), with its device's context current
    /// on this thread until the guard drops.
    fn ready(&self) -> Result<(Arc<Gpu>, CtxGuard)> {
        let gpu = self.slot.get(self.streams)?;
        let ctx = CtxGuard::enter(gpu.driver(), gpu.ordinal)?;
        Ok((gpu, ctx))
    }

    fn reason(&self) -> Error {
        let why = self.tcp.close_reason();
        Error::new(why.status, format!("the cuda_ipc link to pid {} is closed: {}", self.pid, why.message))
    }

    /// Whether a segment is host memory on both sides (then `shm` carries it). A range missing
    /// from the table counts as host: `shm` refuses it with the usual error.
    fn host_pair(&self, table: &RemoteTable, s: &SegPair) -> bool {
        table.find(s.remote, s.len).is_none_or(|e| e.domain == Domain::Host)
            && !(self.slot.has_device() && is_device_ptr(s.local))
    }

    /// Sorts one part: host-to-host goes to `host`, the rest to `dev`. A data part with both
    /// kinds of segments becomes two parts of its request.
    fn route(&self, table: &RemoteTable, p: Part, host: &mut Vec<Part>, dev: &mut Vec<Part>) {
        let (hs, ds): (Vec<SegPair>, Vec<SegPair>) = match &p.body {
            PartBody::Data(segs) => segs.iter().partition(|s| self.host_pair(table, s)),
            PartBody::Strided(st) if self.host_pair(table, &st.seg(0)) => return host.push(p),
            _ => return dev.push(p),
        };
        match (hs.is_empty(), ds.is_empty()) {
            (_, true) => host.push(p),
            (true, false) => dev.push(p),
            (false, false) => {
                p.req.add_parts(1);
                host.push(p.share(PartBody::Data(hs)));
                dev.push(p.share(PartBody::Data(ds)));
            }
        }
    }

    /// The copies of one part as (destination, source) pairs of this process's addresses,
    /// every remote range checked against the peer's table.
    fn translate(
        &self,
        gpu: &Gpu,
        table: &RemoteTable,
        op: TransferOp,
        segs: &[SegPair],
        out: &mut Vec<SegPair>,
    ) -> Result<()> {
        for s in segs {
            let e = match table.find(s.remote, s.len) {
                None => {
                    return Err(Error::param(format!(
                        "remote range 0x{:x}+{} is no longer registered at the peer",
                        s.remote, s.len
                    )))
                }
                Some(e) if op == TransferOp::Write && !e.writable => {
                    return Err(crate::registry::read_only(s.remote, s.len))
                }
                Some(e) => e,
            };
            let here = match e.domain {
                Domain::Host => self.host_mapping(gpu, e)? + (s.remote - e.addr),
                _ => self.device_mapping(gpu, e)? + (s.remote - e.addr),
            };
            out.push(match op {
                TransferOp::Write => SegPair { local: here, remote: s.local, len: s.len },
                TransferOp::Read => SegPair { local: s.local, remote: here, len: s.len },
            });
        }
        Ok(())
    }

    /// Where the peer's device region `e` starts in this process (its allocation opened once).
    fn device_mapping(&self, gpu: &Gpu, e: &RegionEntry) -> Result<u64> {
        let key = e.key(super::NAME).ok_or_else(|| {
            Error::new(
                Status::Unsupported,
                format!(
                    "the peer's device region 0x{:x}+{} has no cuda_ipc key (memory a legacy IPC handle cannot export, \
                     e.g. a VMM or pool allocation)",
                    e.addr, e.len
                ),
            )
        })?;
        let k = IpcKey::decode(key, e.len).map_err(Error::param)?;
        let d = gpu.driver();
        let mut opened = self.opened.lock().unwrap();
        // Opened in our device's context (the caller holds a CtxGuard).
        let (_, base, len) = opened
            .get_or_open(&k.handle, k.alloc_len, e.id, || {
                ipc_open(d, &k.handle).map(|(p, len)| (k.handle, p, len))
            })
            .map_err(|m| {
                Error::new(Status::Unsupported, format!("cannot open the peer's device memory: {m}"))
            })?;
        // The key's allocation length is the peer's word; the driver's is the truth.
        k.check_opened(e.len, len).map_err(Error::param)?;
        Ok(base + k.offset)
    }

    /// Where the peer's host region `e` starts in this process: its memfd mapped and pinned.
    fn host_mapping(&self, gpu: &Gpu, e: &RegionEntry) -> Result<u64> {
        let mut hosts = self.hosts.lock().unwrap();
        if let Some(h) = hosts.get(&e.id) {
            if h.map.len < e.len {
                // Region ids are never reused: a peer that grows one contradicts itself. The
                // old mapping may be in use, so it stays, and the copy is refused.
                return Err(Error::param(format!(
                    "the peer's region {} grew from {} to {} bytes under the same id",
                    e.id, h.map.len, e.len
                )));
            }
            return Ok(h.map.base);
        }
        let fd = memfd_key(e).ok_or_else(|| {
            Error::new(
                Status::Unsupported,
                format!(
                    "device memory here cannot reach the peer's host region 0x{:x}+{}: only host memory the peer \
                     allocated with alloc (a memfd) can be mapped for the GPU",
                    e.addr, e.len
                ),
            )
        })?;
        let map = map_peer_region(&self.pidfd, e, fd).map_err(|err| {
            Error::new(Status::Unsupported, format!("cannot map the peer's memfd region: {err}"))
        })?;
        // A fresh shared mapping of `map.len` bytes that we own until it is unregistered.
        let registration =
            HostRegistration::new(gpu.driver(), gpu.ordinal, map.base, map.len, Status::Unsupported)?;
        let h = Arc::new(PinnedPeerHost { _registration: registration, map });
        hosts.insert(e.id, h.clone());
        Ok(h.map.base)
    }

    /// Closes the peer's allocations and mappings whose regions left its table (in our
    /// device's context, which the caller holds).
    fn forget_stale(&self, table: &RemoteTable) {
        let live: std::collections::HashSet<u64> = table.regions().map(|r| r.id).collect();
        // No copy of this link is in flight (the caller checked), so nothing of ours uses them.
        self.opened.lock().unwrap().retain(|id| live.contains(&id), |(h, _, _)| ipc_release(&h));
        self.hosts.lock().unwrap().retain(|id, _| live.contains(id));
    }

    /// Issues one device part; its end is reported by the engine's completion thread. The
    /// caller holds the peer's table (`table`) and our device's context.
    fn issue(&self, gpu: &Gpu, part: Part, table: &RemoteTable) {
        let op = part.req.op;
        let mut copies = Vec::new();
        let res = match &part.body {
            PartBody::Data(segs) => self.translate(gpu, table, op, segs, &mut copies),
            PartBody::Strided(st) => {
                st.for_each_chunk(1024, |c| self.translate(gpu, table, op, c, &mut copies))
            }
            PartBody::Notify(_) => Err(Error::failed("a notification reached the copy path")),
        };
        if let Err(e) = res {
            self.tcp.finish_after(&self.done, part, Err(e));
            return;
        }
        let (tcp, done) = (self.tcp.clone(), self.done.clone());
        let on_done = Box::new(move |res| tcp.finish_after(&done, part, res));
        // The copies end after this call, and the peer must not free their memory before:
        // the completion thread keeps the peer's table read-locked until they ended (see
        // `cuda::hold`), as this call does now.
        gpu.copy(
            self.holder_id,
            &copies,
            on_done,
            try_hold(self.tcp.clone(), <dyn ControlChannel>::try_table),
        );
    }
}

/// Whether `addr` is device memory (CUDA knows it as such); plain host memory is not.
fn is_device_ptr(addr: u64) -> bool {
    let Ok(d) = crate::cuda::driver() else { return false };
    // An address CUDA does not know is an error, not a fault.
    d.pointer_attribute(crate::cuda::handles::PointerAttr::MemoryType, addr) == Ok(driver::MEMORYTYPE_DEVICE)
}

/// The `DataPath` of a `CudaIpcLink` (the engine holds it as `Arc<dyn DataPath>`).
pub(crate) struct CudaIpcPath(pub(crate) Arc<CudaIpcLink>);

impl DataPath for CudaIpcPath {
    fn backend(&self) -> &'static str {
        super::NAME
    }

    fn parallelism(&self) -> usize {
        self.0.shm.parallelism()
    }

    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        let l = &self.0;
        if !self.is_alive() {
            return Err(l.reason());
        }
        // With device memory registered here, sorting the parts asks the driver about local
        // addresses, which needs a current context: the engine's Gpu and its device's. Failing
        // here fails the request before anything was issued.
        let mut ready = None;
        if l.slot.has_device() {
            ready = Some(l.ready()?);
        }
        let (mut host, mut dev) = (Vec::new(), Vec::new());
        {
            let table = l.tcp.table();
            for p in parts {
                l.route(&table, p, &mut host, &mut dev);
            }
        }
        // Host parts first: when `shm` refuses them (queue full, closed), nothing has been
        // issued yet and the engine fails the whole request.
        if !host.is_empty() {
            l.shm.submit(host)?;
        }
        if dev.is_empty() {
            return Ok(());
        }
        let _issuing = l.issuing.read().unwrap();
        // Host memory here, device memory there: the Gpu is needed now.
        let ready = match ready {
            Some(r) => Ok(r),
            None => l.ready(),
        };
        let table = l.tcp.table();
        if let Ok((gpu, _)) = &ready {
            if gpu.in_flight(l.holder_id) == 0 {
                l.forget_stale(&table);
            }
        }
        for p in dev {
            match &ready {
                Ok((gpu, _)) if self.is_alive() => l.issue(gpu, p, &table),
                Ok(_) => l.tcp.finish_after(&l.done, p, Err(l.reason())),
                Err(e) => l.tcp.finish_after(&l.done, p, Err(e.clone())),
            }
        }
        Ok(())
    }

    fn is_alive(&self) -> bool {
        !self.0.closed.load(Ordering::Acquire) && self.0.shm.is_alive()
    }

    fn dead_reason(&self) -> Option<String> {
        self.0.shm.dead_reason()
    }

    fn close(&self, why: Error) {
        let l = &self.0;
        l.closed.store(true, Ordering::Release);
        l.shm.close(why);
        // A submit that saw the link open finishes issuing first; later ones see it closed.
        drop(l.issuing.write().unwrap());
        // Copies already on the GPU cannot be cancelled: wait for them before the peer's
        // memory is released here. Without a Gpu nothing was opened or issued.
        let Some(gpu) = l.slot.current() else { return };
        if gpu.drain(l.holder_id, DRAIN) {
            let d = gpu.driver();
            if let Ok(_ctx) = CtxGuard::enter(d, gpu.ordinal) {
                // Allocations this link opened; none of its copies is in flight.
                l.opened.lock().unwrap().clear(|(h, _, _)| ipc_release(&h));
            }
            l.hosts.lock().unwrap().clear();
        } else {
            tracing::warn!(
                pid = l.pid,
                "cuda_ipc copies still running after {DRAIN:?}: the peer's mappings stay open"
            );
        }
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.0.tcp.stats()
    }

    fn queue_slots(&self) -> (usize, usize) {
        self.0.shm.queue_slots()
    }
}

impl Abort for CudaIpcPath {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.0.holder_id
    }
}
