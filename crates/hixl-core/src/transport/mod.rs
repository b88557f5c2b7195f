//! Links to peers. Every link has one control channel (`control`: handshake, region tables,
//! notifications, heartbeats), which runs over TCP, and one data path chosen by `backend`
//! among the backends both sides offer (`self` in one process, `shm` on one host, `rdma` with
//! RDMA devices on both sides, `tcp` anywhere).

pub mod backend;
pub mod backends;
pub mod control;
pub mod io;
pub mod reactor;
pub mod same_host;
pub(crate) mod staging;
pub mod streams;
pub mod target_side;

use std::sync::Arc;

use crate::error::Result;
use crate::queue::Part;
use crate::registry::RemoteTable;
use crate::stats::PeerStats;
use crate::wire::Capability;

/// What the handshake told us about a peer.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The peer engine's id (its listen address).
    pub engine_id: String,
    /// The peer's machine identity, as it claims it (a hint; never trusted).
    pub host: String,
    /// The data paths the peer offers, in its order of preference.
    pub capabilities: Vec<Capability>,
    /// Version of the region table at the handshake.
    pub table_version: u64,
    /// The peer's regions (at connect, then as updated by the peer).
    pub regions: RemoteTable,
}

impl PeerInfo {
    /// What the peer offers for `backend`, if it offers it.
    pub fn offer(&self, backend: &str) -> Option<&Capability> {
        self.capabilities.iter().find(|c| c.backend == backend)
    }
}

/// A backend's data path to one peer: takes the parts of requests, moves their bytes and
/// reports each part's end to the link's completer (which settles requests and sends the
/// notification after the data over the control channel).
pub trait DataPath: crate::registry::Abort + Send + Sync {
    /// Backend name ("tcp", ...), shown in stats and logs.
    fn backend(&self) -> &'static str;
    /// How many workers can carry shares of one request in parallel.
    fn parallelism(&self) -> usize;
    /// Queues the parts of one request (data only: a notification, after the data or on its
    /// own, goes over the link's control channel). `RESOURCE_EXHAUSTED` when full.
    fn submit(&self, parts: Vec<Part>) -> Result<()>;
    /// Whether the data path (and its control channel) is usable.
    fn is_alive(&self) -> bool;
    /// Why it died, if it did.
    fn dead_reason(&self) -> Option<String>;
    /// Closes it and its control channel: every queued or in-flight part fails with `why`;
    /// bounded in time.
    fn close(&self, why: crate::error::Error);
    /// Per-peer counters.
    fn stats(&self) -> Arc<PeerStats>;
    /// What it offers threads that wait for its requests (see [`crate::queue::WaitHelp`]).
    fn wait_help(self: Arc<Self>) -> Option<std::sync::Weak<dyn crate::queue::WaitHelp>> {
        None
    }
    /// Request-queue slots in use and in all (`hixl.queue_depth`); (0, 0) for a path that
    /// queues nothing (it copies on the caller's thread).
    fn queue_slots(&self) -> (usize, usize) {
        (0, 0)
    }
    /// The rails of a path over several devices (rdma), in rail order; empty for others.
    fn rails(&self) -> Vec<RailSnapshot> {
        Vec::new()
    }
    /// Hands the parts of this path to `to` when the path dies by itself while its control
    /// channel lives (instead of failing them and closing the channel); false when this path
    /// cannot (it fails them, as always).
    fn set_rescue(&self, to: std::sync::Weak<dyn Rescue>) -> bool {
        let _ = to;
        false
    }
}

/// Takes over from a data path that died while its control channel lives (failover to the
/// next backend, see `engine::failover`).
pub trait Rescue: Send + Sync {
    /// The path died with `why`; `parts` (possibly none) did not all land and are the
    /// rescuer's now: it re-issues them elsewhere or fails them. Called from any thread, with
    /// no lock of the path held; must not block.
    fn rescue(&self, parts: Vec<Part>, why: &crate::error::Error);
}

/// One rail (device) of a data path, as `stats()` reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RailSnapshot {
    /// The device (`mlx5_0`, `rxe1`, `soft0`).
    pub device: String,
    /// Whether it carries parts (false: left out after its QP failed).
    pub up: bool,
    /// Why it was left out (empty while up).
    pub out_why: String,
    /// Bytes of the parts it completed.
    pub bytes: u64,
    /// Times it came back into the rotation after being left out (a probe found it working).
    pub returns: u64,
}

/// The target side's hook for served frames whose checked and pinned ranges lie in device
/// memory: the served streams hold the engine's `Arc<dyn TargetStaging>` (the staging code's
/// `staging::target::DeviceStaging`) and call it, so that they never name CUDA or staging.
pub(crate) trait TargetStaging: Send + Sync {
    /// Whether `frame` is served here (some of its pinned regions are device memory).
    fn stages(&self, frame: &io::ranges::PinnedFrame) -> bool;

    /// Starts receiving a WRITE of `bulk` bytes into `frame` from the peer at `peer_addr`
    /// (whose staging budget it counts against); Err: refuse it (the caller skips its bytes
    /// and answers with the error).
    fn start_write(
        &self,
        tag: u64,
        bulk: u64,
        frame: io::ranges::PinnedFrame,
        hasher: Option<blake3::Hasher>,
        peer_addr: &str,
    ) -> Result<Box<dyn StagedWrite>>;

    /// The `total` bytes of a READ from `frame` for the peer at `peer_addr`, copied where a
    /// socket can send them from: ranges that keep their buffer, its budget and `frame` until
    /// they drop.
    fn stage_read(
        &self,
        frame: io::ranges::PinnedFrame,
        total: u64,
        peer_addr: &str,
    ) -> Result<crate::cuda::driver::owned::PinnedBytes>;
}

/// A WRITE being received for [`TargetStaging`].
pub(crate) trait StagedWrite: Send {
    /// The frame's tag (its answer's).
    fn tag(&self) -> u64;

    /// Receives what has arrived (bytes, then their data MAC) through the stream's frame
    /// reader, at most about `budget` bytes.
    fn recv(
        &mut self,
        fd: std::os::fd::RawFd,
        frames: &mut io::nbio::FrameReader,
        budget: &mut u64,
    ) -> std::io::Result<io::nbio::Step>;

    /// After `recv` is done: checks the data MAC, moves the bytes to their ranges and says how
    /// to answer. Some(error): the stream must close after the answer (altered bytes).
    fn finish(self: Box<Self>) -> (crate::wire::Frame, Option<std::io::Error>);
}
