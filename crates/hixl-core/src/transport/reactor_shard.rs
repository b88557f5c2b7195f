//! One I/O worker's epoll sets, its wake-up eventfd and its queue of scheduled sources (see
//! `reactor`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crossbeam_queue::SegQueue;

use super::os_error;
use crate::error::Result;

/// The token of the workers' wake-up eventfd.
pub(super) const WAKE: u64 = 0;
/// The token of a shard's second epoll set (see `Reactor::add_second`) in its first.
pub(super) const SECOND: u64 = u64::MAX;

/// One worker's epoll set, its wake-up eventfd and the sources scheduled on it.
///
/// Each shard has a second epoll set, itself registered in the first (level-triggered): epoll
/// holds one registration per descriptor and set, so the second direction of a stream is
/// registered there on the same descriptor instead of on a `dup` of it, and a stream costs
/// one descriptor, not two.
pub(super) struct Shard {
    pub(super) epfd: OwnedFd,
    pub(super) second: OwnedFd,
    pub(super) wake: OwnedFd,
    pub(super) scheduled: SegQueue<u64>,
}

impl Shard {
    /// Its two epoll sets and wake-up eventfd.
    pub(super) fn new() -> Result<Shard> {
        // SAFETY: plain system calls; the descriptors they return are owned below.
        let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epfd < 0 {
            return Err(os_error("epoll_create1"));
        }
        // SAFETY: `epfd` is a new descriptor nobody else owns.
        let epfd = unsafe { OwnedFd::from_raw_fd(epfd) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(os_error("eventfd"));
        }
        // SAFETY: `wake` is a new descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: WAKE };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        if unsafe { libc::epoll_ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, wake.as_raw_fd(), &mut ev) } != 0 {
            return Err(os_error("epoll_ctl(eventfd)"));
        }
        // SAFETY: a plain system call; the descriptor it returns is owned below.
        let second = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if second < 0 {
            return Err(os_error("epoll_create1"));
        }
        // SAFETY: `second` is a new descriptor nobody else owns.
        let second = unsafe { OwnedFd::from_raw_fd(second) };
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: SECOND };
        // SAFETY: both descriptors are open; `ev` is a valid event.
        if unsafe { libc::epoll_ctl(epfd.as_raw_fd(), libc::EPOLL_CTL_ADD, second.as_raw_fd(), &mut ev) } != 0
        {
            return Err(os_error("epoll_ctl(second set)"));
        }
        Ok(Shard { epfd, second, wake, scheduled: SegQueue::new() })
    }

    /// The epoll set an entry is registered in.
    pub(super) fn set(&self, second: bool) -> RawFd {
        if second {
            self.second.as_raw_fd()
        } else {
            self.epfd.as_raw_fd()
        }
    }

    /// Queues `token` for this shard's worker and wakes it.
    pub(super) fn schedule(&self, token: u64) {
        self.scheduled.push(token);
        self.ring();
    }

    pub(super) fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}
