//! hixl-core: one-sided, batched, zero-copy memory transfers between engines.
//!
//! Engines (usually one per process) register memory, connect to each other and then READ or
//! WRITE each other's registered memory in batches; the target runs no application code.
//!
//! ```no_run
//! use hixl_core::{Engine, MemDesc, MemType, TransferOp, TransferOpDesc};
//! use std::time::Duration;
//!
//! let e = Engine::new();
//! e.initialize("127.0.0.1:0", &Default::default())?;
//! // Memory the engine may use for the rest of the program: registering it is safe.
//! let h = e.register_static(Box::leak(vec![7u8; 4096].into_boxed_slice()), "src")?;
//! // A buffer the caller keeps: registering it is `unsafe` (see `Engine::register_mem`).
//! let mut mine = vec![0u8; 4096];
//! // SAFETY: `mine` outlives the engine (finalized below) and is host memory of this process.
//! unsafe { e.register_mem(MemDesc { addr: mine.as_mut_ptr() as u64, len: 4096 }, MemType::Host)? };
//! e.connect("127.0.0.1:18001", Duration::from_secs(1))?;
//! let remote = e.remote_region("127.0.0.1:18001", "kv")?;
//! let d = TransferOpDesc { local_addr: h.addr, remote_addr: remote.addr, len: 4096 };
//! e.transfer_sync("127.0.0.1:18001", TransferOp::Write, &[d], Duration::from_secs(1))?;
//! e.finalize()?;
//! # Ok::<(), hixl_core::Error>(())
//! ```

#![warn(clippy::undocumented_unsafe_blocks)]

mod auth;
#[cfg(feature = "baselines")]
pub mod bench;
mod complete;
mod engine;
mod error;
pub mod log;
pub mod metrics;
mod notify;
mod options;
mod queue;
mod registry;
mod stats;
mod transport;
mod wire;

pub use engine::{
    ConnectStatus, Engine, MemDesc, MemHandle, PeerSnapshot, RemoteRegion, StridedDesc, TransferOpDesc,
    TransferReq,
};
pub use error::{Error, Result, Status};
pub use options::compat::{CompatKey, COMPAT as HIXL_OPTIONS};
pub use options::{keys as option_keys, OptionSpec, SPECS as OPTIONS};
pub use queue::{Completion, CompletionQueue, NotifyDesc, Request, Telemetry, TransferOp, TransferStatus};
pub use registry::{Access, MemType};
pub use stats::{LatencySummary, LATENCY_BUCKETS_US};
pub use transport::shm::{host_id, SharedMem};
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
}

/// The longest wait any call honours: a longer timeout (`Duration::MAX` included) means this.
pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(365 * 86_400);

/// `t`, at most [`MAX_WAIT`] (so that `Instant::now() + t` cannot overflow).
pub(crate) fn capped(t: std::time::Duration) -> std::time::Duration {
    t.min(MAX_WAIT)
}

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
