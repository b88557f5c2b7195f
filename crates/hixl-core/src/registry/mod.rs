//! Memory-handle registry: non-overlapping registered regions, O(log n) bounds checks and
//! in-flight pins that keep a region alive while a transfer uses it.
//!
//! Deregistration removes the region from the map at once (so no new transfer can find it),
//! then waits until every pin taken by an in-flight transfer is released. When that does not
//! happen within the deadline, the holders are aborted (their links are closed, which makes the
//! I/O threads stop touching the memory and release the pins) and deregistration waits again.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::error::{Error, Result, Status};

use crate::wire::{BackendKey, RegionEntry, MAX_REGIONS, MAX_REGION_NAME, MAX_TABLE_BYTES};

mod pin;
use pin::Pins;
pub use pin::{new_holder_id, Abort, Pin};

/// Where a region's memory lives: its memory domain (host now; device kinds next). The same
/// type the wire carries, so that there is one definition.
pub type MemType = crate::wire::Domain;

/// Changes of the region table a registry remembers, so that peers can be sent deltas; a
/// peer further behind gets the whole table. Fixed: a peer that fell this far behind is rare,
/// and the whole table is the correct answer for it anyway.
pub const JOURNAL_LEN: usize = 4096;

/// One registered region.
pub struct Region {
    /// Registry-unique id.
    pub id: u64,
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Memory type (its domain).
    pub mem_type: MemType,
    /// The name it was registered under (empty: none); unique within the registry.
    pub name: String,
    /// The keys the backends' registration hooks returned for it.
    pub keys: Vec<BackendKey>,
    /// False for read-only regions: peers may READ them but never WRITE them.
    pub writable: bool,
    /// How it was registered (`writable` is `access == ReadWrite`).
    pub access: Access,
    pins: Pins,
}

impl Region {
    /// The region as peers see it in the region table.
    pub fn entry(&self) -> RegionEntry {
        RegionEntry {
            addr: self.addr,
            len: self.len,
            id: self.id,
            writable: self.writable,
            domain: self.mem_type,
            name: self.name.clone(),
            keys: self.keys.clone(),
        }
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    /// Whether `[addr, addr+len)` lies inside this region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|e| e <= self.end())
    }

    /// Takes a pin for an in-flight operation of `holder`; fails if the region is being
    /// deregistered. Lock-free once the holder has pinned this region before.
    pub fn pin(self: &Arc<Self>, holder: &Arc<dyn Abort>) -> Result<Pin> {
        Pin::take(self, holder)
    }

    /// Number of pins currently held.
    pub fn pin_count(&self) -> usize {
        self.pins.count()
    }

    /// Refuses new pins and waits (up to `wait`, then aborting the holders and waiting again,
    /// bounded) until no pin is live. May be called again after an error.
    pub fn close_and_drain(&self, wait: Duration) -> Result<()> {
        self.pins.close_and_drain(&format!("region 0x{:x}+{}", self.addr, self.len), wait)
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Region(id={}, 0x{:x}+{}, {:?})", self.id, self.addr, self.len, self.mem_type)
    }
}

/// What to register: a range, its domain and access, an optional name and the backends' keys.
#[derive(Clone, Debug)]
pub struct RegionSpec {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Its memory domain.
    pub mem_type: MemType,
    /// Who may do what with it.
    pub access: Access,
    /// A name peers can look it up by (empty: none).
    pub name: String,
    /// Keys from the backends' registration hooks.
    pub keys: Vec<BackendKey>,
}

impl RegionSpec {
    /// A writable, unnamed host range without keys.
    pub fn host(addr: u64, len: u64) -> RegionSpec {
        RegionSpec {
            addr,
            len,
            mem_type: MemType::Host,
            access: Access::ReadWrite,
            name: String::new(),
            keys: vec![],
        }
    }
}

/// One change of the region table.
#[derive(Clone, Debug)]
enum Change {
    Added(RegionEntry),
    Removed(u64),
}

/// The changes since a version, as a peer needs them (see [`Registry::changes_since`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// The version the changes lead to.
    pub version: u64,
    /// Regions added (and still there).
    pub added: Vec<RegionEntry>,
    /// Ids of regions removed.
    pub removed: Vec<u64>,
}

#[derive(Default)]
struct Map {
    by_addr: BTreeMap<u64, Arc<Region>>,
    /// Named regions' addresses, by name.
    names: HashMap<String, u64>,
    /// The table's version: +1 per registration and per deregistration.
    version: u64,
    /// The last `JOURNAL_LEN` changes, with the version each made.
    journal: VecDeque<(u64, Change)>,
    /// Bytes of the encoded table (kept under `MAX_TABLE_BYTES`).
    table_bytes: usize,
}

impl Map {
    fn record(&mut self, change: Change) {
        self.version += 1;
        if self.journal.len() == JOURNAL_LEN {
            self.journal.pop_front();
        }
        self.journal.push_back((self.version, change));
    }

    fn remove(&mut self, addr: u64) -> Option<Arc<Region>> {
        let r = self.by_addr.remove(&addr)?;
        if !r.name.is_empty() {
            self.names.remove(&r.name);
        }
        self.table_bytes -= r.entry().encoded_len();
        self.record(Change::Removed(r.id));
        Some(r)
    }
}

/// The registry of one engine.
#[derive(Default)]
pub struct Registry {
    map: RwLock<Map>,
    next_id: AtomicU64,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a writable, unnamed host range `[addr, addr+len)` (see [`Registry::register_spec`]).
    pub fn register(&self, addr: u64, len: u64, mem_type: MemType) -> Result<Arc<Region>> {
        Ok(self.register_spec(RegionSpec { mem_type, ..RegionSpec::host(addr, len) })?.0)
    }

    /// Registers a range. The identical range again (same domain, access and name) returns the
    /// existing region and `false`; any other overlap, a null address, a zero length, a name
    /// already taken or too long is `PARAM_INVALID`; a table that would outgrow what one frame
    /// carries is `RESOURCE_EXHAUSTED`.
    pub fn register_spec(&self, spec: RegionSpec) -> Result<(Arc<Region>, bool)> {
        let RegionSpec { addr, len, mem_type, access, name, keys } = spec;
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
        if name.len() > MAX_REGION_NAME {
            return Err(Error::param(format!(
                "region name of {} bytes is too long: the limit is {MAX_REGION_NAME} bytes",
                name.len()
            )));
        }
        let mut map = self.map.write().unwrap();
        if let Some((_, r)) = map.by_addr.range(..=addr).next_back() {
            if r.addr == addr && r.len == len && r.mem_type == mem_type {
                if r.access != access {
                    return Err(Error::param(format!(
                        "region 0x{addr:x}+{len} is already registered with access={:?}; \
                         deregister it before registering it with access={:?}",
                        r.access.as_str(),
                        access.as_str()
                    )));
                }
                if r.name != name {
                    return Err(Error::param(format!(
                        "region 0x{addr:x}+{len} is already registered as name={:?}; deregister it \
                         before registering it as name={name:?}",
                        r.name
                    )));
                }
                return Ok((r.clone(), false));
            }
            if r.end() > addr {
                return Err(overlap(addr, len, r));
            }
        }
        if let Some((_, r)) = map.by_addr.range(addr..).next() {
            if r.addr < end {
                return Err(overlap(addr, len, r));
            }
        }
        if let Some(other) = map.names.get(&name) {
            return Err(Error::param(format!(
                "name={name:?} is already registered for region 0x{other:x}+{}: region names are \
                 unique within an engine",
                map.by_addr[other].len
            )));
        }
        if map.by_addr.len() >= MAX_REGIONS {
            return Err(Error::new(
                Status::ResourceExhausted,
                format!(
                    "this engine already has {MAX_REGIONS} regions registered, the most one table carries"
                ),
            ));
        }
        let region = Arc::new(Region {
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            addr,
            len,
            mem_type,
            name,
            keys,
            writable,
            access,
            pins: Pins::default(),
        });
        let entry = region.entry();
        if map.table_bytes + entry.encoded_len() > MAX_TABLE_BYTES {
            return Err(Error::new(
                Status::ResourceExhausted,
                format!(
                    "the region table would outgrow {MAX_TABLE_BYTES} bytes, the most one frame \
                     carries ({} regions registered)",
                    map.by_addr.len()
                ),
            ));
        }
        map.table_bytes += entry.encoded_len();
        if !region.name.is_empty() {
            map.names.insert(region.name.clone(), addr);
        }
        map.by_addr.insert(addr, region.clone());
        map.record(Change::Added(entry));
        Ok((region, true))
    }

    /// The region registered under `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<Region>> {
        let map = self.map.read().unwrap();
        map.names.get(name).map(|a| map.by_addr[a].clone())
    }

    /// The region that contains all of `[addr, addr+len)`, or `PARAM_INVALID` naming the range.
    pub fn lookup(&self, addr: u64, len: u64, side: &str) -> Result<Arc<Region>> {
        let map = self.map.read().unwrap();
        match map.by_addr.range(..=addr).next_back() {
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
    /// in-flight transfers (then aborting them), and returns it. Unknown ranges are a no-op
    /// (idempotent): `None`.
    pub fn deregister(&self, addr: u64, len: u64, wait: Duration) -> Result<Option<Arc<Region>>> {
        let id = self.map.read().unwrap().by_addr.get(&addr).filter(|r| r.len == len).map(|r| r.id);
        match id.and_then(|id| self.remove_exact(id, addr, len)) {
            Some(r) => r.close_and_drain(wait).map(|_| Some(r)),
            None => Ok(None),
        }
    }

    /// Removes the region with id `id`, registered exactly at `[addr, addr+len)`, from the map
    /// (no new transfer finds it) without waiting for its pins; see [`Region::close_and_drain`].
    /// A region registered at the same range since (another id) stays: a stale handle removes
    /// nothing.
    pub fn remove_exact(&self, id: u64, addr: u64, len: u64) -> Option<Arc<Region>> {
        let mut map = self.map.write().unwrap();
        match map.by_addr.get(&addr) {
            Some(r) if r.len == len && r.id == id => map.remove(addr),
            _ => None,
        }
    }

    /// Removes every region (finalize), with the same waiting rules as `deregister`; returns
    /// them, and the first error.
    pub fn clear(&self, wait: Duration) -> (Vec<Arc<Region>>, Result<()>) {
        let all: Vec<_> = {
            let mut map = self.map.write().unwrap();
            let addrs: Vec<u64> = map.by_addr.keys().copied().collect();
            addrs.into_iter().filter_map(|a| map.remove(a)).collect()
        };
        let mut first_err = None;
        for r in &all {
            if let Err(e) = r.close_and_drain(wait) {
                first_err.get_or_insert(e);
            }
        }
        (all, first_err.map_or(Ok(()), Err))
    }

    /// The region table sent to peers, sorted by address, and its version.
    pub fn table(&self) -> (u64, Vec<RegionEntry>) {
        let map = self.map.read().unwrap();
        (map.version, map.by_addr.values().map(|r| r.entry()).collect())
    }

    /// The table's version (+1 per registration and per deregistration).
    pub fn version(&self) -> u64 {
        self.map.read().unwrap().version
    }

    /// The net changes from table version `since` to now, or `None` when the journal no longer
    /// reaches back that far (send the whole table then). A region added and removed in
    /// between is not in `added` but its id is in `removed`: the peer may hold a newer table
    /// than `since` (a RegionsQuery's answer) that has it.
    pub fn changes_since(&self, since: u64) -> Option<Delta> {
        let map = self.map.read().unwrap();
        let oldest = map.journal.front().map_or(map.version + 1, |(v, _)| *v);
        if since > map.version || since + 1 < oldest {
            return None;
        }
        let mut added: BTreeMap<u64, RegionEntry> = BTreeMap::new();
        let mut removed = Vec::new();
        for (_, c) in map.journal.iter().filter(|(v, _)| *v > since) {
            match c {
                Change::Added(e) => {
                    added.insert(e.id, e.clone());
                }
                Change::Removed(id) => {
                    added.remove(id);
                    removed.push(*id);
                }
            }
        }
        Some(Delta { version: map.version, added: added.into_values().collect(), removed })
    }

    /// Bytes of all regions together.
    pub fn total_bytes(&self) -> u64 {
        self.map.read().unwrap().by_addr.values().map(|r| r.len).sum()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.map.read().unwrap().by_addr.len()
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
    /// Nothing writes it: peers may only READ it, and it is never the destination of one of
    /// this engine's READs (memory that must not change, such as a read-only Python buffer).
    Immutable,
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

    /// "rw", "r", or "r (immutable)".
    pub fn as_str(self) -> &'static str {
        match self {
            Access::ReadWrite => "rw",
            Access::ReadOnly => "r",
            Access::Immutable => "r (immutable)",
        }
    }
}

fn overlap(addr: u64, len: u64, r: &Region) -> Error {
    Error::param(format!("region 0x{addr:x}+{len} overlaps the registered region 0x{:x}+{}", r.addr, r.len))
}

/// A copy of a peer's region table, for checking remote ranges before sending; kept current
/// by whole tables and by deltas.
#[derive(Clone, Debug, Default)]
pub struct RemoteTable {
    by_addr: BTreeMap<u64, RegionEntry>,
    /// Address of each region, by id (deltas name removed regions by id).
    addr_of: HashMap<u64, u64>,
}

impl RemoteTable {
    /// Builds a table from entries in any order (a later entry at the same address wins).
    pub fn new(regions: Vec<RegionEntry>) -> Self {
        let mut t = RemoteTable::default();
        t.apply(regions, &[]);
        t
    }

    /// Removes the regions with ids `removed`, then inserts `added` (replacing any region with
    /// the same id or address).
    pub fn apply(&mut self, added: Vec<RegionEntry>, removed: &[u64]) {
        for id in removed {
            if let Some(a) = self.addr_of.remove(id) {
                self.by_addr.remove(&a);
            }
        }
        for e in added {
            if let Some(a) = self.addr_of.remove(&e.id) {
                self.by_addr.remove(&a);
            }
            if let Some(old) = self.by_addr.remove(&e.addr) {
                self.addr_of.remove(&old.id);
            }
            self.addr_of.insert(e.id, e.addr);
            self.by_addr.insert(e.addr, e);
        }
    }

    /// The region that contains all of `[addr, addr+len)`.
    pub fn find(&self, addr: u64, len: u64) -> Option<&RegionEntry> {
        let (_, r) = self.by_addr.range(..=addr).next_back()?;
        (addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len)).then_some(r)
    }

    /// Whether `[addr, addr+len)` lies inside one region of the table.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len).is_some()
    }

    /// The region named `name`.
    pub fn by_name(&self, name: &str) -> Option<&RegionEntry> {
        if name.is_empty() {
            return None;
        }
        self.by_addr.values().find(|r| r.name == name)
    }

    /// The regions, sorted by address.
    pub fn regions(&self) -> impl ExactSizeIterator<Item = &RegionEntry> {
        self.by_addr.values()
    }

    /// Number of regions.
    pub fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.by_addr.is_empty()
    }
}

#[cfg(test)]
mod tests;
