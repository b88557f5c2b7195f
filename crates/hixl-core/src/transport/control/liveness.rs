//! Deciding that a peer is dead (sans-IO): the link samples a progress counter every
//! heartbeat interval, and a peer whose counter has not risen above its highest value in
//! `MISSED` samples in a row is dead. The count is of samples, not of time: the engine's
//! timer runs a tick up to its slack early, so three intervals measured in time would often
//! need a fourth sample. A peer that stops answering is therefore declared dead at the third
//! sample after the last one that saw it answer: between 3 and 4 intervals after it stopped
//! (plus the timer's wake-up delay on a loaded host).
//!
//! The counter is what the kernel reports for the link's sockets: bytes received from the
//! peer plus bytes of ours the peer acknowledged, minus the heartbeat bytes we sent. An idle
//! live peer answers each heartbeat (bytes received rise); a busy live peer moves data (one
//! of the two rises); a frozen, hung or unreachable peer moves nothing, and our own heartbeats
//! cannot make it look alive because they are subtracted (the link samples before it sends
//! the next ones, so a heartbeat's acknowledgement never arrives between two samples).

use std::time::{Duration, Instant};

/// Intervals without progress after which a peer is dead.
pub const MISSED: u32 = 3;

/// Tracks one link's progress counter.
#[derive(Debug)]
pub struct Liveness {
    best: i128,
    since: Instant,
    /// Samples in a row without progress.
    misses: u32,
}

impl Liveness {
    /// Starts tracking at `now`.
    pub fn new(now: Instant) -> Self {
        Liveness { best: i128::MIN, since: now, misses: 0 }
    }

    /// [`Liveness::observe_counting`] without the miss.
    #[cfg(test)]
    pub fn observe(&mut self, progress: i128, now: Instant) -> Option<Duration> {
        self.observe_counting(progress, now).1
    }

    /// Records a sample: whether it showed no progress (a missed heartbeat interval), and how
    /// long the peer has been silent once `MISSED` samples in a row showed none (it is then
    /// dead).
    pub fn observe_counting(&mut self, progress: i128, now: Instant) -> (bool, Option<Duration>) {
        if progress > self.best {
            self.best = progress;
            self.since = now;
            self.misses = 0;
            return (false, None);
        }
        self.misses += 1;
        let silent = now.saturating_duration_since(self.since);
        (true, (self.misses >= MISSED).then_some(silent))
    }
}

/// Bytes received from the peer and bytes of ours it acknowledged on one socket, from the
/// kernel's TCP_INFO; None where the kernel does not say.
pub fn tcp_progress(fd: std::os::fd::RawFd) -> Option<(u64, u64)> {
    let info = crate::sys::sockio::tcp_info(fd).ok()?;
    Some((info.tcpi_bytes_received, info.tcpi_bytes_acked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_peers_stay_alive_and_silent_ones_die_at_the_third_silent_sample() {
        let t0 = Instant::now();
        let i = Duration::from_millis(100);
        let mut l = Liveness::new(t0);
        assert_eq!(l.observe(10, t0), None);
        // Progress every interval: alive however long it runs.
        for k in 1..50 {
            assert_eq!(l.observe(10 + k, t0 + i * k as u32), None);
        }
        let last = t0 + i * 49;
        // Lower samples (our own heartbeats not yet acknowledged) are not progress.
        assert_eq!(l.observe(59 - 24, last + i), None);
        assert_eq!(l.observe(59, last + i * 2), None);
        // The timer runs ticks up to its slack early: the third silent sample is the last,
        // even when less than three whole intervals have passed.
        let early = Duration::from_millis(10);
        assert_eq!(l.observe(59, last + i * 3 - early), Some(i * 3 - early));
    }

    #[test]
    fn progress_starts_the_count_again() {
        let t0 = Instant::now();
        let i = Duration::from_millis(100);
        let mut l = Liveness::new(t0);
        assert_eq!(l.observe(10, t0), None);
        assert_eq!(l.observe(10, t0 + i), None);
        assert_eq!(l.observe(10, t0 + i * 2), None);
        assert_eq!(l.observe(11, t0 + i * 3), None);
        assert_eq!(l.observe(11, t0 + i * 4), None);
        assert_eq!(l.observe(11, t0 + i * 5), None);
        assert_eq!(l.observe(11, t0 + i * 6), Some(i * 3));
    }
}
