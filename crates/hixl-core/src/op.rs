//! What a transfer is at the bottom: its direction and its contiguous pieces, the leaf types
//! that the queue, the counters and the system calls all speak.

/// Direction of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// Remote -> local.
    Read,
    /// Local -> remote.
    Write,
}

/// One contiguous piece of a transfer: `len` bytes between `local` and `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegPair {
    /// Local address.
    pub local: u64,
    /// Remote address.
    pub remote: u64,
    /// Length in bytes.
    pub len: u64,
}
