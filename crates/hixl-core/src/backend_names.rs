//! The names of the backends this build has: the one place each is spelt. Each backend's
//! declaration (`DECL` in its module under `transport::backends`, listed by the table there)
//! names its constant; the capabilities a Welcome advertises, the region table's backend keys,
//! `stats()` and the logs use them too. A leaf module, because code below the backends needs a
//! name without importing upward: the stream link (`transport::streams`, which every backend's
//! control channel is) labels itself `tcp`, and the deprecated `hixl.transport` maps `shm` and
//! `tcp`. Everything else about a backend (its order, options, domains) is in its declaration.

/// Two engines of one process (memcpy).
pub const SELF: &str = "self";
/// Same host, CUDA memory too (CUDA IPC handles).
pub const CUDA_IPC: &str = "cuda_ipc";
/// Same host (cross-memory attach and sealed memfd mappings).
pub const SHM: &str = "shm";
/// RDMA verbs.
pub const RDMA: &str = "rdma";
/// Any host: TCP streams of its own.
pub const TCP: &str = "tcp";
