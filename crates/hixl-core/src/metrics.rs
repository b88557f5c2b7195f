//! Prometheus text exposition (format 0.0.4) of engines' counters: bytes and operations by
//! peer, backend and op; failed requests by status; requests in flight; link state; RDMA
//! rails (up, bytes, returns); a latency histogram; registered memory. Pure formatting of snapshots: serving it is the caller's
//! (the Python package's `hixl.metrics.serve`, or a Rust service's own HTTP endpoint).
//!
//! Per-peer labels are capped: a fleet has thousands of peers, and a time series per peer and
//! label set would swamp a Prometheus server. The `max_peers` peers that moved the most bytes
//! keep their own `peer` label; the others are summed under `peer="_other"`.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::engine::{Engine, PeerSnapshot};
use crate::error::Result;
use crate::stats::LATENCY_BUCKETS_US;

/// The `peer` label of every peer past the cap.
pub const OTHER_PEERS: &str = "_other";
/// The `peer` label of transfers refused because no link to their peer existed.
pub const UNLINKED_PEERS: &str = "_unlinked";

/// One engine's state to expose.
pub struct EngineMetrics {
    /// Its `local_engine` (the `engine` label).
    pub engine: String,
    /// Its links.
    pub peers: Vec<PeerSnapshot>,
    /// Bytes registered.
    pub registered_bytes: u64,
    /// Regions registered.
    pub registered_regions: usize,
    /// Transfers refused because no link to their peer existed, by status
    /// ([`Engine::unlinked_errors`]): `hixl_errors_total{peer="_unlinked"}`.
    pub unlinked_errors: Vec<(crate::error::Status, u64)>,
}

impl EngineMetrics {
    /// A snapshot of `engine` now.
    pub fn of(engine: &Engine) -> Result<EngineMetrics> {
        Ok(EngineMetrics {
            engine: engine.local_engine()?,
            peers: engine.stats()?,
            registered_bytes: engine.registered_bytes()?,
            registered_regions: engine.registered_count()?,
            unlinked_errors: engine.unlinked_errors()?,
        })
    }
}

/// Counters of one (peer, backend) series, summed over the peers folded into it.
#[derive(Default)]
struct Series {
    up: u64,
    bytes: [u64; 2],
    ops: [u64; 2],
    notifies: u64,
    in_flight: i64,
    errors: BTreeMap<&'static str, u64>,
    buckets: Vec<u64>,
    sum_us: u64,
    queue_used: u64,
    queue_slots: u64,
    heartbeat_misses: u64,
    failovers: u64,
    /// RDMA rails by device: links with it up, bytes it completed, times it came back.
    rails: BTreeMap<String, [u64; 3]>,
}

impl Series {
    fn add(&mut self, p: &PeerSnapshot) {
        self.up += u64::from(p.alive);
        self.bytes[0] += p.bytes_write;
        self.bytes[1] += p.bytes_read;
        self.ops[0] += p.ops_write;
        self.ops[1] += p.ops_read;
        self.notifies += p.notifies;
        self.in_flight += p.in_flight;
        for (st, n) in &p.errors_by_status {
            *self.errors.entry(st.name()).or_default() += n;
        }
        if self.buckets.len() < p.latency_buckets.len() {
            self.buckets.resize(p.latency_buckets.len(), 0);
        }
        for (b, n) in self.buckets.iter_mut().zip(&p.latency_buckets) {
            *b += n;
        }
        self.sum_us += p.latency_sum_us;
        self.queue_used += p.queue_slots.0 as u64;
        self.queue_slots += p.queue_slots.1 as u64;
        self.heartbeat_misses += p.heartbeat_misses;
        self.failovers += p.failovers;
        for r in &p.rails {
            let e = self.rails.entry(r.device.clone()).or_default();
            e[0] += u64::from(r.up);
            e[1] += r.bytes;
            e[2] += r.returns;
        }
    }
}

/// Escapes a label value (backslash, double quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The series of one engine: its top `max_peers` peers by bytes moved, the rest folded.
fn series(m: &EngineMetrics, max_peers: usize) -> BTreeMap<(String, &'static str), Series> {
    let mut by_bytes: Vec<&PeerSnapshot> = m.peers.iter().collect();
    by_bytes.sort_by_key(|p| std::cmp::Reverse(p.bytes_write + p.bytes_read));
    let mut out: BTreeMap<(String, &'static str), Series> = BTreeMap::new();
    for (i, p) in by_bytes.into_iter().enumerate() {
        let peer = if i < max_peers { p.peer.clone() } else { OTHER_PEERS.to_string() };
        out.entry((peer, p.backend)).or_default().add(p);
    }
    out
}

type EngineSeries<'a> = (&'a EngineMetrics, BTreeMap<(String, &'static str), Series>);

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Writes `f`'s lines for every (engine, peer, backend) series, with their labels.
fn per_series(out: &mut String, all: &[EngineSeries<'_>], f: impl Fn(&mut String, &str, &Series)) {
    for (m, ss) in all {
        for ((peer, backend), s) in ss {
            let l = format!("engine=\"{}\",peer=\"{}\",backend=\"{backend}\"", label(&m.engine), label(peer));
            f(out, &l, s);
        }
    }
}

/// Writes one line per engine.
fn per_engine(
    out: &mut String,
    engines: &[EngineMetrics],
    name: &str,
    value: impl Fn(&EngineMetrics) -> u64,
) {
    for m in engines {
        let _ = writeln!(out, "{name}{{engine=\"{}\"}} {}", label(&m.engine), value(m));
    }
}

const OPS: [&str; 2] = ["write", "read"];

/// The exposition of `engines`, each peer label capped at `max_peers` per engine.
pub fn render(engines: &[EngineMetrics], max_peers: usize) -> String {
    let all: Vec<EngineSeries<'_>> = engines.iter().map(|m| (m, series(m, max_peers))).collect();
    let mut o = String::new();
    header(
        &mut o,
        "hixl_link_up",
        "gauge",
        "Usable links (1 per peer; for _other, how many of its links are).",
    );
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_link_up{{{l}}} {}", s.up);
    });
    header(&mut o, "hixl_bytes_total", "counter", "Bytes moved by completed requests.");
    per_series(&mut o, &all, |o, l, s| {
        for (k, op) in OPS.iter().enumerate() {
            let _ = writeln!(o, "hixl_bytes_total{{{l},op=\"{op}\"}} {}", s.bytes[k]);
        }
    });
    header(&mut o, "hixl_operations_total", "counter", "Completed requests.");
    per_series(&mut o, &all, |o, l, s| {
        for (k, op) in OPS.iter().enumerate() {
            let _ = writeln!(o, "hixl_operations_total{{{l},op=\"{op}\"}} {}", s.ops[k]);
        }
    });
    header(&mut o, "hixl_errors_total", "counter", "Failed or timed-out transfer requests by status.");
    per_series(&mut o, &all, |o, l, s| {
        for (st, n) in s.errors.iter().filter(|(st, _)| **st != "SUCCESS") {
            let _ = writeln!(o, "hixl_errors_total{{{l},status=\"{st}\"}} {n}");
        }
    });
    for m in engines {
        for (st, n) in &m.unlinked_errors {
            let (e, p) = (label(&m.engine), UNLINKED_PEERS);
            let _ = writeln!(
                o,
                "hixl_errors_total{{engine=\"{e}\",peer=\"{p}\",backend=\"\",status=\"{}\"}} {n}",
                st.name()
            );
        }
    }
    header(&mut o, "hixl_notifications_total", "counter", "Notifications delivered.");
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_notifications_total{{{l}}} {}", s.notifies);
    });
    let help = "Requests (transfers and notifications) submitted and not settled yet (timed out: settled).";
    header(&mut o, "hixl_requests_in_flight", "gauge", help);
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_requests_in_flight{{{l}}} {}", s.in_flight);
    });
    header(&mut o, "hixl_queue_slots_used", "gauge", "Request-queue slots in use.");
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_queue_slots_used{{{l}}} {}", s.queue_used);
    });
    header(&mut o, "hixl_queue_slots", "gauge", "Request-queue slots in all (hixl.queue_depth; 0: none).");
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_queue_slots{{{l}}} {}", s.queue_slots);
    });
    let help =
        "Heartbeat intervals in which nothing came from the peer and it acknowledged nothing but our probes.";
    header(&mut o, "hixl_heartbeats_missed_total", "counter", help);
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_heartbeats_missed_total{{{l}}} {}", s.heartbeat_misses);
    });
    let help =
        "Times the link's data path died while its control channel lived and the next backend took over \
                (labelled with the backend it moved to).";
    header(&mut o, "hixl_failovers_total", "counter", help);
    per_series(&mut o, &all, |o, l, s| {
        let _ = writeln!(o, "hixl_failovers_total{{{l}}} {}", s.failovers);
    });
    let rails = [
        ("hixl_rdma_rail_up", "gauge", "RDMA rails carrying parts (1; 0: left out after a failure; for _other, how many links have it up)."),
        ("hixl_rdma_rail_bytes_total", "counter", "Bytes of the parts an RDMA rail completed."),
        ("hixl_rdma_rail_returns_total", "counter", "Times an RDMA rail came back into the rotation after being left out."),
    ];
    for (k, (name, kind, help)) in rails.iter().enumerate() {
        header(&mut o, name, kind, help);
        per_series(&mut o, &all, |o, l, s| {
            for (dev, v) in &s.rails {
                let _ = writeln!(o, "{name}{{{l},device=\"{}\"}} {}", label(dev), v[k]);
            }
        });
    }
    let h = "hixl_request_duration_seconds";
    header(&mut o, h, "histogram", "Completed requests, from submission to completion.");
    per_series(&mut o, &all, |o, l, s| {
        let mut cumulative = 0;
        for (i, n) in s.buckets.iter().enumerate() {
            cumulative += n;
            let le =
                LATENCY_BUCKETS_US.get(i).map_or("+Inf".to_string(), |us| format!("{}", *us as f64 / 1e6));
            let _ = writeln!(o, "{h}_bucket{{{l},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(o, "{h}_sum{{{l}}} {}", s.sum_us as f64 / 1e6);
        let _ = writeln!(o, "{h}_count{{{l}}} {cumulative}");
    });
    header(&mut o, "hixl_registered_bytes", "gauge", "Bytes of memory registered.");
    per_engine(&mut o, engines, "hixl_registered_bytes", |m| m.registered_bytes);
    header(&mut o, "hixl_registered_regions", "gauge", "Regions registered.");
    per_engine(&mut o, engines, "hixl_registered_regions", |m| m.registered_regions as u64);
    header(&mut o, "hixl_peers", "gauge", "Links of the engine (before the peer-label cap).");
    per_engine(&mut o, engines, "hixl_peers", |m| m.peers.len() as u64);
    o
}
