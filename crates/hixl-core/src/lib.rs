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

pub mod auth;
#[cfg(feature = "baselines")]
pub mod bench;
mod complete;
pub mod engine;
pub mod error;
pub mod log;
pub mod notify;
pub mod options;
pub mod queue;
pub mod registry;
pub mod stats;
pub mod transport;
pub mod wire;

pub use engine::{
    ConnectStatus, Engine, MemDesc, MemHandle, PeerSnapshot, RemoteRegion, StridedDesc, TransferOpDesc,
    TransferReq,
};
pub use error::{Error, Result, Status};
pub use queue::{NotifyDesc, TransferOp, TransferStatus};
pub use registry::{Access, MemType};

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
