//! The backends, and the one table that lists them.
//!
//! Each backend is one module here implementing [`Backend`] (and its [`DataPath`](super::DataPath))
//! and declaring itself at its top (`DECL`: name, meaning, domains, CLI presence, its options).
//! [`TABLE`] lists the modules, fastest first: [`BUILT`], [`by_name`], [`decls`] (which the
//! engine composes the options from, since options may not import transport) and Python's
//! `hixl.backends()` all read it. Adding a backend is its module and one row here.

pub mod cuda_ipc;
pub mod rdma;
pub mod same_process;
pub mod shm;
pub mod tcp;

use std::sync::Arc;

use crate::options::{BackendDecl, Options};
use crate::transport::backend::Backend;

/// One row of [`TABLE`]: a backend's declaration and how it is made from the options.
pub struct Entry {
    /// What the backend declares about itself.
    pub decl: &'static BackendDecl,
    make: fn(&Options) -> Arc<dyn Backend>,
}

/// Every backend of this build, fastest first (the order of `auto`). `rdma` is offered (and
/// tried) only where its device is usable; on one host `shm` goes first.
pub const TABLE: &[Entry] = &[
    Entry { decl: &same_process::DECL, make: |_| Arc::new(same_process::SameProcess) },
    Entry { decl: &cuda_ipc::DECL, make: |_| Arc::new(cuda_ipc::CudaIpc::default()) },
    Entry { decl: &shm::DECL, make: |_| Arc::new(shm::Shm) },
    Entry { decl: &rdma::DECL, make: |o| Arc::new(rdma::Rdma::new(o)) },
    Entry { decl: &tcp::DECL, make: |_| Arc::new(tcp::Tcp) },
];

/// The backends' declarations, in [`TABLE`]'s order.
pub fn decls() -> Vec<&'static BackendDecl> {
    TABLE.iter().map(|e| e.decl).collect()
}

/// The names of this build's backends, fastest first (the default of `hixl.backends`).
pub static BUILT: std::sync::LazyLock<Vec<&'static str>> =
    std::sync::LazyLock::new(|| TABLE.iter().map(|e| e.decl.name).collect());

/// The backend called `name`, if this build has it, set up with the engine's options.
pub fn by_name(name: &str, opts: &Options) -> Option<Arc<dyn Backend>> {
    TABLE.iter().find(|e| e.decl.name == name).map(|e| (e.make)(opts))
}
