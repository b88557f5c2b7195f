//! Awaiting a request from async Rust: [`Completion`] is a `Future` woken by the completer when
//! the request settles, with no runtime dependency and no polling. A request past its deadline
//! is woken by one timer thread for the whole process, which sleeps until the next deadline of
//! an awaited request.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Instant;

use super::{Request, TransferStatus};
use crate::error::Result;

/// The future of one request: `Ok(())` when it completed, its error otherwise (TIMEOUT once
/// its deadline has passed). Dropping it abandons the wait, not the transfer.
pub struct Completion {
    req: Arc<Request>,
    timer_armed: bool,
}

impl Completion {
    pub(super) fn new(req: Arc<Request>) -> Completion {
        Completion { req, timer_armed: false }
    }
}

impl Future for Completion {
    type Output = Result<()>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.req.status() != TransferStatus::Waiting {
            return Poll::Ready(self.req.result());
        }
        self.req.set_waker(cx.waker().clone());
        if !self.timer_armed {
            self.timer_armed = true;
            deadlines().watch(&self.req);
        }
        // It may have settled between the first look and the waker being set.
        if self.req.status() != TransferStatus::Waiting {
            return Poll::Ready(self.req.result());
        }
        Poll::Pending
    }
}

/// Deadlines of awaited requests, earliest first, and the thread that acts on them.
struct Deadlines {
    due: Mutex<BinaryHeap<Reverse<(Instant, u64)>>>,
    reqs: Mutex<std::collections::HashMap<u64, Weak<Request>>>,
    changed: Condvar,
}

/// (heap entries, requests watched) of the deadline thread, for tests.
#[cfg(test)]
pub(super) fn watched_counts() -> (usize, usize) {
    let d = deadlines();
    let reqs = d.reqs.lock().unwrap().len();
    (d.due.lock().unwrap().len(), reqs)
}

/// Forgets a settled request that an awaited future had the deadline thread watch.
pub(super) fn forget(req: &Request) {
    deadlines().forget(req as *const Request as u64);
}

fn deadlines() -> &'static Deadlines {
    static D: OnceLock<&'static Deadlines> = OnceLock::new();
    D.get_or_init(|| {
        let d: &'static Deadlines = Box::leak(Box::new(Deadlines {
            due: Mutex::new(BinaryHeap::new()),
            reqs: Mutex::new(std::collections::HashMap::new()),
            changed: Condvar::new(),
        }));
        // One thread for the process, asleep until the earliest deadline.
        let _ = crate::place::spawn("hixl-deadlines".into(), move || d.run());
        d
    })
}

impl Deadlines {
    fn watch(&self, req: &Arc<Request>) {
        let key = Arc::as_ptr(req) as u64;
        req.mark_watched();
        self.reqs.lock().unwrap().insert(key, Arc::downgrade(req));
        self.due.lock().unwrap().push(Reverse((req.deadline(), key)));
        self.changed.notify_one();
    }

    /// A watched request settled: forget it now rather than at its deadline; the heap is
    /// rebuilt from what is still watched when it has grown to twice that.
    fn forget(&self, key: u64) {
        let mut reqs = self.reqs.lock().unwrap();
        reqs.remove(&key);
        let mut due = self.due.lock().unwrap();
        if due.len() > 2 * reqs.len() + 64 {
            due.retain(|Reverse((_, k))| reqs.contains_key(k));
        }
    }

    fn run(&self) {
        let mut due = self.due.lock().unwrap();
        loop {
            let now = Instant::now();
            match due.peek().copied() {
                Some(Reverse((at, key))) if at <= now => {
                    due.pop();
                    // Never both locks at once in this order: `forget` takes `reqs`, then `due`.
                    drop(due);
                    let req = self.reqs.lock().unwrap().remove(&key).and_then(|w| w.upgrade());
                    if let Some(req) = req {
                        // Past its deadline, `status` settles it TIMEOUT, which wakes it.
                        req.status();
                        req.wake();
                    }
                    due = self.due.lock().unwrap();
                }
                Some(Reverse((at, _))) => due = self.changed.wait_timeout(due, at - now).unwrap().0,
                None => due = self.changed.wait(due).unwrap(),
            }
        }
    }
}
