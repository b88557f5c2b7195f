//! eventfd(2): the wake-up counters of the reactor, the RDMA rails and the completion queue.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::owned;

/// A new non-blocking, close-on-exec eventfd with counter 0.
pub(crate) fn create() -> io::Result<OwnedFd> {
    // SAFETY: a plain system call; its descriptor is owned by `owned`.
    owned(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })
}

/// Adds `n` to the counter (wakes its readers). A full counter (EAGAIN) is ignored: it is
/// readable already.
#[inline]
pub(crate) fn add(fd: &OwnedFd, n: u64) {
    // SAFETY: writes 8 bytes from a live u64.
    unsafe { libc::write(fd.as_raw_fd(), (&n as *const u64).cast(), 8) };
}

/// Reads and resets the counter: its value, or 0 when it was 0 (or the read failed).
#[inline]
pub(crate) fn take(fd: &OwnedFd) -> u64 {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64.
    unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    v
}
