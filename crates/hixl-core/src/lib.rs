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
//! let mut buf = vec![7u8; 4096];
//! let h = e.register_mem(MemDesc { addr: buf.as_mut_ptr() as u64, len: 4096 }, MemType::Host)?;
//! e.connect("127.0.0.1:18001", Duration::from_secs(1))?;
//! let remote = e.remote_mems("127.0.0.1:18001")?[0];
//! let d = TransferOpDesc { local_addr: h.addr, remote_addr: remote.addr, len: 4096 };
//! e.transfer_sync("127.0.0.1:18001", TransferOp::Write, &[d], Duration::from_secs(1))?;
//! e.finalize()?;
//! # Ok::<(), hixl_core::Error>(())
//! ```

pub mod auth;
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
