//! The `rdma` backend's options (`hixl.rdma.*`), parsed by the rows of its declaration
//! (`transport::backends::rdma::DECL`).

use crate::error::{Error, Result};
pub use crate::wire::rdma::MAX_RAILS;

/// Which implementation of the verbs the `rdma` backend uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// libibverbs, loaded at run time (a real device: a NIC, or rxe/siw).
    Verbs,
    /// The software RC model between processes of one host (tests; never chosen by default).
    Soft,
}

impl Provider {
    /// Its name, as `hixl.rdma.provider` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Verbs => "verbs",
            Provider::Soft => "soft",
        }
    }
}

/// `hixl.rdma.*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaOptions {
    /// `hixl.rdma.provider`.
    pub provider: Provider,
    /// `hixl.rdma.device`: which devices carry data (each one a rail).
    pub device: Devices,
    /// `hixl.rdma.port`: the port (from 1).
    pub port: u8,
    /// `hixl.rdma.gid_index`: the GID table entry (RoCE v2 usually needs a non-zero one).
    pub gid_index: u8,
    /// `hixl.rdma.qps`: RC queue pairs per peer (a large request is split across them).
    pub qps: usize,
    /// `hixl.rdma.traffic_class` (or HIXL's `RdmaTrafficClass`): the GRH traffic class.
    pub traffic_class: u8,
    /// `hixl.rdma.service_level` (or HIXL's `RdmaServiceLevel`): the service level.
    pub service_level: u8,
    /// `hixl.rdma.max_qps`: most QPs this engine makes for initiators, all links together.
    pub max_qps: usize,
    /// `hixl.rdma.max_qps_per_source`: most of those for one source address.
    pub max_qps_per_source: usize,
    /// `hixl.rdma.busy_poll_us`: how long a thread waiting for its own request polls the
    /// completion queue itself before it sleeps (zero: it sleeps at once and the poller thread
    /// completes the request).
    pub busy_poll: std::time::Duration,
}

impl RdmaOptions {
    pub(super) fn blank() -> RdmaOptions {
        RdmaOptions {
            provider: Provider::Verbs,
            device: Devices::First,
            port: 0,
            gid_index: 0,
            qps: 0,
            traffic_class: 0,
            service_level: 0,
            max_qps: 0,
            max_qps_per_source: 0,
            busy_poll: std::time::Duration::ZERO,
        }
    }
}

/// Parses `hixl.rdma.provider`.
pub(crate) fn provider(key: &str, v: &str) -> Result<Provider> {
    match v.trim().to_ascii_lowercase().as_str() {
        "verbs" => Ok(Provider::Verbs),
        "soft" => Ok(Provider::Soft),
        _ => Err(Error::param(format!("option {key}={v:?} is invalid: expected verbs or soft"))),
    }
}

/// What `hixl.rdma.device` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Devices {
    /// Empty: the first device whose port is active (one rail).
    First,
    /// `all`: every device whose port is active (at most [`MAX_RAILS`]), each a rail.
    All,
    /// One name, or a comma list of names: each a rail, in this order.
    Named(Vec<String>),
}

/// Parses `hixl.rdma.device`: empty, `all`, or one device name or a comma list of them (as
/// sysfs spells them), at most [`MAX_RAILS`], none twice.
pub(crate) fn device(key: &str, v: &str) -> Result<Devices> {
    let t = v.trim();
    if t.is_empty() {
        return Ok(Devices::First);
    }
    if t.eq_ignore_ascii_case("all") {
        return Ok(Devices::All);
    }
    let names: Vec<&str> = t.split(',').map(str::trim).collect();
    let bad_name = |n: &str| {
        n.is_empty()
            || n.len() > 64
            || !n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
    };
    if let Some(n) = names.iter().find(|n| bad_name(n)) {
        return Err(Error::param(format!(
            "option {key}={v:?} is invalid: {n:?} is not a device name such as mlx5_0 (letters, digits,              _ - .); expected one, a comma list, or all"
        )));
    }
    if names.len() > MAX_RAILS {
        return Err(Error::param(format!(
            "option {key}={v:?} is invalid: {} devices, at most {MAX_RAILS}",
            names.len()
        )));
    }
    if let Some((i, n)) = names.iter().enumerate().find(|(i, n)| names[..*i].contains(n)) {
        return Err(Error::param(format!("option {key}={v:?} is invalid: {n:?} is named twice (at {i})")));
    }
    Ok(Devices::Named(names.into_iter().map(String::from).collect()))
}
