//! Read guards that outlive the call that took them. A device copy is issued while the
//! peer's region table is read-locked (so a region cannot leave the table between the check
//! and the copy) but ends later, on the GPU; the table must stay read-locked until then, or the
//! peer could confirm a table without the region, and free it, while the copy still writes
//! into it. The engine's completion thread therefore keeps one read guard per link that has
//! copies in flight, taken with `try_read` (never waiting, so a waiting writer cannot
//! deadlock against the submitter that still holds its own guard) and dropped when the link's
//! last copy ended. Writers (table updates) wait for that, as they wait for `shm`'s copies.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLockReadGuard};
use std::task::{Context, Poll, Waker};

/// A guard the completion thread keeps; dropping it releases the lock.
pub(crate) type Held = Pin<Box<dyn Future<Output = ()>>>;
/// Takes a guard on the completion thread; None when it cannot without waiting.
pub(crate) type TryHold = Box<dyn FnOnce() -> Option<Held> + Send>;

/// A `TryHold` that read-locks the lock `lock(owner)` when it can without waiting.
///
/// The kept guard borrows the lock inside `*owner`, so it must live together with the `Arc`
/// that owns it. An `async` block is such a pair, made by the compiler: it owns `owner`, takes
/// the guard from it and then waits forever, holding both. Polled once here, it runs up to
/// that wait with the guard taken (or ends at once when the lock could not be had); dropping
/// it drops the guard, then `owner`. It is never polled again, so it needs no waker, and it
/// never leaves the completion thread (`Held` is not `Send`).
// Holding the guard across the await is the point: the await never resumes, and the block is
// only ever dropped, on the thread that polled it.
#[allow(clippy::await_holding_lock)]
pub(crate) fn try_hold<O, T>(
    owner: Arc<O>,
    lock: for<'a> fn(&'a O) -> Option<RwLockReadGuard<'a, T>>,
) -> TryHold
where
    O: Send + Sync + ?Sized + 'static,
    T: 'static,
{
    Box::new(move || {
        let mut held: Held = Box::pin(async move {
            let Some(_guard) = lock(&owner) else { return };
            std::future::pending::<()>().await;
        });
        match held.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Pending => Some(held),
            Poll::Ready(()) => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::RwLock;
    use std::time::Duration;

    #[test]
    fn a_kept_guard_holds_writers_off_until_it_is_dropped() {
        let lock = Arc::new(RwLock::new(0u32));
        let held = try_hold(lock.clone(), |l| l.try_read().ok())().expect("nothing holds the lock");
        drop(lock.clone()); // the guard does not depend on any other handle
        let l2 = lock.clone();
        let writer = std::thread::spawn(move || *l2.write().unwrap() = 7);
        std::thread::sleep(Duration::from_millis(100));
        assert!(!writer.is_finished(), "a writer got in while the guard was kept");
        drop(held);
        writer.join().unwrap();
        assert_eq!(*lock.read().unwrap(), 7);
    }

    #[test]
    fn it_never_waits_for_a_writer() {
        let lock = Arc::new(RwLock::new(0u32));
        let w = lock.write().unwrap();
        assert!(try_hold(lock.clone(), |l| l.try_read().ok())().is_none());
        drop(w);
        assert!(try_hold(lock, |l| l.try_read().ok())().is_some());
    }
}
