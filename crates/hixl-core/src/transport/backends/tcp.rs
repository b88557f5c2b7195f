//! The `tcp` backend: any host. A link's data moves over TCP streams of its own, apart from the
//! control channel's (see `transport::streams`); device memory goes through pinned bounce
//! buffers (`transport::staging`).

use std::sync::Arc;

use crate::options::{int, no_host_facts, spec, BackendDecl, Reach};
use crate::transport::backend::{Backend, OpenCtx};
use crate::transport::control::channel::ControlChannel;
use crate::transport::staging::StagedPath;
use crate::transport::streams::{ConnectParams, TcpLink, NAME};
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// The `tcp` backend's declaration: its entry in the one table (`transport::backends`).
pub(crate) const DECL: BackendDecl = BackendDecl {
    name: NAME,
    meaning: "any host",
    reach: Reach::Network,
    domains: "host, cuda (staged through pinned host buffers)",
    offered: "",
    cli: true,
    baseline: "tcp",
    options: &[
        spec("hixl.tcp.streams", "2", "TCP streams per peer link (1..64)", |o, k, v| {
            {
                o.streams = int(k, v, 1, 64)? as usize;
                Ok(())
            }
        }),
        spec(
            "hixl.tcp.io_threads",
            "0",
            "I/O worker threads that run every TCP stream of the engine (0 = one per two cores, 2 to 8)",
            |o, k, v| {
                o.io_threads = int(k, v, 0, 64)? as usize;
                Ok(())
            },
        ),
        spec(
            "hixl.tcp.busy_poll_us",
            "50",
            "I/O workers, and a thread waiting for its small request, poll this many microseconds after activity before sleeping (0..10000; 0 = sleep at once)",
            |o, k, v| {
                o.busy_poll = std::time::Duration::from_micros(int(k, v, 0, 10_000)?);
                Ok(())
            },
        ),
        spec(
            "hixl.tcp.coalesce_us",
            "0",
            "wait this long for more small requests to send together (0 = off)",
            |o, k, v| {
                o.coalesce = std::time::Duration::from_micros(int(k, v, 0, 1_000_000)?);
                Ok(())
            },
        ),
        spec("hixl.tcp.coalesce_max_ops", "64", "most requests in one coalesced batch (1..4096)", |o, k, v| {
            {
                o.coalesce_max_ops = int(k, v, 1, 4096)? as usize;
                Ok(())
            }
        }),
    ],
    host_facts: no_host_facts,
};

/// Any host: TCP streams of its own (`hixl.tcp.streams` of them), apart from the control
/// channel's; bytes go straight between sockets and registered host memory, and device memory
/// through pinned bounce buffers (`transport::staging`).
pub(crate) struct Tcp;

impl Backend for Tcp {
    fn name(&self) -> &'static str {
        NAME
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        crate::transport::staging::TCP_PAIRS
    }

    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        _offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        let params = ConnectParams { streams: ctx.opts.streams, ..ctx.params.clone() };
        let data = TcpLink::connect_data(control, ctx.addr, &params).map_err(|e| e.message)?;
        // Requests that touch device memory are staged through pinned host buffers on it.
        Ok(StagedPath::wrap(data, control.clone(), ctx.stager.clone()))
    }
}
