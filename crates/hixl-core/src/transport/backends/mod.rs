//! The backends, and the one table that lists them.
//!
//! Each backend is one module here implementing [`Backend`] (and its [`DataPath`](super::DataPath));
//! [`by_name`] is the table the engine builds `hixl.backends` from, and the names themselves
//! are spelt once, in `backend_names`.

pub mod cuda_ipc;
pub mod rdma;
pub mod same_process;
pub mod shm;
pub mod tcp;

use std::sync::Arc;

use crate::backend_names as names;
use crate::options::Options;
use crate::transport::backend::Backend;

pub use crate::backend_names::BUILT;

/// The backend called `name`, if this build has it, set up with the engine's options.
pub fn by_name(name: &str, opts: &Options) -> Option<Arc<dyn Backend>> {
    match name {
        names::SELF => Some(Arc::new(same_process::SameProcess)),
        names::CUDA_IPC => Some(Arc::new(cuda_ipc::CudaIpc::default())),
        names::SHM => Some(Arc::new(shm::Shm)),
        names::RDMA => Some(Arc::new(rdma::Rdma::new(opts))),
        names::TCP => Some(Arc::new(tcp::Tcp)),
        _ => None,
    }
}
