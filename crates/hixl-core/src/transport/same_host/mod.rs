//! Same host: what two engines on one machine do before either copies the other's memory
//! directly — the proof that both hold the ends of one TCP stream (`proof`), and the rule for
//! a peer that exec'd after it (`exec_rule`). The `shm`, `self` and `cuda_ipc` backends open
//! only after it.

pub mod exec_rule;
pub mod proof;

use std::time::{Duration, Instant};

use crate::transport::backend::OpenCtx;
use crate::transport::control::channel::ControlChannel;
use proof::Proven;

/// The same-host proof (see `transport::same_host::proof`): both processes show, over the peer's Unix
/// socket, that they hold the two ends of this very link; then we wait for a region table at
/// least as new as the one the peer will make us confirm. Err says why direct copies cannot
/// be used.
pub(crate) fn prove_same_host(
    ctx: &OpenCtx<'_>,
    tcp: &dyn ControlChannel,
    socket: &str,
) -> std::result::Result<Proven, String> {
    let host = &tcp.handshake().host;
    if host != ctx.host {
        return Err(format!("the peer says it runs on another host ({host})"));
    }
    let (ours, theirs) = tcp.stream0_ends().map_err(|e| e.message)?;
    let deadline = Instant::now() + ctx.timeout.max(Duration::from_secs(1));
    let proven = proof::prove(socket, tcp.stream0_fd(), &ours, &theirs, deadline)?;
    let left = deadline.saturating_duration_since(Instant::now());
    tcp.wait_table_version(proven.table_version, left).map_err(|e| e.message)?;
    Ok(proven)
}
