//! Deciding that a peer is dead (sans-IO): the link samples a progress counter every
//! heartbeat interval, and a peer whose counter has not risen above its highest value for
//! three intervals is dead.
//!
//! The counter is what the kernel reports for the link's sockets: bytes received from the
//! peer plus bytes of ours the peer acknowledged, minus the heartbeat bytes we sent. An idle
//! live peer answers each heartbeat (bytes received rise); a busy live peer moves data (one
//! of the two rises); a frozen, hung or unreachable peer moves nothing, and our own heartbeats
//! cannot make it look alive because they are subtracted. The link samples the counter at the
//! end of each interval, before it sends that tick's probes: the last probes have then had a
//! whole interval to be acknowledged and answered, so a live peer rises every interval and a
//! miss means the peer answered nothing in one.

use std::time::{Duration, Instant};

/// Intervals without progress after which a peer is dead.
pub const MISSED: u32 = 3;

/// Tracks one link's progress counter.
#[derive(Debug)]
pub struct Liveness {
    interval: Duration,
    best: i128,
    since: Instant,
}

impl Liveness {
    /// Starts tracking at `now` with a heartbeat `interval`.
    pub fn new(interval: Duration, now: Instant) -> Self {
        Liveness { interval, best: i128::MIN, since: now }
    }

    /// [`Liveness::observe_counting`] without the miss.
    #[cfg(test)]
    pub fn observe(&mut self, progress: i128, now: Instant) -> Option<Duration> {
        self.observe_counting(progress, now).1
    }

    /// Records a sample: whether it showed no progress (a missed heartbeat interval), and how
    /// long the peer has been silent once that reaches `MISSED` intervals (it is then dead).
    pub fn observe_counting(&mut self, progress: i128, now: Instant) -> (bool, Option<Duration>) {
        if progress > self.best {
            self.best = progress;
            self.since = now;
            return (false, None);
        }
        let silent = now.saturating_duration_since(self.since);
        (true, (silent >= self.interval * MISSED).then_some(silent))
    }
}

/// Bytes received from the peer and bytes of ours it acknowledged on one socket, from the
/// kernel's TCP_INFO; None where the kernel does not say.
pub fn tcp_progress(fd: std::os::fd::RawFd) -> Option<(u64, u64)> {
    // SAFETY: tcp_info is plain data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` describe a writable buffer of the right size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (r == 0).then_some((info.tcpi_bytes_received, info.tcpi_bytes_acked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_peers_stay_alive_and_silent_ones_die_after_three_intervals() {
        let t0 = Instant::now();
        let i = Duration::from_millis(100);
        let mut l = Liveness::new(i, t0);
        assert_eq!(l.observe(10, t0), None);
        // Progress every interval: alive however long it runs.
        for k in 1..50 {
            assert_eq!(l.observe(10 + k, t0 + i * k as u32), None);
        }
        let last = t0 + i * 49;
        // Our own heartbeats make the counter dip and come back: not progress.
        assert_eq!(l.observe(59 - 24, last + i), None);
        assert_eq!(l.observe(59, last + i * 2), None);
        assert_eq!(l.observe(59 - 24, last + i * 3 - Duration::from_millis(1)), None);
        assert_eq!(l.observe(59, last + i * 3), Some(i * 3));
    }
}
