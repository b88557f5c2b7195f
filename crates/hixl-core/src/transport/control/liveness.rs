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
//!
//! A link dies on evidence about the peer, never on this process's own lateness. A sample
//! that comes more than half an interval late (the timer thread was not scheduled: a starved
//! or stopped process), or while this process is itself behind (bytes from the peer wait
//! unread, or our own frames wait unsent with the kernel's send queue empty), counts no miss:
//! the heartbeats missed meanwhile prove nothing about the peer. The peer is then given one
//! fresh interval, measured from when this process ran again, before it can be declared dead
//! (a count that stood at `MISSED - 1` stays there; it is not reset, so that a peer that was
//! already silent is still found one interval later). A frozen peer of a process that runs
//! on time is declared dead as before, within `MISSED` intervals plus one.

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
    /// The heartbeat interval (samples are due this far apart).
    every: Duration,
    /// When the last sample was taken.
    last: Instant,
}

impl Liveness {
    /// Starts tracking at `now`, with samples due every `every`.
    pub fn new(now: Instant, every: Duration) -> Self {
        Liveness { best: i128::MIN, since: now, misses: 0, every, last: now }
    }

    /// [`Liveness::observe_counting`] without the miss, for a process that is not behind.
    #[cfg(test)]
    pub fn observe(&mut self, progress: i128, now: Instant) -> Option<Duration> {
        self.observe_counting(progress, now, false).1
    }

    /// Records a sample: whether it showed no progress (a missed heartbeat interval), and how
    /// long the peer has been silent once `MISSED` samples in a row showed none (it is then
    /// dead). `behind`: this process is itself late (see the module's rule), as is a sample
    /// taken more than half an interval after it was due; such a sample counts no miss.
    pub fn observe_counting(
        &mut self,
        progress: i128,
        now: Instant,
        behind: bool,
    ) -> (bool, Option<Duration>) {
        let late = now.saturating_duration_since(self.last) > self.every + self.every / 2;
        self.last = now;
        if progress > self.best {
            self.best = progress;
            self.since = now;
            self.misses = 0;
            return (false, None);
        }
        if late || behind {
            self.misses = self.misses.min(MISSED - 1);
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
        let mut l = Liveness::new(t0, Duration::from_millis(100));
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
        let mut l = Liveness::new(t0, Duration::from_millis(100));
        assert_eq!(l.observe(10, t0), None);
        assert_eq!(l.observe(10, t0 + i), None);
        assert_eq!(l.observe(10, t0 + i * 2), None);
        assert_eq!(l.observe(11, t0 + i * 3), None);
        assert_eq!(l.observe(11, t0 + i * 4), None);
        assert_eq!(l.observe(11, t0 + i * 5), None);
        assert_eq!(l.observe(11, t0 + i * 6), Some(i * 3));
    }

    #[test]
    fn a_late_sample_counts_no_miss_and_the_peer_gets_one_fresh_interval() {
        let t0 = Instant::now();
        let i = Duration::from_millis(100);
        let mut l = Liveness::new(t0, i);
        assert_eq!(l.observe(10, t0), None);
        assert_eq!(l.observe(10, t0 + i), None);
        assert_eq!(l.observe(10, t0 + i * 2), None);
        // This process did not run for a second (ten intervals): no miss counted...
        let back = t0 + i * 12;
        assert_eq!(l.observe_counting(10, back, false), (false, None));
        // ...and a silent peer dies one interval after this process ran again, not at once.
        assert_eq!(l.observe(10, back + i), Some(back + i - t0));
        // A peer that answers right after the starved period lives on.
        let mut l = Liveness::new(t0, i);
        assert_eq!(l.observe(10, t0), None);
        assert_eq!(l.observe(10, back), None);
        assert_eq!(l.observe(11, back + i), None);
        for k in 2..5 {
            assert_eq!(l.observe_counting(11, back + i * k, true), (false, None), "behind: no miss");
        }
        assert_eq!(l.observe(11, back + i * 5), None);
        assert_eq!(l.observe(11, back + i * 6), None);
        assert!(l.observe(11, back + i * 7).is_some());
    }
}
