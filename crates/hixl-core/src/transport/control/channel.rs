//! What a link's control channel offers the data paths: the peer's handshake facts and region
//! table, BackendOpen, the same-host proof's view of stream 0, notifications, liveness, and
//! closing. Every backend's `connect` gets the link's control channel as a
//! `&Arc<dyn ControlChannel>` and keeps it: a data path never talks to the peer's engine about
//! anything but its own bytes.
//!
//! "Send this notification after that data" is [`ControlChannel::finish_after`], the one way
//! every backend reports the end of a part: the completer says whether the request's
//! notification is due, and if so it goes out here, after the data.

use std::os::fd::RawFd;
use std::sync::{Arc, RwLockReadGuard};
use std::time::Duration;

use crate::complete::{Completer, Next};
use crate::error::{Error, Result};
use crate::queue::Part;
use crate::registry::RemoteTable;
use crate::stats::PeerStats;
use crate::transport::PeerInfo;

/// A hook run once when a control channel closes, with the reason (see
/// [`ControlChannel::on_close`]).
pub type OnClose = Box<dyn FnOnce(Error) + Send>;

/// A link's control channel (stream 0 of the engine's TCP link to the peer).
pub(crate) trait ControlChannel: Send + Sync {
    /// The peer's address as the engine was asked to connect to it.
    fn peer(&self) -> &str;

    /// Handshake facts about the peer (`regions` as of the handshake).
    fn handshake(&self) -> &PeerInfo;

    /// Handshake facts about the peer, with its region table as of now.
    fn peer_info(&self) -> PeerInfo;

    /// The peer's current region table; hold the guard only briefly (updates wait for it).
    fn table(&self) -> RwLockReadGuard<'_, RemoteTable>;

    /// The table's read guard when it can be had without waiting (None: a writer holds or
    /// waits for it); for guards kept past one call (`cuda::hold`).
    fn try_table(&self) -> Option<RwLockReadGuard<'_, RemoteTable>>;

    /// Asks the peer for its current region table and waits (up to `timeout`) until it is
    /// installed.
    fn refresh_table(&self, timeout: Duration) -> Result<()>;

    /// Waits (up to `timeout`) until the installed region table has at least `version`.
    fn wait_table_version(&self, version: u64, timeout: Duration) -> Result<()>;

    /// Asks the peer's `backend` to open its side of a data path (BackendOpen with `payload`)
    /// and waits up to `timeout` for its answer's payload.
    fn open_backend(&self, backend: &str, payload: Vec<u8>, timeout: Duration) -> Result<Vec<u8>>;

    /// Our descriptor of stream 0 (the same-host proof shows it to the peer).
    fn stream0_fd(&self) -> RawFd;

    /// The two ends of stream 0 (ours, the peer's), as the same-host proof names them.
    fn stream0_ends(&self) -> Result<(String, String)>;

    /// Runs `hook` once with the reason when the channel closes (at once when it is closed
    /// already). A hook must not block: it runs on whichever thread closes the channel.
    fn on_close(&self, hook: OnClose);

    /// Queues notification parts (each already counted in its request) to the peer; the
    /// channel's completer settles their requests when the peer acknowledges them.
    fn send_notifies(&self, parts: Vec<Part>) -> Result<()>;

    /// Reports the end of a part a data path carried, to that path's completer `done`; when
    /// the completer says the request's notification is due (every data part landed), it is
    /// sent here, after the data. The one way a data path reports a part.
    fn finish_after(&self, done: &Completer, part: Part, res: Result<()>) {
        if let Next::Notify(n) = done.finish(part, res) {
            let req = n.req.clone();
            if let Err(e) = self.send_notifies(vec![n]) {
                done.abandon(&req, e);
            }
        }
    }

    /// Handles what the channel's streams have received so far: a data path whose stream ended
    /// calls it before it closes the pair, so that answers already here settle their requests.
    fn read_received(&self) {}

    /// The peer's counters (every data path of the link counts into them).
    fn stats(&self) -> Arc<PeerStats>;

    /// Whether the channel is open.
    fn is_alive(&self) -> bool;

    /// Why it closed, if it did.
    fn dead_reason(&self) -> Option<String>;

    /// Why it closed, as the error its requests fail with (NOT_CONNECTED when it is open).
    fn close_reason(&self) -> Error;

    /// Closes it: its hooks run (closing the data paths that live and die with it) and every
    /// queued notification fails with `why`; bounded in time.
    fn close(&self, why: Error);
}
