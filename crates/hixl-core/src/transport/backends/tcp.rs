//! The `tcp` backend: any host. A link's data moves over TCP streams of its own, apart from the
//! control channel's (see `transport::streams`); device memory goes through pinned bounce
//! buffers (`transport::staging`).

use std::sync::Arc;

use crate::backend_names as names;
use crate::transport::backend::{Backend, OpenCtx};
use crate::transport::control::channel::ControlChannel;
use crate::transport::streams::{ConnectParams, TcpLink};
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// Any host: TCP streams of its own (`hixl.tcp.streams` of them), apart from the control
/// channel's; bytes go straight between sockets and registered host memory, and device memory
/// through pinned bounce buffers (`transport::staging`).
pub(crate) struct Tcp;

impl Backend for Tcp {
    fn name(&self) -> &'static str {
        names::TCP
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
        let params = ConnectParams { streams: ctx.opts.streams, data_path: true, ..ctx.params.clone() };
        let data = TcpLink::connect_data(control, ctx.addr, &params).map_err(|e| e.message)?;
        Ok(data)
    }
}
