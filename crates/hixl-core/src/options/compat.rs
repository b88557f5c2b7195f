//! Option keys of Huawei's HIXL (CANN's `Initialize` options) and of the documents hixl started
//! from, accepted so that a program written for HIXL initializes unchanged. Each is checked
//! like a hixl option (a bad value is PARAM_INVALID naming it); one with a hixl equivalent acts
//! through it, and the others log once per process that they have no effect here.

use crate::error::{Error, Result};

/// One HIXL option key: what hixl does with it, and how its value is checked.
pub struct CompatKey {
    /// The key as HIXL spells it.
    pub key: &'static str,
    /// What it does in hixl (README row).
    pub effect: &'static str,
    /// Whether it acts (false: accepted, checked and logged as having no effect).
    pub acts: bool,
    check: fn(&str) -> std::result::Result<(), String>,
}

fn ints_in(v: &str, lo: u64, hi: u64) -> std::result::Result<(), String> {
    match v.trim().parse::<u64>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(()),
        _ => Err(format!("expected an integer in {lo}..={hi}")),
    }
}

fn buffer_pool(v: &str) -> std::result::Result<(), String> {
    let ok = v
        .split_once(':')
        .is_some_and(|(n, mb)| n.trim().parse::<u32>().is_ok() && mb.trim().parse::<u32>().is_ok());
    ok.then_some(()).ok_or_else(|| "expected BUFFER_NUM:BUFFER_SIZE_MB, for example 4:8 (0:0: none)".into())
}

fn engine_list(v: &str) -> std::result::Result<(), String> {
    let bad = auto_connect_peers(v).into_iter().find(|p| super::addr::parse_addr(p).is_err());
    match bad {
        None => Ok(()),
        Some(p) => Err(format!("{p:?} is not an engine address (ip:port)")),
    }
}

/// The keys, in README order.
pub const COMPAT: &[CompatKey] = &[
    CompatKey {
        key: "AutoConnect",
        effect: "comma-separated engine addresses (`ip:port`): initialize starts `connect_async` to each; see `get_async_connect_status`",
        acts: true,
        check: engine_list,
    },
    CompatKey {
        key: "BufferPool",
        effect: "`N:MB` staging buffers: none here, host memory moves without staging (checked, logged)",
        acts: false,
        check: buffer_pool,
    },
    CompatKey {
        key: "stream_count",
        effect: "the seeds' copy-stream pool: sets `hixl.cuda.streams` (1..=64), which wins when both are given",
        acts: true,
        check: |v| ints_in(v, 1, 64),
    },
    CompatKey {
        key: "RdmaTrafficClass",
        effect: "RDMA traffic class 0..=255: sets `hixl.rdma.traffic_class` (the GRH traffic class of the rdma backend's queue pairs)",
        acts: true,
        check: |v| ints_in(v, 0, 255),
    },
    CompatKey {
        key: "RdmaServiceLevel",
        effect: "RDMA service level 0..=7: sets `hixl.rdma.service_level` (the rdma backend's queue pairs' SL)",
        acts: true,
        check: |v| ints_in(v, 0, 7),
    },
    CompatKey {
        key: "EnableUseFabricMem",
        effect: "Ascend HCCS fabric memory, 0 or 1: no counterpart here (checked, logged)",
        acts: false,
        check: |v| ints_in(v, 0, 1),
    },
    CompatKey {
        key: "GlobalResourceConfig",
        effect: "HIXL's resource sizing (JSON): none, use `hixl.queue_depth` and `hixl.tcp.streams` (logged)",
        acts: false,
        check: |v| if v.trim().is_empty() { Err("expected a non-empty value".into()) } else { Ok(()) },
    },
];

/// The hixl option a HIXL key sets, for those that map onto one.
pub(super) fn hixl_key(key: &str) -> Option<&'static str> {
    match key {
        "RdmaTrafficClass" => Some("hixl.rdma.traffic_class"),
        "RdmaServiceLevel" => Some("hixl.rdma.service_level"),
        _ => None,
    }
}

/// The engine addresses listed in an `AutoConnect` value.
pub fn auto_connect_peers(v: &str) -> Vec<String> {
    v.split(',').map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect()
}

/// Checks `key=value` when `key` is one of HIXL's; `None` when it is not. Keys without effect
/// are logged once per process.
pub(super) fn check(key: &str, value: &str) -> Option<Result<&'static CompatKey>> {
    let spec = COMPAT.iter().find(|c| c.key == key)?;
    if let Err(why) = (spec.check)(value) {
        return Some(Err(Error::param(format!("option {key}={value:?} (a HIXL option) is invalid: {why}"))));
    }
    if !spec.acts {
        static LOGGED: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
        let mut logged = LOGGED.lock().unwrap();
        if !logged.contains(&spec.key) {
            logged.push(spec.key);
            tracing::info!(
                "option {key} (a HIXL option) is accepted and has no effect here: {}",
                spec.effect
            );
        }
    }
    Some(Ok(spec))
}
