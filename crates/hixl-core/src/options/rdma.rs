//! The `rdma` backend's options (`hixl.rdma.*`), parsed by their rows in [`super::SPECS`].

use crate::error::{Error, Result};

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
    /// `hixl.rdma.device`: the device's name (empty: the first with an active port).
    pub device: String,
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
            device: String::new(),
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

/// Parses `hixl.rdma.device`: empty, or a device name as sysfs spells it.
pub(super) fn device(key: &str, v: &str) -> Result<String> {
    let ok =
        v.len() <= 64 && v.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.');
    if !ok {
        return Err(Error::param(format!(
            "option {key}={v:?} is invalid: expected a device name such as mlx5_0 (letters, digits, _ - .)"
        )));
    }
    Ok(v.to_string())
}
