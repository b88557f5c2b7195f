//! A completion queue: the tokens of settled requests, and an eventfd that is readable while
//! any are queued. An event loop watches the one descriptor (asyncio's `add_reader`, epoll, a
//! C program's poll) for every request it awaits: no thread and no polling per request.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crossbeam_queue::SegQueue;

use crate::error::{Error, Result};

/// Tokens of settled requests that asked for it ([`super::Request::report_to`]), with an
/// eventfd that becomes readable when one is queued.
pub struct CompletionQueue {
    ready: SegQueue<u64>,
    fd: OwnedFd,
}

impl CompletionQueue {
    /// A new, empty queue with its own non-blocking eventfd.
    pub fn new() -> Result<CompletionQueue> {
        // SAFETY: eventfd takes no pointers; a negative result is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::failed(format!(
                "cannot create the completion eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(CompletionQueue { ready: SegQueue::new(), fd })
    }

    /// The descriptor to watch for readability. Stays owned by the queue.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Queues a token and makes the descriptor readable.
    pub(crate) fn push(&self, token: u64) {
        self.ready.push(token);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. It can only fail when
        // the counter would overflow (then it is readable anyway) or with EAGAIN (the same).
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Every token queued so far, oldest first; clears the descriptor's readability first, so
    /// that a token queued during the call leaves it readable for the next round.
    pub fn drain(&self) -> Vec<u64> {
        self.take(usize::MAX)
    }

    /// At most `max` tokens, oldest first; the descriptor stays readable while more wait.
    pub fn take(&self, max: usize) -> Vec<u64> {
        let mut count: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from an eventfd we own (EAGAIN when zero).
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        let out: Vec<u64> = std::iter::from_fn(|| self.ready.pop()).take(max).collect();
        if !self.ready.is_empty() {
            let one: u64 = 1;
            // SAFETY: as in `push`.
            unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        out
    }
}
