//! In-flight pins of one region, taken and released without a lock.
//!
//! Every transfer pins the regions it touches, on both sides, so the hot path must not
//! serialise on a region: a KV cache is one region that every link and every stream of the
//! engine uses at once. A pin is two atomic increments: the region's live count and the count of
//! the holder's slot (a holder is a link or a served stream). A holder claims one of a few slots
//! the first time it pins the region, under the region's lock; after that its pins never lock.
//! Holders that find every slot taken count under the lock instead (an engine with more busy
//! links than slots on one region pays a lock, as before, and nothing breaks).
//!
//! Deregistration sets the closing bit (new pins fail), waits for the live count to reach zero,
//! and when it does not in time aborts exactly the holders whose counts are not zero.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::Region;
use crate::error::{Error, Result};

/// Something that holds pins and can be told to stop using memory (a link or a served stream).
pub trait Abort: Send + Sync {
    /// Stop all I/O as soon as possible; pins must be released shortly after.
    fn abort(&self, why: &str);
    /// This holder's number, from [`new_holder_id`], fixed for its life.
    fn holder_id(&self) -> u64;
}

/// A number no other pin holder of this process has (0 is never returned).
pub fn new_holder_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Slots per region. Fixed: each costs 16 bytes per region, and a holder that finds none free
/// still works (it counts under the lock).
const SLOTS: usize = 8;
/// The live count's top bit: the region is being deregistered.
const CLOSING: u64 = 1 << 63;

#[derive(Default)]
struct Slot {
    /// The holder id that owns the slot; 0: free.
    owner: AtomicU64,
    /// Its live pins.
    count: AtomicU64,
}

#[derive(Default)]
struct Slow {
    /// Every holder that owns a slot or counts in `overflow`, to abort it.
    holders: HashMap<u64, Weak<dyn Abort>>,
    /// Live pins of holders without a slot.
    overflow: HashMap<u64, u64>,
}

/// The pins of one region.
#[derive(Default)]
pub(super) struct Pins {
    /// `CLOSING` | number of live pins.
    live: AtomicU64,
    slots: [Slot; SLOTS],
    slow: Mutex<Slow>,
    released: Condvar,
}

/// Where a pin is counted.
enum Counted {
    Slot(usize),
    Overflow(u64),
}

impl Pins {
    /// Counts a pin for `holder`, refusing when closing.
    fn take(&self, holder: &Arc<dyn Abort>) -> Option<Counted> {
        let id = holder.holder_id();
        // Attribute first, then count as live: whatever the live count shows, a deregistration
        // that finds it non-zero also finds the holder.
        let at = match self.slots.iter().position(|s| s.owner.load(Ordering::Acquire) == id) {
            Some(k) => {
                self.slots[k].count.fetch_add(1, Ordering::AcqRel);
                Counted::Slot(k)
            }
            None => self.take_slow(id, holder),
        };
        if self.live.fetch_add(1, Ordering::SeqCst) & CLOSING != 0 {
            self.give(&at);
            return None;
        }
        Some(at)
    }

    /// First pin of a holder on this region (or no slot left): claim a slot under the lock.
    fn take_slow(&self, id: u64, holder: &Arc<dyn Abort>) -> Counted {
        let mut slow = self.slow.lock().unwrap();
        slow.holders.insert(id, Arc::downgrade(holder));
        // Another thread of the same holder may have claimed one meanwhile.
        if let Some(k) = self.slots.iter().position(|s| s.owner.load(Ordering::Acquire) == id) {
            self.slots[k].count.fetch_add(1, Ordering::AcqRel);
            return Counted::Slot(k);
        }
        for (k, s) in self.slots.iter().enumerate() {
            let owner = s.owner.load(Ordering::Acquire);
            // A free slot, or one whose holder is gone with no pins left (a dead holder takes
            // no new pins, and slots are only claimed under this lock).
            let reusable = owner == 0
                || (s.count.load(Ordering::Acquire) == 0
                    && slow.holders.get(&owner).is_none_or(|w| w.strong_count() == 0));
            if reusable {
                if owner != 0 {
                    slow.holders.remove(&owner);
                }
                s.count.fetch_add(1, Ordering::AcqRel);
                s.owner.store(id, Ordering::Release);
                return Counted::Slot(k);
            }
        }
        *slow.overflow.entry(id).or_default() += 1;
        Counted::Overflow(id)
    }

    /// Releases one pin.
    fn give(&self, at: &Counted) {
        match *at {
            Counted::Slot(k) => {
                self.slots[k].count.fetch_sub(1, Ordering::AcqRel);
            }
            Counted::Overflow(id) => {
                let mut slow = self.slow.lock().unwrap();
                if let Some(n) = slow.overflow.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        slow.overflow.remove(&id);
                        // Forget the holder too, unless it owns a slot (else every short-lived
                        // holder past the slots would stay listed for the region's life).
                        if !self.slots.iter().any(|s| s.owner.load(Ordering::Acquire) == id) {
                            slow.holders.remove(&id);
                        }
                    }
                }
            }
        }
        if self.live.fetch_sub(1, Ordering::SeqCst) == CLOSING | 1 {
            // The last pin of a closing region: wake the deregistration (under the lock, so
            // that a waiter between its check and its wait cannot miss it).
            let _slow = self.slow.lock().unwrap();
            self.released.notify_all();
        }
    }

    /// Holders listed for aborting (tests: it must not grow with holders that are gone).
    #[cfg(test)]
    pub(super) fn holders_listed(&self) -> usize {
        self.slow.lock().unwrap().holders.len()
    }

    /// Live pins.
    pub(super) fn count(&self) -> usize {
        (self.live.load(Ordering::SeqCst) & !CLOSING) as usize
    }

    /// Refuses new pins, waits up to `wait` for the live ones; aborts their holders when they
    /// remain, then waits (bounded) again.
    pub(super) fn close_and_drain(&self, what: &str, wait: Duration) -> Result<()> {
        self.live.fetch_or(CLOSING, Ordering::SeqCst);
        if self.wait_drained(wait) {
            return Ok(());
        }
        let holders: Vec<Arc<dyn Abort>> = {
            let slow = self.slow.lock().unwrap();
            let busy_slots = self
                .slots
                .iter()
                .filter(|s| s.count.load(Ordering::Acquire) > 0)
                .map(|s| s.owner.load(Ordering::Acquire));
            let ids: Vec<u64> = busy_slots.chain(slow.overflow.keys().copied()).collect();
            ids.iter().filter_map(|id| slow.holders.get(id)?.upgrade()).collect()
        };
        let why = format!("{what} deregistered while in use");
        for h in holders {
            h.abort(&why);
        }
        if self.wait_drained(Duration::from_secs(10)) {
            return Ok(());
        }
        Err(Error::failed(format!("{what} still has {} in-flight transfers after abort", self.count())))
    }

    fn wait_drained(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut slow = self.slow.lock().unwrap();
        while self.count() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            slow = self.released.wait_timeout(slow, left).unwrap().0;
        }
        true
    }
}

/// A held pin; dropping it releases the region for deregistration.
pub struct Pin {
    region: Arc<Region>,
    at: Counted,
}

impl Pin {
    /// Takes a pin on `region` for `holder`; fails if the region is being deregistered.
    pub(super) fn take(region: &Arc<Region>, holder: &Arc<dyn Abort>) -> Result<Pin> {
        match region.pins.take(holder) {
            Some(at) => Ok(Pin { region: region.clone(), at }),
            None => {
                Err(Error::param(format!("region 0x{:x}+{} is being deregistered", region.addr, region.len)))
            }
        }
    }

    /// The pinned region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Whether the pin took the lock-free path (its holder owns a slot).
    #[cfg(test)]
    pub(super) fn counted_in_slot(&self) -> bool {
        matches!(self.at, Counted::Slot(_))
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.region.pins.give(&self.at);
    }
}
