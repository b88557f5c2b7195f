//! Per-peer counters: bytes and operations per direction, errors by status, requests in
//! flight, a latency histogram (for metrics) and a latency summary of recent requests.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::error::Status;
use crate::op::TransferOp;

/// Upper bounds, in microseconds, of the latency histogram's buckets (a last one, +Inf,
/// follows): powers of 4 from 4 µs to about 16.8 s, wide enough for a same-host 4 KiB copy and
/// a 1 GiB TCP transfer alike. Fixed: every engine of a fleet must bucket alike to be summed.
pub const LATENCY_BUCKETS_US: [u64; 12] =
    [4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216];

/// Requests whose latency the per-peer summary (p50, p99, max) is computed over. Fixed: enough
/// for a stable p99, small enough to copy when stats are read.
const LATENCY_WINDOW: usize = 1024;

/// Counters of one peer link.
#[derive(Default)]
pub struct PeerStats {
    /// Bytes written to the peer.
    pub bytes_write: AtomicU64,
    /// Bytes read from the peer.
    pub bytes_read: AtomicU64,
    /// Completed WRITE requests.
    pub ops_write: AtomicU64,
    /// Completed READ requests.
    pub ops_read: AtomicU64,
    /// Transfer requests that failed or timed out (a notification sent alone is not one).
    pub errors: AtomicU64,
    /// Notifications delivered.
    pub notifies: AtomicU64,
    /// Same-host copies (a part, or 1024 elements of a strided part) done through a mapping
    /// of the peer's memory instead of CMA.
    pub direct_parts: AtomicU64,
    /// Requests (transfers and notifications) submitted on the link and not settled yet:
    /// raised by `Request::track` and lowered by the request's settling, nowhere else.
    pub in_flight: AtomicI64,
    /// Failed transfer requests by status (TIMEOUT: settled by their deadline), in the order
    /// of [`Status::ALL`].
    pub errors_by_status: [AtomicU64; Status::ALL.len()],
    /// Completed requests per latency bucket ([`LATENCY_BUCKETS_US`], then +Inf).
    pub latency_buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    /// Sum of the completed requests' latencies, in microseconds.
    pub latency_sum_us: AtomicU64,
    /// Heartbeat intervals in which nothing came from the peer and it acknowledged nothing of
    /// ours but our probes (0 on a healthy link; three in a row: it is dead).
    pub heartbeat_misses: AtomicU64,
    latencies: Window,
    next: AtomicU64,
}

/// The latencies (µs) of the last `LATENCY_WINDOW` completed requests, a ring.
struct Window(Box<[AtomicU64]>);

impl Default for Window {
    fn default() -> Self {
        Window((0..LATENCY_WINDOW).map(|_| AtomicU64::new(0)).collect())
    }
}

/// A snapshot of a peer's latency window (last 1024 completed requests), in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencySummary {
    /// Samples in the window.
    pub count: u64,
    /// Mean.
    pub avg_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Maximum.
    pub max_us: f64,
}

/// What the counters need of a request as it settles (see `Request::settle`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settled {
    /// Its direction.
    pub op: TransferOp,
    /// Its bytes.
    pub bytes: u64,
    /// Its descriptors (0: a notification sent alone).
    pub descs: usize,
    /// Whether a notification went after its data.
    pub carries_notify: bool,
    /// From submission until its I/O ended (as the completer recorded it), or until now.
    pub latency: Duration,
}

/// How a request is counted as it settles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// It completed: its bytes, operation and latency (a transfer), or its delivery (a
    /// notification) are counted.
    Completed,
    /// It failed, was refused by its link, or timed out (`Status::Timeout`): a transfer
    /// counts as an error with that status.
    Failed(Status),
}

impl PeerStats {
    /// A request was submitted on the link (see `Request::track`).
    pub(crate) fn submitted(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request once, as it settles: the one place a settled request is counted.
    /// `Request::settle` calls it before it publishes the final state, so a caller that saw
    /// the request end (or its call return) reads counters that include it.
    pub(crate) fn settled(&self, req: Settled, outcome: Outcome) {
        // A notification was delivered: sent alone (no descriptors) or after a transfer's data.
        if outcome == Outcome::Completed && (req.descs == 0 || req.carries_notify) {
            self.notifies.fetch_add(1, Ordering::Relaxed);
        }
        if req.descs > 0 {
            let failed = match outcome {
                Outcome::Failed(st) => Some(st),
                _ => None,
            };
            self.record(req.op, req.bytes, failed, req.latency);
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Records a finished request: `failed` is the status it failed with (None: completed).
    pub fn record(&self, op: TransferOp, bytes: u64, failed: Option<Status>, latency: Duration) {
        if let Some(status) = failed {
            self.errors.fetch_add(1, Ordering::Relaxed);
            let i = Status::ALL.iter().position(|s| *s == status).unwrap_or(Status::ALL.len() - 1);
            self.errors_by_status[i].fetch_add(1, Ordering::Relaxed);
            return;
        }
        let us = latency.as_micros() as u64;
        let bucket = LATENCY_BUCKETS_US.iter().position(|b| us <= *b).unwrap_or(LATENCY_BUCKETS_US.len());
        self.latency_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us.fetch_add(us, Ordering::Relaxed);
        let (b, o) = match op {
            TransferOp::Write => (&self.bytes_write, &self.ops_write),
            TransferOp::Read => (&self.bytes_read, &self.ops_read),
        };
        b.fetch_add(bytes, Ordering::Relaxed);
        o.fetch_add(1, Ordering::Relaxed);
        // A ring of atomics: the completers of one link never wait for each other here.
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % LATENCY_WINDOW;
        self.latencies.0[i].store(us, Ordering::Relaxed);
    }

    /// Summarises the latency window.
    pub fn latency(&self) -> LatencySummary {
        let n = (self.next.load(Ordering::Relaxed) as usize).min(LATENCY_WINDOW);
        let mut v: Vec<u64> = self.latencies.0[..n].iter().map(|a| a.load(Ordering::Relaxed)).collect();
        if v.is_empty() {
            return LatencySummary::default();
        }
        v.sort_unstable();
        let pick = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64;
        LatencySummary {
            count: v.len() as u64,
            avg_us: v.iter().sum::<u64>() as f64 / v.len() as f64,
            p50_us: pick(0.5),
            p99_us: pick(0.99),
            max_us: *v.last().unwrap() as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_summarises() {
        let s = PeerStats::default();
        for i in 1..=100u64 {
            s.record(TransferOp::Write, 10, None, Duration::from_micros(i));
        }
        s.record(TransferOp::Read, 5, Some(Status::Timeout), Duration::ZERO);
        assert_eq!(s.errors_by_status[2].load(Ordering::Relaxed), 1, "TIMEOUT is ALL[2]");
        let buckets: Vec<u64> = s.latency_buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        // 1..=100 µs: 4 at <= 4, 12 at <= 16, 48 at <= 64, 36 at <= 256.
        assert_eq!(&buckets[..5], &[4, 12, 48, 36, 0]);
        assert_eq!(s.latency_sum_us.load(Ordering::Relaxed), 5050);
        assert_eq!(s.bytes_write.load(Ordering::Relaxed), 1000);
        assert_eq!(s.ops_read.load(Ordering::Relaxed), 0);
        assert_eq!(s.errors.load(Ordering::Relaxed), 1);
        let l = s.latency();
        assert_eq!(l.count, 100);
        assert_eq!(l.max_us, 100.0);
        assert!((l.p50_us - 50.0).abs() <= 1.0);
    }
}
