//! One I/O worker's epoll sets, its wake-up eventfd and its queue of scheduled sources (see
//! `reactor`).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crossbeam_queue::SegQueue;

use super::os_error;
use crate::error::Result;
use crate::sys::{epoll, eventfd};

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
        let epfd = epoll::create().map_err(|_| os_error("epoll_create1"))?;
        let wake = eventfd::create().map_err(|_| os_error("eventfd"))?;
        epoll::add(epfd.as_raw_fd(), wake.as_raw_fd(), libc::EPOLLIN as u32, WAKE)
            .map_err(|_| os_error("epoll_ctl(eventfd)"))?;
        let second = epoll::create().map_err(|_| os_error("epoll_create1"))?;
        epoll::add(epfd.as_raw_fd(), second.as_raw_fd(), libc::EPOLLIN as u32, SECOND)
            .map_err(|_| os_error("epoll_ctl(second set)"))?;
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
        eventfd::add(&self.wake, 1);
    }
}
