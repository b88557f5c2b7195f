//! Per-peer counters: bytes and operations per direction, errors and a latency summary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::queue::TransferOp;

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
    /// Requests that failed or timed out.
    pub errors: AtomicU64,
    /// Notifications sent.
    pub notifies: AtomicU64,
    /// Same-host copies (a part, or 1024 elements of a strided part) done through a mapping
    /// of the peer's memory instead of CMA.
    pub direct_parts: AtomicU64,
    latencies: Mutex<Vec<u64>>,
    next: AtomicU64,
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

impl PeerStats {
    /// Records a finished request.
    pub fn record(&self, op: TransferOp, bytes: u64, ok: bool, latency: Duration) {
        if !ok {
            self.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let (b, o) = match op {
            TransferOp::Write => (&self.bytes_write, &self.ops_write),
            TransferOp::Read => (&self.bytes_read, &self.ops_read),
        };
        b.fetch_add(bytes, Ordering::Relaxed);
        o.fetch_add(1, Ordering::Relaxed);
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % LATENCY_WINDOW;
        let mut w = self.latencies.lock().unwrap();
        let us = latency.as_micros() as u64;
        if w.len() < LATENCY_WINDOW {
            w.push(us);
        } else {
            w[i] = us;
        }
    }

    /// Summarises the latency window.
    pub fn latency(&self) -> LatencySummary {
        let mut v = self.latencies.lock().unwrap().clone();
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
            s.record(TransferOp::Write, 10, true, Duration::from_micros(i));
        }
        s.record(TransferOp::Read, 5, false, Duration::ZERO);
        assert_eq!(s.bytes_write.load(Ordering::Relaxed), 1000);
        assert_eq!(s.ops_read.load(Ordering::Relaxed), 0);
        assert_eq!(s.errors.load(Ordering::Relaxed), 1);
        let l = s.latency();
        assert_eq!(l.count, 100);
        assert_eq!(l.max_us, 100.0);
        assert!((l.p50_us - 50.0).abs() <= 1.0);
    }
}
