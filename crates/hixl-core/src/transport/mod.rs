//! Backends: how bytes move to a peer. The control channel (handshake, notifications) is TCP
//! in every case; `tcp` is also the data path between hosts.

pub mod io;
pub mod server;
pub mod tcp;

use std::sync::Arc;

use crate::error::Result;
use crate::queue::Part;
use crate::registry::RemoteTable;
use crate::stats::PeerStats;

/// What the handshake told us about a peer.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The peer engine's id (its listen address).
    pub engine_id: String,
    /// The peer's process id.
    pub pid: u32,
    /// The regions it had registered at connect.
    pub regions: RemoteTable,
}

/// A connected link to one peer: accepts parts of requests and completes them.
pub trait Link: crate::registry::Abort + Send + Sync {
    /// Backend name ("tcp", ...), shown in stats and logs.
    fn backend(&self) -> &'static str;
    /// Handshake facts about the peer.
    fn peer_info(&self) -> PeerInfo;
    /// Replaces the cached region table (after a refresh).
    fn set_regions(&self, regions: RemoteTable);
    /// Queues the parts of one request; `extra_slots` more queue slots are reserved for
    /// follow-up parts (the notify that follows the data). `RESOURCE_EXHAUSTED` when full.
    fn submit(&self, parts: Vec<Part>, extra_slots: usize) -> Result<()>;
    /// Whether the link is usable.
    fn is_alive(&self) -> bool;
    /// Why it died, if it did.
    fn dead_reason(&self) -> Option<String>;
    /// Closes the link: every queued or in-flight part fails with `why`; bounded in time.
    fn close(&self, why: crate::error::Error);
    /// Per-peer counters.
    fn stats(&self) -> Arc<PeerStats>;
}
