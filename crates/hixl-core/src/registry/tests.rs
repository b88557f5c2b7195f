//! Unit tests of the registry: ranges, names, pins, the change journal, remote tables.

use super::*;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

#[test]
fn register_rejects_bad_and_overlapping_ranges() {
    let r = Registry::new();
    assert_eq!(r.register(0, 10, MemType::Host).unwrap_err().status, Status::ParamInvalid);
    assert!(r.register(0x1000, 0, MemType::Host).unwrap_err().message.contains("len=0"));
    let a = r.register(0x1000, 0x100, MemType::Host).unwrap();
    let again = r.register(0x1000, 0x100, MemType::Host).unwrap();
    assert_eq!(a.id, again.id, "identical range returns the same handle");
    let e = r.register(0x10ff, 2, MemType::Host).unwrap_err();
    assert!(e.message.contains("overlaps"), "{e}");
    let e = r.register(0xf00, 0x101, MemType::Host).unwrap_err();
    assert!(e.message.contains("0x1000+256"), "{e}");
    r.register(0x1100, 0x10, MemType::Host).unwrap(); // adjacent is fine
    r.register(0xf00, 0x100, MemType::Host).unwrap();
    assert_eq!(r.len(), 3);
    assert_eq!(r.register(u64::MAX - 1, 4, MemType::Host).unwrap_err().status, Status::ParamInvalid);
}

#[test]
fn lookup_checks_bounds() {
    let r = Registry::new();
    r.register(0x1000, 0x100, MemType::Host).unwrap();
    assert!(r.lookup(0x1000, 0x100, "local").is_ok());
    assert!(r.lookup(0x10ff, 1, "local").is_ok());
    assert!(r.lookup(0x10ff, 2, "local").is_err());
    assert!(r.lookup(0xfff, 1, "local").is_err());
    let e = r.lookup(0x2000, 8, "remote").unwrap_err();
    assert!(e.message.contains("remote range 0x2000+8"), "{e}");
    assert!(r.lookup(u64::MAX, 2, "local").is_err());
}

struct Flag(AtomicBool, u64);
impl Abort for Flag {
    fn abort(&self, _: &str) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn holder_id(&self) -> u64 {
        self.1
    }
}

fn new_flag() -> Arc<Flag> {
    Arc::new(Flag(AtomicBool::new(false), new_holder_id()))
}

fn dyn_holder(f: &Arc<Flag>) -> Arc<dyn Abort> {
    f.clone()
}

#[test]
fn deregister_waits_for_pins_then_aborts() {
    let r = Arc::new(Registry::new());
    let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
    let flag = new_flag();
    let pin = region.pin(&dyn_holder(&flag)).unwrap();
    // A pin released in time: deregister returns without aborting.
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(pin);
    });
    assert!(r.deregister(0x1000, 0x100, Duration::from_secs(5)).unwrap().is_some());
    t.join().unwrap();
    assert!(!flag.0.load(Ordering::SeqCst));
    assert!(r.deregister(0x1000, 0x100, Duration::from_secs(1)).unwrap().is_none(), "idempotent");
    assert!(region.pin(&dyn_holder(&flag)).is_err(), "closed region refuses pins");
    assert_eq!(region.pin_count(), 0, "a refused pin is not counted");

    // A pin held too long: the holder is aborted, and releases after abort.
    let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
    let flag2 = new_flag();
    let pin = region.pin(&dyn_holder(&flag2)).unwrap();
    let f = flag2.clone();
    let t = std::thread::spawn(move || {
        while !f.0.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(pin);
    });
    r.deregister(0x1000, 0x100, Duration::from_millis(20)).unwrap();
    t.join().unwrap();
    assert!(flag2.0.load(Ordering::SeqCst));
}

/// Holds `n` pins per holder; releases a holder's pins once it is aborted.
fn hold_until_aborted(region: &Arc<Region>, holder: &Arc<Flag>, n: usize) -> std::thread::JoinHandle<()> {
    let pins: Vec<Pin> = (0..n).map(|_| region.pin(&dyn_holder(holder)).unwrap()).collect();
    let f = holder.clone();
    std::thread::spawn(move || {
        while !f.0.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(pins);
    })
}

#[test]
fn deregister_aborts_exactly_the_holders_with_live_pins() {
    // More holders than the region has slots, so some count in the overflow map; of those that
    // pinned, some released already: only the ones still holding pins may be aborted.
    let r = Arc::new(Registry::new());
    let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
    let holders: Vec<Arc<Flag>> = (0..20).map(|_| new_flag()).collect();
    let mut waiting = Vec::new();
    for (i, h) in holders.iter().enumerate() {
        if i % 2 == 0 {
            waiting.push(hold_until_aborted(&region, h, 3));
        } else {
            drop(region.pin(&dyn_holder(h)).unwrap());
        }
    }
    assert_eq!(region.pin_count(), 30);
    r.deregister(0x1000, 0x100, Duration::from_millis(20)).unwrap();
    for t in waiting {
        t.join().unwrap();
    }
    for (i, h) in holders.iter().enumerate() {
        assert_eq!(h.0.load(Ordering::SeqCst), i % 2 == 0, "holder {i} aborted wrongly or not at all");
    }
    assert_eq!(region.pin_count(), 0);
}

#[test]
fn pins_from_many_threads_balance_and_dead_holders_free_their_slots() {
    let r = Arc::new(Registry::new());
    let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
    // Holders come and go (links reconnecting): each pins from several threads at once.
    for _round in 0..5 {
        let holders: Vec<Arc<Flag>> = (0..12).map(|_| new_flag()).collect();
        std::thread::scope(|s| {
            for h in &holders {
                for _ in 0..2 {
                    let (region, h) = (region.clone(), dyn_holder(h));
                    s.spawn(move || {
                        for _ in 0..2000 {
                            let p = region.pin(&h).unwrap();
                            assert!(region.pin_count() >= 1);
                            drop(p);
                        }
                    });
                }
            }
        });
        assert_eq!(region.pin_count(), 0);
    }
    // Every earlier holder is gone: a new one finds a slot again, and deregistration neither
    // waits nor aborts.
    let h = new_flag();
    let p = region.pin(&dyn_holder(&h)).unwrap();
    assert!(p.counted_in_slot(), "slots of dead holders are reused");
    drop(p);
    let t = Instant::now();
    r.deregister(0x1000, 0x100, Duration::from_secs(5)).unwrap();
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(!h.0.load(Ordering::SeqCst));
}

#[test]
fn remote_table_contains() {
    let e = |addr, len| RegionEntry::host(addr, len, addr);
    let mut t = RemoteTable::new(vec![e(0x3000, 0x10), e(0x1000, 0x100)]);
    assert_eq!(t.find(0x3008, 8).unwrap().id, 0x3000);
    assert!(t.contains(0x1000, 0x100));
    assert!(t.contains(0x3008, 8));
    assert!(!t.contains(0x3008, 9));
    assert!(!t.contains(0x2000, 1));
    assert!(!t.contains(0x10, 1));
    // A delta: region 0x3000 goes, 0x5000 comes.
    t.apply(vec![e(0x5000, 8)], &[0x3000]);
    assert!(!t.contains(0x3008, 1));
    assert!(t.contains(0x5000, 8));
    assert_eq!(t.len(), 2);
}

#[test]
fn names_are_unique_and_deltas_are_net() {
    let r = Registry::new();
    let named = |addr, name: &str| RegionSpec { name: name.into(), ..RegionSpec::host(addr, 0x10) };
    let (a, created) = r.register_spec(named(0x1000, "kv")).unwrap();
    assert!(created);
    let e = r.register_spec(named(0x2000, "kv")).unwrap_err();
    assert!(e.message.contains("name=\"kv\" is already registered"), "{e}");
    let (again, created) = r.register_spec(named(0x1000, "kv")).unwrap();
    assert!(!created && again.id == a.id);
    assert!(r.register_spec(named(0x1000, "other")).is_err(), "same range, other name");
    assert_eq!(r.by_name("kv").unwrap().id, a.id);
    let v1 = r.version();
    let b = r.register(0x3000, 0x10, MemType::Host).unwrap();
    let c = r.register(0x4000, 0x10, MemType::Host).unwrap();
    r.deregister(0x3000, 0x10, Duration::from_secs(1)).unwrap();
    r.deregister(0x1000, 0x10, Duration::from_secs(1)).unwrap();
    assert!(r.by_name("kv").is_none(), "a deregistered name is free again");
    let d = r.changes_since(v1).unwrap();
    assert_eq!(d.version, v1 + 4);
    assert_eq!(d.added.iter().map(|e| e.id).collect::<Vec<_>>(), vec![c.id], "b came and went");
    // b is removed too: a peer may hold a newer table (a query's answer) that has it.
    assert_eq!(d.removed, vec![b.id, a.id]);
    assert_ne!(b.id, c.id);
    assert_eq!(r.changes_since(r.version()).unwrap(), Delta { version: r.version(), ..Delta::default() });
    assert!(r.changes_since(r.version() + 1).is_none());
    // Past the journal: no delta, the whole table instead.
    for i in 0..JOURNAL_LEN as u64 {
        r.register(0x10_0000 + i * 0x100, 0x10, MemType::Host).unwrap();
    }
    assert!(r.changes_since(v1).is_none());
    assert!(r.changes_since(r.version() - 10).is_some());
}

#[test]
fn holders_past_the_slots_are_forgotten_once_their_pins_are_released() {
    let r = Arc::new(Registry::new());
    let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
    let keep: Vec<Arc<Flag>> = (0..8).map(|_| new_flag()).collect();
    let held: Vec<Pin> = keep.iter().map(|h| region.pin(&dyn_holder(h)).unwrap()).collect();
    for _ in 0..1000 {
        let h = new_flag();
        let p = region.pin(&dyn_holder(&h)).unwrap();
        assert!(!p.counted_in_slot(), "every slot is taken by a live holder");
    }
    assert!(region.pins.holders_listed() <= 8 + 1, "{}", region.pins.holders_listed());
    drop(held);
}

#[test]
fn a_stale_id_removes_nothing_registered_at_the_same_range_since() {
    let r = Registry::new();
    let old = r.register(0x1000, 0x100, MemType::Host).unwrap();
    assert!(r.remove_exact(old.id, 0x1000, 0x100).is_some());
    let new = r.register(0x1000, 0x100, MemType::Host).unwrap();
    assert_ne!(old.id, new.id, "a registration after a deregistration has a new id");
    assert!(r.remove_exact(old.id, 0x1000, 0x100).is_none(), "the old id names nothing now");
    assert_eq!(r.lookup(0x1000, 0x100, "local").unwrap().id, new.id, "the new region stays");
    assert!(r.remove_exact(new.id, 0x1000, 0x100).is_some());
}
