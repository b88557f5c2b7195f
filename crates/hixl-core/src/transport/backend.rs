//! The backend seam: how a data path is chosen for a peer.
//!
//! Every link starts with the control channel (today the TCP link: handshake, region tables,
//! notifications, heartbeats). Then the engine asks each backend named in `hixl.backends`, in
//! that order, to open a data path over it; the first that can serve the peer carries the
//! link's data, and the INFO log says which was chosen and why the ones before it were not.
//! Adding a backend means one module and one line in [`by_name`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::options::Options;
use crate::transport::local::{self, Proven};
use crate::transport::selfcopy::{self, SelfLink};
use crate::transport::shm::ShmLink;
use crate::transport::tcp::TcpLink;
use crate::transport::Link;

/// Names of the backends this build has, fastest first (the default of `hixl.backends`).
pub const BUILT: &[&str] = &["self", "shm", "tcp"];

/// What a backend may use to open a data path.
pub struct OpenCtx<'a> {
    /// The engine's options.
    pub opts: &'a Options,
    /// This machine's identity (a hint: a peer that claims another host is not tried).
    pub host: &'a str,
    /// The connect deadline.
    pub timeout: Duration,
}

/// A way to move a link's data.
pub trait Backend: Send + Sync {
    /// Its name, as `hixl.backends` and `stats()` spell it.
    fn name(&self) -> &'static str;
    /// Opens a data path to the peer at the other end of `control`; Err says why this backend
    /// cannot serve that peer (the engine then tries the next).
    fn open(&self, ctx: &OpenCtx<'_>, control: &Arc<TcpLink>) -> std::result::Result<Arc<dyn Link>, String>;
}

/// The backend called `name`, if this build has it.
pub fn by_name(name: &str) -> Option<Arc<dyn Backend>> {
    match name {
        "self" => Some(Arc::new(SameProcess)),
        "shm" => Some(Arc::new(Shm)),
        "tcp" => Some(Arc::new(Tcp)),
        _ => None,
    }
}

/// Two engines of one process: memcpy, after an in-process check that the peer engine holds
/// this very stream (see `selfcopy`).
struct SameProcess;

impl Backend for SameProcess {
    fn name(&self) -> &'static str {
        "self"
    }

    fn open(&self, _ctx: &OpenCtx<'_>, control: &Arc<TcpLink>) -> std::result::Result<Arc<dyn Link>, String> {
        let info = crate::transport::Link::peer_info(&**control);
        let (ours, theirs) = control.stream0_ends().map_err(|e| e.message)?;
        let target = selfcopy::find(&info.local_socket, &ours, &theirs)?;
        Ok(SelfLink::new(control.clone(), target))
    }
}

/// Any host: the control channel's own TCP streams carry the data.
struct Tcp;

impl Backend for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn open(&self, _ctx: &OpenCtx<'_>, control: &Arc<TcpLink>) -> std::result::Result<Arc<dyn Link>, String> {
        Ok(control.clone())
    }
}

/// Same host: cross-memory attach and sealed memfd mappings, after the same-host proof.
struct Shm;

impl Backend for Shm {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn open(&self, ctx: &OpenCtx<'_>, control: &Arc<TcpLink>) -> std::result::Result<Arc<dyn Link>, String> {
        let proven = prove_same_host(ctx, control)?;
        let link = ShmLink::new(control.clone(), proven, ctx.opts.shm_threads, ctx.opts.queue_depth)
            .map_err(|e| e.message)?;
        Ok(link)
    }
}

/// The same-host proof (see `transport::local`): both processes show, over the peer's Unix
/// socket, that they hold the two ends of this very link; then we wait for a region table at
/// least as new as the one the peer will make us confirm. Err says why direct copies cannot
/// be used.
fn prove_same_host(ctx: &OpenCtx<'_>, tcp: &TcpLink) -> std::result::Result<Proven, String> {
    let info = crate::transport::Link::peer_info(tcp);
    if info.local_socket.is_empty() {
        return Err("the peer offers no same-host proof".into());
    }
    if info.host != ctx.host {
        return Err(format!("the peer says it runs on another host ({})", info.host));
    }
    let (ours, theirs) = tcp.stream0_ends().map_err(|e| e.message)?;
    let deadline = Instant::now() + ctx.timeout.max(Duration::from_secs(1));
    let proven = local::prove(&info.local_socket, tcp.stream0_fd(), &ours, &theirs, deadline)?;
    let left = deadline.saturating_duration_since(Instant::now());
    tcp.wait_table_version(proven.table_version, left).map_err(|e| e.message)?;
    Ok(proven)
}
