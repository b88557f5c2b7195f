//! Memory-handle registry: non-overlapping registered regions, O(log n) bounds checks and
//! in-flight pins that keep a region alive while a transfer uses it.
//!
//! Deregistration removes the region from the map at once (so no new transfer can find it),
//! then waits until every pin taken by an in-flight transfer is released. When that does not
//! happen within the deadline, the holders are aborted (their links are closed, which makes the
//! I/O threads stop touching the memory and release the pins) and deregistration waits again.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::wire::RegionEntry;

/// Where a region's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemType {
    /// Ordinary host (CPU) memory.
    Host,
    /// Accelerator memory; needs a device backend.
    Device,
}

/// Something that holds pins and can be told to stop using memory (a link or a served stream).
pub trait Abort: Send + Sync {
    /// Stop all I/O as soon as possible; pins must be released shortly after.
    fn abort(&self, why: &str);
}

#[derive(Default)]
struct PinSet {
    closing: bool,
    next: u64,
    holders: HashMap<u64, Arc<dyn Abort>>,
}

/// One registered region.
pub struct Region {
    /// Registry-unique id.
    pub id: u64,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Memory type.
    pub mem_type: MemType,
    /// memfd of engine-allocated shared memory (peers on this host may map it), or -1.
    pub fd: i32,
    /// False for read-only regions: peers may READ them but never WRITE them.
    pub writable: bool,
    pins: Mutex<PinSet>,
    released: Condvar,
}

impl Region {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// Whether `[addr, addr+len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.end())
    }

    /// Takes a pin for an in-flight operation; fails if the region is being deregistered.
    pub fn pin(self: &Arc<Self>, holder: Arc<dyn Abort>) -> Result<Pin> {
        let mut set = self.pins.lock().unwrap();
        if set.closing {
            return Err(Error::param(format!("region 0x{:x}+{} is being deregistered", self.addr, self.len)));
        }
        set.next += 1;
        let id = set.next;
        set.holders.insert(id, holder);
        Ok(Pin { region: self.clone(), id })
    }

    /// Number of pins currently held.
    pub fn pin_count(&self) -> usize {
        self.pins.lock().unwrap().holders.len()
    }

    fn close_and_drain(&self, wait: Duration) -> Result<()> {
        let mut set = self.pins.lock().unwrap();
        set.closing = true;
        let deadline = Instant::now() + wait;
        while !set.holders.is_empty() && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            set = self.released.wait_timeout(set, left).unwrap().0;
        }
        if set.holders.is_empty() {
            return Ok(());
        }
        // Still in use: abort the holders, then wait (bounded) for their I/O to stop.
        let holders: Vec<_> = set.holders.values().cloned().collect();
        drop(set);
        let why = format!("region 0x{:x}+{} deregistered while in use", self.addr, self.len);
        for h in holders {
            h.abort(&why);
        }
        let mut set = self.pins.lock().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !set.holders.is_empty() && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            set = self.released.wait_timeout(set, left).unwrap().0;
        }
        if set.holders.is_empty() {
            Ok(())
        } else {
            Err(Error::failed(format!(
                "region 0x{:x}+{} still has {} in-flight transfers after abort",
                self.addr,
                self.len,
                set.holders.len()
            )))
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region(id={}, 0x{:x}+{}, {:?})", self.id, self.addr, self.len, self.mem_type)
    }
}

/// A held pin; dropping it releases the region for deregistration.
pub struct Pin {
    region: Arc<Region>,
    id: u64,
}

impl Pin {
    /// The pinned region.
    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut set = self.region.pins.lock().unwrap();
        set.holders.remove(&self.id);
        if set.holders.is_empty() {
            self.region.released.notify_all();
        }
    }
}

/// The registry of one engine.
#[derive(Default)]
pub struct Registry {
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    next_id: AtomicU64,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `[addr, addr+len)`. The identical range again returns the existing region; any
    /// other overlap, a null address or a zero length is `PARAM_INVALID`.
    pub fn register(&self, addr: u64, len: u64, mem_type: MemType) -> Result<Arc<Region>> {
        self.register_fd(addr, len, mem_type, -1)
    }

    /// Like `register`, for memory backed by the memfd `fd` (shared with same-host peers).
    pub fn register_fd(&self, addr: u64, len: u64, mem_type: MemType, fd: i32) -> Result<Arc<Region>> {
        self.register_with(addr, len, mem_type, fd, Access::ReadWrite)
    }

    /// Registers with an explicit access mode (`fd` is -1 for ordinary memory).
    pub fn register_with(
        &self,
        addr: u64,
        len: u64,
        mem_type: MemType,
        fd: i32,
        access: Access,
    ) -> Result<Arc<Region>> {
        let writable = access == Access::ReadWrite;
        if addr == 0 {
            return Err(Error::param("cannot register a null address (addr=0x0)"));
        }
        if len == 0 {
            return Err(Error::param(format!("cannot register zero bytes at 0x{addr:x} (len=0)")));
        }
        let Some(end) = addr.checked_add(len) else {
            return Err(Error::param(format!("region 0x{addr:x}+{len} overflows the address space")));
        };
        if mem_type == MemType::Device {
            return Err(Error::new(
                Status::Unsupported,
                "MemType.DEVICE needs a device backend, none is available on this machine",
            ));
        }
        let mut map = self.regions.write().unwrap();
        if let Some((_, r)) = map.range(..=addr).next_back() {
            if r.addr == addr && r.len == len && r.mem_type == mem_type {
                if r.writable != writable {
                    return Err(Error::param(format!(
                        "region 0x{addr:x}+{len} is already registered with access={:?}; \
                         deregister it before registering it with access={:?}",
                        Access::of(r.writable).as_str(),
                        access.as_str()
                    )));
                }
                return Ok(r.clone());
            }
            if r.end() > addr {
                return Err(overlap(addr, len, r));
            }
        }
        if let Some((_, r)) = map.range(addr..).next() {
            if r.addr < end {
                return Err(overlap(addr, len, r));
            }
        }
        let region = Arc::new(Region {
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            addr,
            len,
            mem_type,
            fd,
            writable,
            pins: Mutex::new(PinSet::default()),
            released: Condvar::new(),
        });
        map.insert(addr, region.clone());
        Ok(region)
    }

    /// The region that contains all of `[addr, addr+len)`, or `PARAM_INVALID` naming the range.
    pub fn lookup(&self, addr: u64, len: u64, side: &str) -> Result<Arc<Region>> {
        let map = self.regions.read().unwrap();
        match map.range(..=addr).next_back() {
            Some((_, r)) if r.contains(addr, len) => Ok(r.clone()),
            _ => Err(Error::param(format!(
                "{side} range 0x{addr:x}+{len} is not inside a region registered on this engine"
            ))),
        }
    }

    /// Like `lookup`, and for `write` also refuses a read-only region.
    pub fn lookup_for(&self, addr: u64, len: u64, side: &str, write: bool) -> Result<Arc<Region>> {
        let r = self.lookup(addr, len, side)?;
        if write && !r.writable {
            return Err(read_only(addr, len));
        }
        Ok(r)
    }

    /// Removes the region registered exactly at `[addr, addr+len)`, waiting up to `wait` for
    /// in-flight transfers (then aborting them). Unknown ranges are a no-op (idempotent).
    pub fn deregister(&self, addr: u64, len: u64, wait: Duration) -> Result<bool> {
        let region = {
            let mut map = self.regions.write().unwrap();
            match map.get(&addr) {
                Some(r) if r.len == len => map.remove(&addr),
                _ => None,
            }
        };
        match region {
            Some(r) => r.close_and_drain(wait).map(|_| true),
            None => Ok(false),
        }
    }

    /// Removes every region (finalize), with the same waiting rules as `deregister`.
    pub fn clear(&self, wait: Duration) -> Result<()> {
        let all: Vec<_> = std::mem::take(&mut *self.regions.write().unwrap()).into_values().collect();
        let mut first_err = None;
        for r in all {
            if let Err(e) = r.close_and_drain(wait) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The region table sent to peers, sorted by address.
    pub fn table(&self) -> Vec<RegionEntry> {
        let map = self.regions.read().unwrap();
        map.values()
            .map(|r| RegionEntry { addr: r.addr, len: r.len, id: r.id, fd: r.fd, writable: r.writable })
            .collect()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.regions.read().unwrap().len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The error for a WRITE into a read-only region.
pub fn read_only(addr: u64, len: u64) -> Error {
    Error::param(format!(
        "range 0x{addr:x}+{len} lies in a read-only region (registered with access=\"r\"): peers may \
         READ it but not WRITE it"
    ))
}

/// Who may do what with a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Access {
    /// Peers may READ and WRITE it (the default).
    #[default]
    ReadWrite,
    /// Peers may only READ it.
    ReadOnly,
}

impl Access {
    /// "rw" -> ReadWrite, "r" -> ReadOnly; anything else is PARAM_INVALID naming it.
    pub fn parse(s: &str) -> Result<Access> {
        match s {
            "rw" => Ok(Access::ReadWrite),
            "r" => Ok(Access::ReadOnly),
            other => Err(Error::param(format!("access={other:?} must be \"rw\" or \"r\""))),
        }
    }

    fn of(writable: bool) -> Access {
        if writable {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        }
    }

    /// "rw" or "r".
    pub fn as_str(self) -> &'static str {
        match self {
            Access::ReadWrite => "rw",
            Access::ReadOnly => "r",
        }
    }
}

fn overlap(addr: u64, len: u64, r: &Region) -> Error {
    Error::param(format!("region 0x{addr:x}+{len} overlaps the registered region 0x{:x}+{}", r.addr, r.len))
}

/// A sorted copy of a peer's region table, for checking remote ranges before sending.
#[derive(Clone, Debug, Default)]
pub struct RemoteTable {
    regions: Vec<RegionEntry>,
}

impl RemoteTable {
    /// Builds a table from entries in any order.
    pub fn new(mut regions: Vec<RegionEntry>) -> Self {
        regions.sort_unstable();
        RemoteTable { regions }
    }

    /// The region that contains all of `[addr, addr+len)`.
    pub fn find(&self, addr: u64, len: u64) -> Option<&RegionEntry> {
        let i = self.regions.partition_point(|r| r.addr <= addr);
        let r = self.regions.get(i.checked_sub(1)?)?;
        (addr >= r.addr && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len)).then_some(r)
    }

    /// Whether `[addr, addr+len)` lies inside one region of the table.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len).is_some()
    }

    /// The regions, sorted by address.
    pub fn regions(&self) -> &[RegionEntry] {
        &self.regions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

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
        assert_eq!(r.register(0x9000, 4, MemType::Device).unwrap_err().status, Status::Unsupported);
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

    struct Flag(AtomicBool);
    impl Abort for Flag {
        fn abort(&self, _: &str) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn deregister_waits_for_pins_then_aborts() {
        let r = Arc::new(Registry::new());
        let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let pin = region.pin(flag.clone()).unwrap();
        // A pin released in time: deregister returns without aborting.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(pin);
        });
        assert!(r.deregister(0x1000, 0x100, Duration::from_secs(5)).unwrap());
        t.join().unwrap();
        assert!(!flag.0.load(Ordering::SeqCst));
        assert!(!r.deregister(0x1000, 0x100, Duration::from_secs(1)).unwrap(), "idempotent");
        assert!(region.pin(flag.clone()).is_err(), "closed region refuses pins");

        // A pin held too long: the holder is aborted, and releases after abort.
        let region = r.register(0x1000, 0x100, MemType::Host).unwrap();
        let flag2 = Arc::new(Flag(AtomicBool::new(false)));
        let pin = region.pin(flag2.clone()).unwrap();
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

    #[test]
    fn remote_table_contains() {
        let e = |addr, len| RegionEntry { addr, len, id: addr, fd: -1, writable: true };
        let t = RemoteTable::new(vec![e(0x3000, 0x10), e(0x1000, 0x100)]);
        assert_eq!(t.find(0x3008, 8).unwrap().id, 0x3000);
        assert!(t.contains(0x1000, 0x100));
        assert!(t.contains(0x3008, 8));
        assert!(!t.contains(0x3008, 9));
        assert!(!t.contains(0x2000, 1));
        assert!(!t.contains(0x10, 1));
    }
}
