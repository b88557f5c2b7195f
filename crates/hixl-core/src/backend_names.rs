//! The names of the backends this build has: the one place each is spelt. `hixl.backends`,
//! the capabilities a Welcome advertises, the region table's backend keys, `stats()` and the
//! logs all use these constants, and the option parser checks a list against [`BUILT`]. A leaf
//! module, so that the options and every backend can name each other's backends without
//! importing each other.

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

/// Every backend of this build, fastest first (the default of `hixl.backends`). `rdma` is
/// offered (and tried) only where its device is usable; on one host `shm` goes first.
pub const BUILT: &[&str] = &[SELF, CUDA_IPC, SHM, RDMA, TCP];
