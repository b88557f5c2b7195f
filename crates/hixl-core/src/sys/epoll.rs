//! epoll(7): creating a set, changing what it watches, and waiting on it.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use super::{cvt, owned};

/// A new epoll set (close-on-exec).
pub(crate) fn create() -> io::Result<OwnedFd> {
    // SAFETY: a plain system call; its descriptor is owned by `owned`.
    owned(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })
}

/// Adds `fd` to the set `epfd` with `events`, tagged with `data`.
#[inline]
pub(crate) fn add(epfd: RawFd, fd: RawFd, events: u32, data: u64) -> io::Result<()> {
    ctl(epfd, libc::EPOLL_CTL_ADD, fd, events, data)
}

/// Changes what the set `epfd` watches on `fd` (ENOENT when it is not there).
#[inline]
pub(crate) fn modify(epfd: RawFd, fd: RawFd, events: u32, data: u64) -> io::Result<()> {
    ctl(epfd, libc::EPOLL_CTL_MOD, fd, events, data)
}

/// Removes `fd` from the set `epfd`.
#[inline]
pub(crate) fn delete(epfd: RawFd, fd: RawFd) -> io::Result<()> {
    // SAFETY: EPOLL_CTL_DEL ignores the event pointer (null is allowed since Linux 2.6.9).
    cvt(unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, std::ptr::null_mut()) }).map(drop)
}

#[inline]
fn ctl(epfd: RawFd, op: libc::c_int, fd: RawFd, events: u32, data: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: data };
    // SAFETY: `ev` is a valid, live event; the kernel only reads it.
    cvt(unsafe { libc::epoll_ctl(epfd, op, fd, &mut ev) }).map(drop)
}

/// Waits up to `timeout_ms` (-1: no limit, 0: never blocks) for events of the set into `evs`;
/// how many came, or the error (EINTR included).
#[inline]
pub(crate) fn wait(
    epfd: &OwnedFd,
    evs: &mut [libc::epoll_event],
    timeout_ms: libc::c_int,
) -> io::Result<usize> {
    let max = evs.len().min(libc::c_int::MAX as usize) as libc::c_int;
    // SAFETY: `evs` has room for `max` events and is exclusively borrowed.
    cvt(unsafe { libc::epoll_wait(epfd.as_raw_fd(), evs.as_mut_ptr(), max, timeout_ms) }).map(|n| n as usize)
}
