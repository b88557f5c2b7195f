//! Read guards that outlive the call that took them. A device copy is issued while the
//! peer's region table is read-locked (so a region cannot leave the table between the check
//! and the copy) but ends later, on the GPU; the table must stay read-locked until then, or the
//! peer could confirm a table without the region, and free it, while the copy still writes
//! into it. The engine's completion thread therefore keeps one read guard per link that has
//! copies in flight, taken with `try_read` (never waiting, so a waiting writer cannot
//! deadlock against the submitter that still holds its own guard) and dropped when the link's
//! last copy ended. Writers (table updates) wait for that, as they wait for `shm`'s copies.

use std::any::Any;
use std::sync::{Arc, RwLockReadGuard};

/// A guard the completion thread keeps; dropping it releases the lock.
pub(crate) type Held = Box<dyn Any>;
/// Takes a guard on the completion thread; None when it cannot without waiting.
pub(crate) type TryHold = Box<dyn FnOnce() -> Option<Held> + Send>;

/// A read guard together with the `Arc` that owns its lock.
struct Kept<O: ?Sized, T: 'static> {
    // Declared first: dropped before `_owner`, whose lock it borrows.
    _guard: RwLockReadGuard<'static, T>,
    _owner: Arc<O>,
}

/// A `TryHold` that read-locks the lock `lock(owner)` when it can without waiting.
pub(crate) fn try_hold<O, T>(
    owner: Arc<O>,
    lock: for<'a> fn(&'a O) -> Option<RwLockReadGuard<'a, T>>,
) -> TryHold
where
    O: Send + Sync + ?Sized + 'static,
    T: 'static,
{
    Box::new(move || {
        let guard = lock(&owner)?;
        // SAFETY: the guard borrows a lock inside `*owner`, which lives on the heap behind
        // the `Arc` and so does not move; `Kept` keeps that `Arc` and drops the guard first,
        // so the lock outlives the guard. The guard is never handed to another thread: it is
        // made, kept and dropped on the completion thread (`Held` is not `Send`).
        let guard: RwLockReadGuard<'static, T> = unsafe { std::mem::transmute(guard) };
        Some(Box::new(Kept { _guard: guard, _owner: owner }) as Held)
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
