//! Engine options: a string map with documented keys. Unknown keys and bad values are
//! `PARAM_INVALID` naming the key and the value.
//!
//! The rows here ([`SPECS`]) are the engine-wide options. A backend's own options
//! (`hixl.tcp.*`, `hixl.shm.*`, `hixl.rdma.*`) are rows of its [`BackendDecl`], declared in its
//! own module under `transport::backends` and listed by the one table there. Options must not
//! import transport (that made a 21-file import circle), so this module never names the table:
//! [`Options::parse_with`], [`Options::defaults_with`] and [`keys_with`] take the declarations
//! as an argument, and the engine, which sits above both, composes them once
//! (`engine::option_table`: `Options::parse`, `Options::default()` and `option_keys`).

use std::collections::HashMap;
use std::time::Duration;

use crate::auth::Secret;
use crate::error::{Error, Result};

pub mod addr;
pub mod compat;
mod decl;
pub mod rdma;
mod suggest;

/// Environment variable that supplies the cluster secret when `hixl.secret` is not given.
pub const SECRET_ENV: &str = "HIXL_SECRET";

pub use decl::{backends_help, no_host_facts, BackendDecl, HostFacts, Reach};

/// `hixl.backends` as a list of this build's backends (`built`, fastest first); `auto` is every
/// one of them in that order.
fn backends(key: &str, v: &str, built: &[&str]) -> Result<Vec<String>> {
    if v.trim().eq_ignore_ascii_case("auto") {
        return Ok(built.iter().map(|b| b.to_string()).collect());
    }
    let names: Vec<String> = v.split(',').map(|s| s.trim().to_ascii_lowercase()).collect();
    let bad = names.iter().find(|n| !built.contains(&n.as_str()));
    if names.iter().all(|n| n.is_empty()) || bad.is_some() {
        return Err(Error::param(format!(
            "option {key}={v:?} is invalid: expected auto or a comma-separated list of {} (this build's backends)",
            built.join(", ")
        )));
    }
    let mut out: Vec<String> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    Ok(out)
}

/// Parsed options with their defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// `hixl.tcp.streams`: TCP streams per peer link.
    pub streams: usize,
    /// `hixl.queue_depth`: request-queue slots per link (a request takes one per stream share).
    pub queue_depth: usize,
    /// `hixl.split_bytes`: requests of at least this many bytes are split across the streams.
    pub split_bytes: u64,
    /// `hixl.transfer_timeout_ms`: deadline of a transfer, notify or disconnect that gives none.
    pub transfer_timeout: Duration,
    /// `hixl.connect_timeout_ms`: deadline of a connect that gives none (and of `connect_async`).
    pub connect_timeout: Duration,
    /// `hixl.handshake_timeout_ms`: one deadline for a new stream's whole handshake.
    pub handshake_timeout: Duration,
    /// `hixl.deregister_timeout_ms`: how long deregistration waits for in-flight transfers
    /// before aborting their links.
    pub deregister_timeout: Duration,
    /// `hixl.max_notifies` .. `hixl.max_notify_bytes_total`: pending received notifications
    /// per connection and in total, by count and by bytes.
    pub notify_limits: crate::notify::NotifyLimits,
    /// `hixl.backends`: the backends that may carry a link's data, in the order they are tried.
    pub backends: Vec<String>,
    /// `hixl.tcp.io_threads`: I/O workers of the engine (0: sized for the machine; see
    /// [`Options::io_workers`]).
    pub io_threads: usize,
    /// `hixl.tcp.busy_poll_us`: how long an I/O worker, and a thread waiting for its own
    /// small request, keep polling after activity before they sleep.
    pub busy_poll: Duration,
    /// `hixl.shm.threads`: copy threads of the engine (0: sized for the machine; see
    /// [`Options::shm_workers`]).
    pub shm_threads: usize,
    /// `hixl.cuda.streams`: CUDA streams an engine spreads device copies over.
    pub cuda_streams: usize,
    /// `hixl.cuda.stage_chunk`: bytes of one pinned bounce slot when device memory is staged
    /// over TCP.
    pub stage_chunk: u64,
    /// `hixl.cuda.stage_depth`: bounce slots (chunks under way) per staged request.
    pub stage_depth: usize,
    /// `hixl.strict_alignment`: strided bases and strides must be multiples of 64 bytes.
    pub strict_alignment: bool,
    /// `hixl.tcp.coalesce_us`: a TCP writer waits this long for more small requests (0 = off).
    pub coalesce: Duration,
    /// `hixl.tcp.coalesce_max_ops`: most requests one coalesced batch takes.
    pub coalesce_max_ops: usize,
    /// `hixl.secret` (or `HIXL_SECRET`): peers must prove they know it before anything else.
    pub secret: Option<Secret>,
    /// `hixl.heartbeat_ms`: idle links are probed this often; a peer silent for three
    /// intervals is declared dead (zero: off).
    pub heartbeat: Duration,
    /// `hixl.cpus`: where hixl's threads run, as given (checked and read at `initialize`,
    /// with `HIXL_CPUS`, by `place::capture`).
    pub cpus: Option<String>,
    /// `hixl.data_mac`: on sealed streams, MAC every transfer's bytes too (needs a secret).
    pub data_mac: bool,
    /// `hixl.max_pending_handshakes`: most accepted streams whose handshake has not ended.
    pub max_pending_handshakes: usize,
    /// `hixl.max_pending_per_source`: most of those from one source address.
    pub max_pending_per_source: usize,
    /// `hixl.max_streams`: most established (handshake ended) streams the listener serves
    /// (0: half of RLIMIT_NOFILE's soft limit, read at each handshake).
    pub max_streams: usize,
    /// `hixl.max_streams_per_source`: most of those from one source address (0: a quarter).
    pub max_streams_per_source: usize,
    /// HIXL's `AutoConnect`: engines to connect to (in the background) once initialized.
    pub auto_connect: Vec<String>,
    /// `hixl.rdma.*`: the `rdma` backend's settings.
    pub rdma: rdma::RdmaOptions,
    /// This build's backends, fastest first (the names of the declarations the options were
    /// parsed with): what `auto` means and what `hixl.backends` may name.
    pub built: Vec<&'static str>,
}

/// One engine option: its key, its default (empty: unset), what it means (for `hixl info` and
/// the README's table, which a test holds to this one) and how a value is parsed into the
/// engine's options. The one definition of every option.
pub struct OptionSpec {
    /// The key, as `initialize` takes it.
    pub key: &'static str,
    /// The default, as text (empty: unset).
    pub default: &'static str,
    /// What it does, with its range.
    pub meaning: &'static str,
    apply: fn(&mut Options, &str, &str) -> Result<()>,
}

/// A row of an option table (here, or a backend's declaration).
pub const fn spec(
    key: &'static str,
    default: &'static str,
    meaning: &'static str,
    apply: fn(&mut Options, &str, &str) -> Result<()>,
) -> OptionSpec {
    OptionSpec { key, default, meaning, apply }
}

fn ms(k: &str, v: &str, min: u64) -> Result<Duration> {
    int(k, v, min, 86_400_000).map(Duration::from_millis)
}

/// Every engine-wide option, in the order `hixl info` lists them (a backend's own options are
/// in its [`BackendDecl`]).
pub const SPECS: &[OptionSpec] = &[
    spec(
        "hixl.backends",
        "auto",
        // The full text, with every backend of the table, is `backends_help`'s.
        "backends that may carry data, tried in this order",
        |o, k, v| {
            o.backends = backends(k, v, &o.built)?;
            Ok(())
        },
    ),
    spec("hixl.queue_depth", "4096", "request-queue slots per link (1..1048576)", |o, k, v| {
        {
            o.queue_depth = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        }
    }),
    spec("hixl.split_bytes", "1048576", "requests of at least this many bytes are split across streams", |o, k, v| {
        {
            o.split_bytes = int(k, v, 1, u64::MAX)?;
            Ok(())
        }
    }),
    spec("hixl.transfer_timeout_ms", "10000", "deadline of a transfer (sync or async), put/get, send_notify or disconnect that gives none", |o, k, v| {
        {
            o.transfer_timeout = ms(k, v, 1)?;
            Ok(())
        }
    }),
    spec("hixl.connect_timeout_ms", "3000", "deadline of connect (and connect_async) when it gives none", |o, k, v| {
        {
            o.connect_timeout = ms(k, v, 1)?;
            Ok(())
        }
    }),
    spec(
        "hixl.handshake_timeout_ms",
        "5000",
        "one deadline for a new stream's whole handshake (both sides)",
        |o, k, v| {
            o.handshake_timeout = ms(k, v, 1)?;
            Ok(())
        },
    ),
    spec(
        "hixl.deregister_timeout_ms",
        "5000",
        "wait for in-flight transfers before aborting them; also drops a peer that owes a table update this long",
        |o, k, v| {
            o.deregister_timeout = ms(k, v, 0)?;
            Ok(())
        },
    ),
    spec("hixl.max_notifies", "4096", "pending received notifications per connection", |o, k, v| {
        {
            o.notify_limits.per_conn = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        }
    }),
    spec("hixl.max_notify_bytes", "16777216", "pending received notification bytes per connection", |o, k, v| {
        {
            o.notify_limits.per_conn_bytes = int(k, v, 1, 1 << 40)? as usize;
            Ok(())
        }
    }),
    spec("hixl.max_notifies_total", "65536", "pending received notifications in all", |o, k, v| {
        {
            o.notify_limits.total = int(k, v, 1, 1 << 24)? as usize;
            Ok(())
        }
    }),
    spec("hixl.max_notify_bytes_total", "268435456", "pending received notification bytes in all", |o, k, v| {
        {
            o.notify_limits.total_bytes = int(k, v, 1, 1 << 40)? as usize;
            Ok(())
        }
    }),
    spec("hixl.cuda.streams", "4", "CUDA streams an engine spreads device copies over (1..64)", |o, k, v| {
        {
            o.cuda_streams = int(k, v, 1, 64)? as usize;
            Ok(())
        }
    }),
    spec(
        "hixl.cuda.stage_chunk",
        "4194304",
        "bytes of one pinned bounce slot when device memory is staged over TCP (65536..67108864)",
        |o, k, v| {
            o.stage_chunk = int(k, v, 64 << 10, crate::cuda::stage_plan::MAX_FRAME)?;
            Ok(())
        },
    ),
    spec(
        "hixl.cuda.stage_depth",
        "4",
        "bounce slots (chunks under way) per request when device memory is staged over TCP (2..16)",
        |o, k, v| {
            o.stage_depth = int(k, v, 2, 16)? as usize;
            Ok(())
        },
    ),
    spec(
        "hixl.strict_alignment",
        "1",
        "1: strided bases and strides must be multiples of 64 bytes; 0: any",
        |o, k, v| {
            o.strict_alignment = int(k, v, 0, 1)? == 1;
            Ok(())
        },
    ),
    spec(
        "hixl.secret",
        "",
        "cluster secret, at least 32 random hex characters without a pattern (`hixl secret` makes \
         one); peers must prove they know it and every frame is MACed; env HIXL_SECRET",
        |o, _, v| {
            o.secret = Some(Secret::new(v)?);
            Ok(())
        },
    ),
    spec(
        "hixl.data_mac",
        "0",
        "1: with a secret, MAC every transfer's bytes too (detects tampering; costs a hash pass)",
        |o, k, v| {
            o.data_mac = int(k, v, 0, 1)? == 1;
            Ok(())
        },
    ),
    spec(
        "hixl.max_pending_handshakes",
        "256",
        "most accepted streams still in their handshake (the oldest is closed)",
        |o, k, v| {
            o.max_pending_handshakes = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        },
    ),
    spec(
        "hixl.max_pending_per_source",
        "32",
        "of those, most from one source address (its oldest is closed)",
        |o, k, v| {
            o.max_pending_per_source = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        },
    ),
    spec(
        "hixl.max_streams",
        "0",
        "most established streams the listener serves, over it refused (0: half the descriptor limit)",
        |o, k, v| {
            o.max_streams = int(k, v, 0, 1 << 20)? as usize;
            Ok(())
        },
    ),
    spec(
        "hixl.max_streams_per_source",
        "0",
        "of those, most from one source address (0: a quarter of the descriptor limit)",
        |o, k, v| {
            o.max_streams_per_source = int(k, v, 0, 1 << 20)? as usize;
            Ok(())
        },
    ),
    spec(
        "hixl.heartbeat_ms",
        "1000",
        "probe idle links this often; a peer silent for 3 intervals is dead (0 = off)",
        |o, k, v| {
            o.heartbeat = Duration::from_millis(int(k, v, 0, 600_000)?);
            Ok(())
        },
    ),
    spec(
        "hixl.cpus",
        "",
        "CPUs (a list such as 0-3,6) every hixl thread runs on; env HIXL_CPUS; default: those \
         the thread calling initialize may use",
        |o, _k, v| {
            o.cpus = Some(v.to_string());
            Ok(())
        },
    ),
];

/// Every option row: [`SPECS`], then each backend's own, in the order of `decls`.
fn rows<'a>(decls: &'a [&'static BackendDecl]) -> impl Iterator<Item = &'static OptionSpec> + 'a {
    SPECS.iter().chain(decls.iter().flat_map(|d| d.options.iter()))
}

/// Every accepted key with its default and meaning, for docs and `hixl info`: [`SPECS`] and
/// the backends' rows, `hixl.backends`' meaning made by [`backends_help`].
pub fn keys_with(decls: &[&'static BackendDecl]) -> Vec<(&'static str, &'static str, String)> {
    rows(decls)
        .map(|s| {
            let meaning = if s.key == "hixl.backends" { backends_help(decls) } else { s.meaning.to_string() };
            (s.key, s.default, meaning)
        })
        .collect()
}

/// `v` as an integer in `min..=max`, or `PARAM_INVALID` naming `key` and `v`.
pub fn int(key: &str, v: &str, min: u64, max: u64) -> Result<u64> {
    match v.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => {
            Err(Error::param(format!("option {key}={v:?} is invalid: expected an integer in {min}..={max}")))
        }
    }
}

impl Options {
    /// The number of I/O workers to start: `hixl.tcp.io_threads`, or when 0 one per two
    /// cores, at least 2 and at most 8.
    pub fn io_workers(&self) -> usize {
        if self.io_threads > 0 {
            return self.io_threads;
        }
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        (cores / 2).clamp(2, 8)
    }

    /// The number of same-host copy workers: `hixl.shm.threads`, or when 0 one per two cores,
    /// at least 2 and at most 8.
    pub fn shm_workers(&self) -> usize {
        if self.shm_threads > 0 {
            return self.shm_threads;
        }
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        (cores / 2).clamp(2, 8)
    }

    fn blank(built: Vec<&'static str>) -> Options {
        Options {
            built,
            streams: 0,
            queue_depth: 0,
            split_bytes: 0,
            transfer_timeout: Duration::ZERO,
            connect_timeout: Duration::ZERO,
            handshake_timeout: Duration::ZERO,
            deregister_timeout: Duration::ZERO,
            notify_limits: crate::notify::NotifyLimits {
                per_conn: 0,
                per_conn_bytes: 0,
                total: 0,
                total_bytes: 0,
            },
            backends: Vec::new(),
            shm_threads: 0,
            io_threads: 0,
            busy_poll: Duration::ZERO,
            cuda_streams: 0,
            stage_chunk: 0,
            stage_depth: 0,
            strict_alignment: false,
            coalesce: Duration::ZERO,
            coalesce_max_ops: 0,
            secret: None,
            heartbeat: Duration::ZERO,
            cpus: None,
            data_mac: false,
            max_pending_handshakes: 0,
            max_pending_per_source: 0,
            max_streams: 0,
            max_streams_per_source: 0,
            auto_connect: Vec::new(),
            rdma: rdma::RdmaOptions::blank(),
        }
    }

    /// Every option at the default of its row, with these backends' rows (the engine's
    /// `Options::default()` passes the table's).
    pub fn defaults_with(decls: &[&'static BackendDecl]) -> Options {
        let mut o = Options::blank(decls.iter().map(|d| d.name).collect());
        for spec in rows(decls).filter(|s| !s.default.is_empty()) {
            (spec.apply)(&mut o, spec.key, spec.default).expect("every default of a row parses");
        }
        o
    }

    /// Parses a string map on top of the defaults, with these backends' rows (the engine's
    /// `Options::parse` passes the table's).
    pub fn parse_with(map: &HashMap<String, String>, decls: &[&'static BackendDecl]) -> Result<Options> {
        let mut o = Options::defaults_with(decls);
        let mut given: Vec<(String, String, &str)> = Vec::new();
        for (k, v) in map {
            if let Some(spec) = compat::check(k, v) {
                match spec?.key {
                    "AutoConnect" => o.auto_connect = compat::auto_connect_peers(v),
                    // Checked to be 1..=64; `hixl.cuda.streams`, applied below, wins.
                    "stream_count" => o.cuda_streams = v.trim().parse().unwrap_or(o.cuda_streams),
                    _ => {}
                }
                let Some(key) = compat::hixl_key(k) else { continue };
                if let Some((_, _, first)) = given.iter().find(|(g, _, _)| g == key) {
                    return Err(Error::param(format!(
                        "options {first:?} and {k:?} set the same thing ({key}): give one of them"
                    )));
                }
                given.push((key.to_string(), v.clone(), k.as_str()));
                continue;
            }
            // A HIXL key taken above may already set this one.
            if let Some((_, _, first)) = given.iter().find(|(g, _, _)| g == k) {
                return Err(Error::param(format!(
                    "options {first:?} and {k:?} set the same thing ({k}): give one of them"
                )));
            }
            given.push((k.clone(), v.clone(), k.as_str()));
        }
        given.sort();
        for (key, v, k) in &given {
            // Errors name the key as the caller spelt it (a HIXL key included).
            let Some(spec) = rows(decls).find(|s| s.key == key) else {
                let known: Vec<_> = rows(decls).map(|s| s.key).collect();
                let hixl_keys = compat::COMPAT.iter().map(|c| c.key);
                let hint = suggest::closest(k, known.iter().copied().chain(hixl_keys))
                    .map_or(String::new(), |c| format!(" (did you mean {c:?}?)"));
                // The value is not echoed: a misspelt secret key must not leak the secret.
                return Err(Error::param(format!(
                    "unknown option key {k:?}{hint}; known keys: {}",
                    known.join(", ")
                )));
            };
            (spec.apply)(&mut o, k, v)?;
        }
        if o.secret.is_none() {
            if let Ok(v) = std::env::var(SECRET_ENV) {
                if !v.is_empty() {
                    o.secret = Some(Secret::new(&v)?);
                }
            }
        }
        if o.data_mac && o.secret.is_none() {
            return Err(Error::param(
                "option hixl.data_mac=1 needs a cluster secret (hixl.secret or HIXL_SECRET): data MACs \
                 are keyed by the session keys an authenticated handshake derives",
            ));
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests;
