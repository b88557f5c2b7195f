//! pidfds: a descriptor for a process (never a reused pid), and taking a descriptor from it.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::owned;

/// pidfd_open(2): a pidfd for `pid`.
pub(crate) fn open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd)
}

/// pidfd_getfd(2): a duplicate of descriptor `fd` of the process behind `pidfd`.
pub(crate) fn get_fd(pidfd: &OwnedFd, fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in that process and flags, and
    // returns a new descriptor or -1.
    owned(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) } as RawFd)
}

/// Whether the process behind `pidfd` has exited (a pidfd is readable then).
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    super::poll_one(pidfd.as_raw_fd(), libc::POLLIN, 0).is_ok_and(|n| n > 0)
}
