//! A fault the soft NIC can be told to have, for failover tests: [`FAULT_ENV`] =
//! `mute_after=N` makes the process's soft NICs go silent once their responders have answered
//! N requests: from then on they read nothing more and answer nothing, on every connection,
//! old or new, as a NIC whose link went down. The peers' QPs then retry until their timeout
//! runs out (RETRY_EXC_ERR), while the process, its TCP sockets and its control channels
//! live on. Unset: no fault.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Environment variable: `mute_after=N` (see the module doc).
pub const FAULT_ENV: &str = "HIXL_SOFT_RDMA_FAULT";

/// Requests the process's soft responders answered.
static ANSWERED: AtomicU64 = AtomicU64::new(0);

/// The fault [`FAULT_ENV`] asks for: after how many answers the NICs go silent.
pub(super) fn mute_after() -> Result<Option<u64>> {
    let Ok(spec) = std::env::var(FAULT_ENV) else { return Ok(None) };
    let n = spec
        .trim()
        .strip_prefix("mute_after=")
        .and_then(|n| n.trim().parse::<u64>().ok())
        .ok_or_else(|| Error::param(format!("{FAULT_ENV}: {spec:?} is not mute_after=N")))?;
    Ok(Some(n))
}

fn limit() -> Option<u64> {
    static L: OnceLock<Option<u64>> = OnceLock::new();
    // A bad value fails the device's opening (see `device_attr`); here it means no fault.
    *L.get_or_init(|| mute_after().ok().flatten())
}

/// Counts one answered request.
pub(super) fn answered() {
    if limit().is_some() {
        ANSWERED.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether the NICs have gone silent.
pub(super) fn muted() -> bool {
    limit().is_some_and(|n| ANSWERED.load(Ordering::Acquire) >= n)
}

/// Holds connection `fd` without reading or answering until either end shuts it down, for
/// at most `most` (the peer's QP gives up long before; then this side's responder ends as
/// after any failed connection).
pub(super) fn stay_silent(fd: RawFd, most: Duration) {
    let until = Instant::now() + most;
    while Instant::now() < until {
        let mut p = [libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 }];
        let ready = crate::sys::poll(&mut p, 20).unwrap_or(0);
        if ready > 0 && p[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
        {
            return;
        }
    }
}
