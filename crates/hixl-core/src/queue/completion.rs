//! A completion queue: the tokens of settled requests, and an eventfd that is readable while
//! any are queued. An event loop watches the one descriptor (asyncio's `add_reader`, epoll, a
//! C program's poll) for every request it awaits: no thread and no polling per request.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};
use crate::sys::eventfd;

/// Tokens of settled requests that asked for it ([`super::Request::report_to`]), with an
/// eventfd that becomes readable when one is queued.
pub struct CompletionQueue {
    ready: SegQueue<u64>,
    fd: OwnedFd,
}

impl CompletionQueue {
    /// A new, empty queue with its own non-blocking eventfd.
    pub fn new() -> Result<CompletionQueue> {
        let fd = eventfd::create()
            .map_err(|e| Error::failed(format!("cannot create the completion eventfd: {e}")))?;
        Ok(CompletionQueue { ready: SegQueue::new(), fd })
    }

    /// The descriptor to watch for readability. Stays owned by the queue.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Queues a token and makes the descriptor readable.
    pub(crate) fn push(&self, token: u64) {
        self.ready.push(token);
        // It can only fail when the counter would overflow (then it is readable anyway) or
        // with EAGAIN (the same).
        eventfd::add(&self.fd, 1);
    }

    /// Every token queued so far, oldest first; clears the descriptor's readability first, so
    /// that a token queued during the call leaves it readable for the next round.
    pub fn drain(&self) -> Vec<u64> {
        self.take(usize::MAX)
    }

    /// At most `max` tokens, oldest first; the descriptor stays readable while more wait.
    pub fn take(&self, max: usize) -> Vec<u64> {
        eventfd::take(&self.fd); // EAGAIN when zero
        let out: Vec<u64> = std::iter::from_fn(|| self.ready.pop()).take(max).collect();
        if !self.ready.is_empty() {
            eventfd::add(&self.fd, 1);
        }
        out
    }
}
