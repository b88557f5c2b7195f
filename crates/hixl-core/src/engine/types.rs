//! The engine's public data types.

use std::sync::Arc;

use crate::queue::Request;
use crate::registry::MemType;
use crate::stats::LatencySummary;
use crate::wire::RegionEntry;

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

/// When the caller of a submitting call will wait for its request. A data path may run the
/// request on the calling thread while submitting it when the caller waits `Now` (nothing
/// would overlap anyway, and no thread is woken; same-host: one part of up to 8 MiB). With
/// `Later` it hands the request to its workers, so that the call returns at once and the
/// caller's next requests overlap this one (a thread that waits for it may still lend a hand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// The caller waits for the request right after submitting it (`transfer_sync`).
    Now,
    /// The caller goes on and waits, polls or awaits later (`transfer_async`).
    Later,
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

/// Per-peer figures returned by [`Engine::stats`](crate::engine::Engine::stats).
#[derive(Clone, Debug, PartialEq)]
pub struct PeerSnapshot {
    /// Peer address.
    pub peer: String,
    /// Backend name.
    pub backend: &'static str,
    /// Why the backends tried before it were not chosen ("shm: ...; ..."; empty: it was first).
    pub not_chosen: String,
    /// How many times the link moved to the next backend because its data path died while
    /// the control channel lived (0 or 1; see docs/RELIABILITY.md).
    pub failovers: u64,
    /// Why it did, as "rdma -> tcp: <the path's error>" (empty: it did not).
    pub failover: String,
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
    /// Transfer requests that failed or timed out (counted as they settle).
    pub errors: u64,
    /// Notifications delivered.
    pub notifies: u64,
    /// Same-host copies done through a mapping of the peer's memory (not CMA).
    pub direct_parts: u64,
    /// Latency of recent requests.
    pub latency: LatencySummary,
    /// Requests (transfers and notifications) submitted and not settled yet (never negative).
    pub in_flight: i64,
    /// Failed requests by status (every status of [`Status::ALL`](crate::error::Status::ALL), in order).
    pub errors_by_status: Vec<(crate::error::Status, u64)>,
    /// Completed requests per latency bucket: the bounds of
    /// [`LATENCY_BUCKETS_US`](crate::stats::LATENCY_BUCKETS_US), then +Inf (not cumulative).
    pub latency_buckets: Vec<u64>,
    /// Sum of the completed requests' latencies, in microseconds.
    pub latency_sum_us: u64,
    /// Request-queue slots in use and in all (0, 0: the path queues nothing).
    pub queue_slots: (usize, usize),
    /// Heartbeat intervals in which nothing came from the peer and it acknowledged nothing of
    /// ours but our probes (0 on a healthy link).
    pub heartbeat_misses: u64,
    /// The data path's rails (rdma over several devices: each device, up or out, its bytes);
    /// empty for other paths.
    pub rails: Vec<crate::transport::RailSnapshot>,
}

/// A region a peer registered, as [`Engine::remote_regions`](crate::engine::Engine::remote_regions) shows it.
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
