//! Region-table entries and backend capabilities: what a target tells its initiators about its
//! memory and about the data paths it offers. Pure encoding and decoding, like the rest of
//! `wire`.

use super::{Reader, WireError};

/// Most regions in one region list (a table, or the additions of a delta).
pub const MAX_REGIONS: usize = 1 << 16;
/// Longest region name in bytes.
pub const MAX_REGION_NAME: usize = 255;
/// Most backend keys on one region.
pub const MAX_KEYS: usize = 8;
/// Longest backend name in bytes.
pub const MAX_BACKEND_NAME: usize = 32;
/// Longest backend key in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Most capabilities in one Welcome.
pub const MAX_CAPABILITIES: usize = 16;
/// Most (local, remote) domain pairs in one capability.
pub const MAX_DOMAIN_PAIRS: usize = 16;
/// Region-entry flag: peers may write the region.
const FLAG_WRITABLE: u8 = 1;

/// Where memory lives, as the wire spells it: one byte per domain (0 host, 1 device, 0x80 + N
/// for `cuda:N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Domain {
    /// Host (CPU) memory.
    Host,
    /// Accelerator memory whose device is not named: registration resolves it to the device
    /// the pointer belongs to (`cuda:N`), so tables carry it only from engines that never
    /// resolve it.
    Device,
    /// Memory of CUDA device N (the ordinal as the owner's process numbers its devices),
    /// N <= [`Domain::MAX_CUDA_ORDINAL`].
    Cuda(u8),
}

/// Wire byte of `cuda:0`; `cuda:N` is this plus N.
const CUDA_BASE: u8 = 0x80;

impl Domain {
    /// A few domains, one of each kind (for tests and documentation).
    pub const ALL: [Domain; 3] = [Domain::Host, Domain::Device, Domain::Cuda(0)];
    /// Highest CUDA device ordinal a domain can name.
    pub const MAX_CUDA_ORDINAL: u8 = 0x7f;

    /// The domain of wire code `b`.
    pub fn from_u8(b: u8) -> Result<Domain, WireError> {
        match b {
            0 => Ok(Domain::Host),
            1 => Ok(Domain::Device),
            CUDA_BASE..=u8::MAX => Ok(Domain::Cuda(b - CUDA_BASE)),
            _ => Err(WireError::Invalid { field: "memory domain", value: b as u64 }),
        }
    }

    /// Its wire code.
    pub fn to_u8(self) -> u8 {
        match self {
            Domain::Host => 0,
            Domain::Device => 1,
            Domain::Cuda(n) => CUDA_BASE | (n & Self::MAX_CUDA_ORDINAL),
        }
    }

    /// Its kind's name in messages ("host", "device", "cuda").
    pub fn as_str(self) -> &'static str {
        match self {
            Domain::Host => "host",
            Domain::Device => "device",
            Domain::Cuda(_) => "cuda",
        }
    }

    /// Whether this is device memory (any accelerator, named or not).
    pub fn is_device(self) -> bool {
        !matches!(self, Domain::Host)
    }

    /// Whether two domains are of one kind: every `cuda:N` is of the kind `cuda` (a backend's
    /// domain pairs name kinds; the ordinal says which device of the owner holds the memory).
    pub fn same_kind(self, other: Domain) -> bool {
        std::mem::discriminant(&self) == std::mem::discriminant(&other)
    }

    /// Parses "host", "device", "cuda" (device 0) or "cuda:N"; Err names the value.
    pub fn parse(s: &str) -> Result<Domain, String> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "host" | "cpu" => return Ok(Domain::Host),
            "device" => return Ok(Domain::Device),
            "cuda" => return Ok(Domain::Cuda(0)),
            _ => {}
        }
        let bad = || {
            format!(
                "memory domain {s:?} is not one of host, device, cuda, cuda:N (0 <= N <= {})",
                Self::MAX_CUDA_ORDINAL
            )
        };
        let n = t.strip_prefix("cuda:").ok_or_else(bad)?;
        if n.is_empty() || !n.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        match n.parse::<u32>() {
            Ok(v) if v <= Self::MAX_CUDA_ORDINAL as u32 => Ok(Domain::Cuda(v as u8)),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Domain {
    /// "host", "device" or "cuda:N" (what [`Domain::parse`] reads back).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Domain::Cuda(n) => write!(f, "cuda:{n}"),
            d => f.write_str(d.as_str()),
        }
    }
}

/// A backend's opaque registration key for one region (a sealed memfd's descriptor number for
/// `shm`; an rkey for RDMA; an IPC handle for CUDA).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BackendKey {
    /// The backend that made it.
    pub backend: String,
    /// Its bytes, meaningful to that backend only.
    pub key: Vec<u8>,
}

/// One registered region as peers see it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionEntry {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The owner's registry id (never reused within one engine).
    pub id: u64,
    /// False for regions registered read-only (`access="r"`): peers may READ, not WRITE.
    pub writable: bool,
    /// Where the memory lives.
    pub domain: Domain,
    /// The name it was registered under (empty: none); unique within its engine.
    pub name: String,
    /// One key per backend that needs one to reach the region.
    pub keys: Vec<BackendKey>,
}

impl RegionEntry {
    /// An unnamed, writable host region without keys.
    pub fn host(addr: u64, len: u64, id: u64) -> RegionEntry {
        RegionEntry { addr, len, id, writable: true, domain: Domain::Host, name: String::new(), keys: vec![] }
    }

    /// The key `backend` registered for this region, if any.
    pub fn key(&self, backend: &str) -> Option<&[u8]> {
        self.keys.iter().find(|k| k.backend == backend).map(|k| k.key.as_slice())
    }

    /// Bytes of this entry on the wire.
    pub fn encoded_len(&self) -> usize {
        8 * 3
            + 2
            + 2
            + self.name.len()
            + 1
            + self.keys.iter().map(|k| 1 + k.backend.len() + 2 + k.key.len()).sum::<usize>()
    }
}

/// A data path a target offers, advertised in Welcome.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Capability {
    /// The backend's name, as `hixl.backends` spells it.
    pub backend: String,
    /// The (initiator's domain, target's domain) pairs it serves.
    pub domains: Vec<(Domain, Domain)>,
    /// What an initiator needs to open it (the same-host socket's name for `shm` and `self`).
    pub param: String,
}

pub(super) fn put_regions(p: &mut Vec<u8>, regions: &[RegionEntry]) {
    p.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for r in regions {
        p.extend_from_slice(&r.addr.to_le_bytes());
        p.extend_from_slice(&r.len.to_le_bytes());
        p.extend_from_slice(&r.id.to_le_bytes());
        p.push(if r.writable { FLAG_WRITABLE } else { 0 });
        p.push(r.domain.to_u8());
        p.extend_from_slice(&(r.name.len() as u16).to_le_bytes());
        p.extend_from_slice(r.name.as_bytes());
        p.push(r.keys.len() as u8);
        for k in &r.keys {
            p.push(k.backend.len() as u8);
            p.extend_from_slice(k.backend.as_bytes());
            p.extend_from_slice(&(k.key.len() as u16).to_le_bytes());
            p.extend_from_slice(&k.key);
        }
    }
}

pub(super) fn put_ids(p: &mut Vec<u8>, ids: &[u64]) {
    p.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    for id in ids {
        p.extend_from_slice(&id.to_le_bytes());
    }
}

pub(super) fn put_capabilities(p: &mut Vec<u8>, caps: &[Capability]) {
    p.push(caps.len() as u8);
    for c in caps {
        p.push(c.backend.len() as u8);
        p.extend_from_slice(c.backend.as_bytes());
        p.push(c.domains.len() as u8);
        for (l, r) in &c.domains {
            p.push(l.to_u8());
            p.push(r.to_u8());
        }
        p.extend_from_slice(&(c.param.len() as u32).to_le_bytes());
        p.extend_from_slice(c.param.as_bytes());
    }
}

fn too_large(field: &'static str, value: usize, limit: usize) -> WireError {
    WireError::TooLarge { field, value: value as u64, limit: limit as u64 }
}

impl Reader<'_> {
    /// A backend name: 1..=MAX_BACKEND_NAME bytes of lowercase ASCII, digits, '_' or '-'.
    pub(super) fn backend_name(&mut self, field: &'static str) -> Result<String, WireError> {
        let n = self.u8(field)? as usize;
        if n == 0 || n > MAX_BACKEND_NAME {
            return Err(WireError::Invalid { field, value: n as u64 });
        }
        let b = self.take(n, field)?;
        if !b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_' || *c == b'-') {
            return Err(WireError::Utf8 { field });
        }
        Ok(String::from_utf8(b.to_vec()).expect("checked ASCII"))
    }

    pub(super) fn regions(&mut self) -> Result<Vec<RegionEntry>, WireError> {
        let n = self.u32("region count")? as usize;
        if n > MAX_REGIONS {
            return Err(too_large("region count", n, MAX_REGIONS));
        }
        // The smallest entry has 29 bytes: never reserve more than the payload can hold.
        let mut v = Vec::with_capacity(n.min(self.b.len() / 29));
        for _ in 0..n {
            let addr = self.u64("region addr")?;
            let len = self.u64("region len")?;
            let id = self.u64("region id")?;
            let writable = match self.u8("region flags")? {
                0 => false,
                FLAG_WRITABLE => true,
                other => return Err(WireError::Invalid { field: "region flags", value: other as u64 }),
            };
            let domain = Domain::from_u8(self.u8("region domain")?)?;
            if len == 0 || addr.checked_add(len).is_none() {
                return Err(WireError::Invalid { field: "region", value: addr });
            }
            let name_len = self.u16("region name")? as usize;
            if name_len > MAX_REGION_NAME {
                return Err(too_large("region name", name_len, MAX_REGION_NAME));
            }
            let name = String::from_utf8(self.take(name_len, "region name")?.to_vec())
                .map_err(|_| WireError::Utf8 { field: "region name" })?;
            let nkeys = self.u8("region key count")? as usize;
            if nkeys > MAX_KEYS {
                return Err(too_large("region key count", nkeys, MAX_KEYS));
            }
            let mut keys = Vec::with_capacity(nkeys);
            for _ in 0..nkeys {
                let backend = self.backend_name("region key backend")?;
                let klen = self.u16("region key")? as usize;
                if klen > MAX_KEY_LEN {
                    return Err(too_large("region key", klen, MAX_KEY_LEN));
                }
                keys.push(BackendKey { backend, key: self.take(klen, "region key")?.to_vec() });
            }
            v.push(RegionEntry { addr, len, id, writable, domain, name, keys });
        }
        Ok(v)
    }

    pub(super) fn ids(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.u32("removed count")? as usize;
        if n > MAX_REGIONS {
            return Err(too_large("removed count", n, MAX_REGIONS));
        }
        if self.b.len() < n * 8 {
            return Err(WireError::Truncated { field: "removed ids" });
        }
        (0..n).map(|_| self.u64("removed id")).collect()
    }

    pub(super) fn capabilities(&mut self) -> Result<Vec<Capability>, WireError> {
        let n = self.u8("capability count")? as usize;
        if n > MAX_CAPABILITIES {
            return Err(too_large("capability count", n, MAX_CAPABILITIES));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let backend = self.backend_name("capability backend")?;
            let pairs = self.u8("capability domains")? as usize;
            if pairs > MAX_DOMAIN_PAIRS {
                return Err(too_large("capability domains", pairs, MAX_DOMAIN_PAIRS));
            }
            let mut domains = Vec::with_capacity(pairs);
            for _ in 0..pairs {
                let l = Domain::from_u8(self.u8("capability domain")?)?;
                domains.push((l, Domain::from_u8(self.u8("capability domain")?)?));
            }
            let param = self.str("capability param", super::MAX_NAME)?;
            v.push(Capability { backend, domains, param });
        }
        Ok(v)
    }
}

#[cfg(test)]
mod domain_tests {
    use super::Domain;

    #[test]
    fn domains_parse_print_and_encode() {
        assert_eq!(Domain::parse("host"), Ok(Domain::Host));
        assert_eq!(Domain::parse(" CUDA "), Ok(Domain::Cuda(0)));
        assert_eq!(Domain::parse("cuda:7"), Ok(Domain::Cuda(7)));
        assert_eq!(Domain::parse("cuda:127"), Ok(Domain::Cuda(127)));
        assert_eq!(Domain::parse("device"), Ok(Domain::Device));
        for bad in ["cuda:128", "cuda:", "cuda:-1", "cuda:1x", "gpu", "cuda:+1", ""] {
            let e = Domain::parse(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        for d in [Domain::Host, Domain::Device, Domain::Cuda(0), Domain::Cuda(5), Domain::Cuda(127)] {
            assert_eq!(Domain::from_u8(d.to_u8()), Ok(d));
            assert_eq!(Domain::parse(&d.to_string()), Ok(d));
        }
        assert_eq!(Domain::Cuda(3).to_u8(), 0x83);
        assert!(Domain::from_u8(2).is_err() && Domain::from_u8(0x7f).is_err());
        assert!(Domain::Cuda(1).same_kind(Domain::Cuda(6)));
        assert!(!Domain::Cuda(1).same_kind(Domain::Device) && !Domain::Host.same_kind(Domain::Cuda(0)));
        assert!(Domain::Cuda(2).is_device() && Domain::Device.is_device() && !Domain::Host.is_device());
    }
}
