//! The `rdma` backend's declaration (kept apart from `mod.rs` for its ten option rows).

use crate::options::rdma::{device, provider};
use crate::options::{int, spec, BackendDecl, Reach};

/// The `rdma` backend's declaration: its entry in the one table (`transport::backends`).
pub(crate) const DECL: BackendDecl = BackendDecl {
    name: super::NAME,
    meaning: "RDMA verbs",
    reach: Reach::Network,
    domains: "host, cuda (GPUDirect, where the NIC can register it)",
    offered: "only with a usable device",
    cli: false,
    baseline: "",
    options: &[
        spec("hixl.rdma.provider", "verbs", "rdma backend: verbs (libibverbs, loaded at run time) or soft (a software RC NIC between processes of one host, for tests)", |o, k, v| {
            o.rdma.provider = provider(k, v)?;
            Ok(())
        }),
        spec("hixl.rdma.device", "", "rdma backend: the device (e.g. mlx5_0), a comma list of devices (each a rail; large requests are striped across them), or all (every device with an active port); empty: the first with an active port", |o, k, v| {
            o.rdma.device = device(k, v)?;
            Ok(())
        }),
        spec("hixl.rdma.port", "1", "rdma backend: the device port (1..255)", |o, k, v| {
            o.rdma.port = int(k, v, 1, 255)? as u8;
            Ok(())
        }),
        spec("hixl.rdma.gid_index", "0", "rdma backend: the GID table index (0..255; RoCE v2 usually needs the index of an IPv4-mapped GID, see show_gids)", |o, k, v| {
            o.rdma.gid_index = int(k, v, 0, 255)? as u8;
            Ok(())
        }),
        spec("hixl.rdma.traffic_class", "0", "rdma backend: the traffic class of its queue pairs' GRH (0..255; RoCE: DSCP << 2)", |o, k, v| {
            o.rdma.traffic_class = int(k, v, 0, 255)? as u8;
            Ok(())
        }),
        spec("hixl.rdma.service_level", "0", "rdma backend: the service level of its queue pairs (0..15)", |o, k, v| {
            o.rdma.service_level = int(k, v, 0, 15)? as u8;
            Ok(())
        }),
        spec("hixl.rdma.qps", "2", "rdma backend: RC queue pairs per peer; large requests are split across them (1..64)", |o, k, v| {
            o.rdma.qps = int(k, v, 1, 64)? as usize;
            Ok(())
        }),
        spec(
            "hixl.rdma.busy_poll_us",
            "50",
            "rdma backend: a thread waiting for its own request polls the completion queue this many microseconds before it sleeps (0..100000; 0 = sleep at once)",
            |o, k, v| {
                o.rdma.busy_poll = std::time::Duration::from_micros(int(k, v, 0, 100_000)?);
                Ok(())
            },
        ),
        spec("hixl.rdma.max_qps", "1024", "rdma backend: most QPs a target makes for initiators in all (over it: refused)", |o, k, v| {
            o.rdma.max_qps = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        }),
        spec("hixl.rdma.max_qps_per_source", "256", "rdma backend: of those, most for one source address (over it: refused)", |o, k, v| {
            o.rdma.max_qps_per_source = int(k, v, 1, 1 << 20)? as usize;
            Ok(())
        }),
    ],
    host_facts: super::host_facts,
};
