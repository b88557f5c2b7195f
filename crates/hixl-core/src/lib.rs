//! hixl-core: one-sided, batched, zero-copy memory transfers between engines.
//!
//! # Concepts
//!
//! - An [`Engine`] (usually one per process) is initialized with a local address: `"ip:port"`
//!   listens (port 0 picks a free one), `"ip"` alone is a client only.
//! - It **registers** memory: a range of this process that peers may READ (and WRITE, unless
//!   it is registered read-only), optionally under a name. Registering a raw range is
//!   `unsafe` (the caller promises the memory stays valid); [`Engine::register_static`] and
//!   [`Engine::alloc`] are the safe ways.
//! - It **connects** to peers. A link picks the first backend of `hixl.backends` that can
//!   serve the peer: `self` (same process, memcpy), `cuda_ipc` (same host, CUDA device memory
//!   too, where CUDA is installed), `shm` (same host, cross-memory attach), `tcp` (anywhere).
//! - Device memory is the domain `MemType::Cuda(n)`; the CUDA driver is loaded at run time, and
//!   without it registering device memory is `UNSUPPORTED` ([`cuda_info`] says why). Each side holds a copy of the other's region table.
//! - It **transfers**: a batch of [`TransferOpDesc`] (local address, remote address, length)
//!   is one request, READ (remote to local) or WRITE (local to remote), checked against both
//!   tables, queued, and carried without the peer's application doing anything.
//!   [`Engine::transfer_async`] returns a [`TransferReq`] to wait on, poll, or `.await`
//!   ([`Request::completion`]).
//! - **Notifications** (a name and a message) can follow a transfer's bytes or go alone.
//!
//! # Two engines
//!
//! ```
//! use hixl_core::{Engine, TransferOp, TransferOpDesc};
//! use std::time::Duration;
//!
//! let target = Engine::new();
//! target.initialize("127.0.0.1:0", &Default::default())?; // listens on a free port
//! let kv = target.register_static(Box::leak(vec![0u8; 4096].into_boxed_slice()), "kv")?;
//!
//! let e = Engine::new();
//! e.initialize("127.0.0.1", &Default::default())?; // a client
//! let src = e.register_static(Box::leak(vec![7u8; 4096].into_boxed_slice()), "src")?;
//! let peer = target.local_engine()?;
//! e.connect(&peer, Duration::from_secs(5))?;
//! let remote = e.remote_region(&peer, "kv")?;
//! let d = TransferOpDesc { local_addr: src.addr, remote_addr: remote.addr, len: 4096 };
//! e.transfer_sync(&peer, TransferOp::Write, &[d], Duration::from_secs(5))?;
//! // SAFETY: `kv` was leaked above (lives for the program) and the transfer has ended.
//! let landed = unsafe { std::slice::from_raw_parts(kv.addr as *const u8, 4096) };
//! assert!(landed.iter().all(|b| *b == 7));
//! e.finalize()?;
//! target.finalize()?;
//! # Ok::<(), hixl_core::Error>(())
//! ```
//!
//! # Errors
//!
//! Every call returns [`Result`]; an [`Error`] has a [`Status`] (the numbers HIXL uses:
//! `PARAM_INVALID` 103900, `TIMEOUT` 103901, ...) and a message that names the value that was
//! wrong. A request that fails after it was queued reports its error through
//! [`Request::result`] (or its future).
//!
//! # Options
//!
//! [`Engine::initialize`] takes a string map: every `hixl.*` key is in [`OPTIONS`] with its
//! default and meaning (`hixl.backends`, `hixl.tcp.streams`, `hixl.transfer_timeout_ms`,
//! `hixl.secret`, ...); Huawei HIXL's own keys ([`HIXL_OPTIONS`]) are accepted too. An unknown
//! key or a bad value is `PARAM_INVALID`.
//!
//! # Async
//!
//! `engine.transfer_async(...)?.completion().await` works on any executor: the engine wakes
//! the task when the request settles (no runtime dependency, no polling), and one timer
//! thread per process wakes it at its deadline. For event loops in other languages,
//! [`CompletionQueue`] gives one descriptor that becomes readable when requests settle.
//!
//! # Logging and metrics
//!
//! The engine emits `tracing` events and installs no subscriber ([`log`] has hixl's own);
//! [`metrics`] renders the engines' counters as Prometheus text.

#![warn(clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]

mod auth;
#[cfg(feature = "baselines")]
pub mod bench;
mod complete;
mod cuda;
mod engine;
mod error;
pub mod log;
pub mod metrics;
mod notify;
mod op;
mod options;
pub mod place;
mod queue;
mod registry;
mod stats;
mod sys;
mod transport;
mod wait;
pub use wait::MAX_WAIT;
mod wire;

pub use cuda::{info as cuda_info, CudaDevice, CudaInfo, DeviceBuffer};
pub use engine::option_table::option_keys;
pub use engine::{
    ConnectStatus, Engine, MemDesc, MemHandle, PeerSnapshot, RemoteRegion, StridedDesc, TransferOpDesc,
    TransferReq, Waiting,
};
pub use error::{Error, Result, Status};
/// What a wait for notifications named `names` waits for, in words (its `TIMEOUT` says it).
#[doc(hidden)]
pub use notify::waited_for as notifies_waited_for;
pub use options::compat::{CompatKey, COMPAT as HIXL_OPTIONS};
pub use options::{BackendDecl, HostFacts, OptionSpec, Reach, SPECS as OPTIONS};
pub use queue::{Completion, CompletionQueue, NotifyDesc, Request, Telemetry, TransferOp, TransferStatus};
pub use registry::{Access, MemType};
pub use stats::{LatencySummary, LATENCY_BUCKETS_US};
pub use transport::backends::shm::{host_id, SharedMem};
pub use transport::backends::{Entry as BackendEntry, TABLE as BACKENDS};
pub use transport::RailSnapshot;
pub use wire::Domain;

/// The engine's internals, for hixl's own fuzz targets, benchmarks and tests. Nothing here is
/// part of the API: it changes without notice; services use the items at the crate root.
#[doc(hidden)]
pub mod unstable {
    /// Session keys and frame MACs.
    pub mod auth {
        pub use crate::auth::*;
    }
    /// The sans-IO wire protocol.
    pub mod wire {
        pub use crate::wire::*;
    }
    /// Requests, parts and the work queue.
    pub mod queue {
        pub use crate::queue::*;
    }
    /// The registry and remote tables.
    pub mod registry {
        pub use crate::registry::*;
    }
    /// How a batch is merged and cut into parts.
    pub use crate::engine::{push_merged, split};
    /// The RDMA backend's verbs interface and its software provider (cross-process tests).
    pub mod rdma {
        pub use crate::transport::backends::rdma::verbs;
        pub use crate::transport::backends::rdma::verbs::soft::{
            SoftVerbs, DEVICES_ENV, FAIL_AFTER_ENV, FAULT_ENV, LATENCY_ENV,
        };
        pub use crate::wire::rdma::QpAddr;

        /// The provider `hixl.rdma.provider` names ("verbs" or "soft").
        pub fn open_provider(name: &str) -> crate::Result<std::sync::Arc<dyn verbs::Verbs>> {
            crate::transport::backends::rdma::provider(crate::options::rdma::provider("provider", name)?)
        }
    }
}

/// What RDMA looks like here with the provider `hixl.rdma.provider` names ("verbs" or "soft"):
/// "not loadable: ..." (libibverbs missing), "no device ..." or "devices: ..." (for `hixl info`).
pub fn rdma_info(provider: &str) -> Result<String> {
    transport::backends::rdma::describe(provider)
}

/// How the `rdma` backend would register GPU memory here with the provider `hixl.rdma.provider`
/// names: "dmabuf", "peermem" or "no (missing: ...)" (for `hixl info`; docs/RDMA.md, "GPU
/// memory (GPUDirect)"). Initialises CUDA where it is present.
pub fn gpudirect_info(provider: &str) -> Result<String> {
    transport::backends::rdma::gpudirect::describe(provider)
}

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
