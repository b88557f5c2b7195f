//! The `cuda_ipc` backend: same host, across processes, CUDA device memory (the role HIXL's
//! HCCS path plays between the NPUs of one server). Offered only where the CUDA driver loads
//! and sees a device; opened after the same-host proof, like `shm`, whose link it keeps for
//! host-to-host parts. Its registration key (per device region) is the allocation's legacy IPC
//! handle plus the region's offset in it (`cuda::key`). See `link.rs` for the data path and
//! `cuda::runtime` for the stream pool and the engine's one completion thread.

mod link;

use std::sync::Arc;

use crate::cuda::driver::Driver;
use crate::cuda::key::IpcKey;
use crate::cuda::runtime::GpuSlot;
use crate::cuda::CtxGuard;
use crate::error::{Error, Result, Status};
use crate::options::{no_host_facts, BackendDecl, Reach};
use crate::transport::backend::{with_local_socket, Backend, MemorySpan, OpenCtx};
use crate::transport::backends::shm::ShmLink;
use crate::transport::control::channel::ControlChannel;
use crate::transport::same_host::prove_same_host;
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// The backend's name, as `hixl.backends` and `stats()` spell it.
pub(crate) const NAME: &str = "cuda_ipc";

/// The `cuda_ipc` backend's declaration: its entry in the one table (`transport::backends`).
pub(crate) const DECL: BackendDecl = BackendDecl {
    name: NAME,
    meaning: "same host, CUDA memory too",
    reach: Reach::Host,
    domains: "host, cuda",
    offered: "only where CUDA is found",
    cli: true,
    baseline: "cma",
    options: &[],
    host_facts: no_host_facts,
};

/// Host and CUDA memory, in every combination (`Cuda(0)` stands for every `cuda:N`).
const PAIRS: &[(Domain, Domain)] = &[
    (Domain::Host, Domain::Host),
    (Domain::Cuda(0), Domain::Cuda(0)),
    (Domain::Cuda(0), Domain::Host),
    (Domain::Host, Domain::Cuda(0)),
];

/// The backend (one per engine); its `Gpu` (streams, completion thread) is made on the first
/// device copy of any of its links.
#[derive(Default)]
pub(crate) struct CudaIpc {
    slot: Arc<GpuSlot>,
}

impl Backend for CudaIpc {
    fn name(&self) -> &'static str {
        NAME
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        PAIRS
    }

    fn capability(&self, local_socket: &str) -> Option<Capability> {
        // Only whether CUDA is installed: initialising it is left to the first device use.
        Driver::loadable().ok()?;
        with_local_socket(self, local_socket)
    }

    fn register(&self, mem: &MemorySpan) -> Result<Option<Vec<u8>>> {
        if !matches!(mem.domain(), Domain::Cuda(_)) {
            return Ok(None);
        }
        let r = crate::cuda::resolve(mem.addr(), mem.len(), mem.domain())?;
        let Domain::Cuda(ordinal) = r.domain else { return Ok(None) };
        self.slot.note_device(ordinal);
        if !r.ipc_capable {
            tracing::info!(
                addr = mem.addr(),
                "device memory a legacy IPC handle cannot export: no cuda_ipc key"
            );
            return Ok(None);
        }
        let d = crate::cuda::driver()?;
        let _ctx = CtxGuard::enter(d, ordinal)?;
        // The allocation's base, in its device's context.
        let h = d
            .ipc_mem_handle(r.alloc_base)
            .map_err(|rc| Error::new(Status::Unsupported, d.check(rc, "cuIpcGetMemHandle").unwrap_err()))?;
        let key =
            IpcKey { ordinal, handle: h.reserved, offset: mem.addr() - r.alloc_base, alloc_len: r.alloc_len };
        Ok(Some(key.encode()))
    }

    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        Driver::loadable()?;
        let proven = prove_same_host(ctx, control.as_ref(), &offer.param)?;
        let (pid, pidfd) =
            (proven.pid, proven.pidfd.try_clone().map_err(|e| format!("dup of the pidfd: {e}"))?);
        let pool = ctx.params.reactor.copy_pool(ctx.opts.shm_workers()).map_err(|e| e.message)?;
        let shm = ShmLink::new(control.clone(), proven, pool, ctx.opts.queue_depth).map_err(|e| e.message)?;
        Ok(Arc::new(link::CudaIpcPath(link::CudaIpcLink::new(
            control.clone(),
            shm,
            self.slot.clone(),
            ctx.opts.cuda_streams,
            pid,
            pidfd,
        ))))
    }
}
