//! Checking a batch before anything is queued: every descriptor against the local registry
//! and the peer's region table (ranges, access, memory domains), then merging and cutting it
//! into parts.

use std::sync::Arc;

use super::types::{StridedDesc, TransferOpDesc};
use super::{PeerConn, Running};
use crate::error::{Error, Result, Status};
use crate::queue::{PartBody, SegPair, Strided};
use crate::registry::{read_only, Abort, Access, Pin};
use crate::wire::{Domain, MAX_DESCS};

/// A (local, remote) pair of memory domains.
pub(super) type DomainPair = (Domain, Domain);

/// Which path carries a batch that moves data between these (local, remote) domain pairs:
/// the link's own data path (`Some(None)`) when it serves every pair, else the first of
/// `later` (the domain pairs of the backends after it in `hixl.backends` that the peer
/// offers) that serves every pair (`Some(Some(index))`); `None` when none does. (`auto`
/// picks rdma between two RDMA hosts, and rdma moves host memory only: a batch that touches
/// device memory then goes over tcp, which stages it, instead of being refused.)
pub(super) fn route(
    own: &[(Domain, Domain)],
    later: &[&[(Domain, Domain)]],
    pairs: &[(Domain, Domain)],
) -> Option<Option<usize>> {
    if serves(own, pairs) {
        return Some(None);
    }
    later.iter().position(|d| serves(d, pairs)).map(Some)
}

/// Whether a backend with domain pairs `d` moves data between every pair of `pairs`.
pub(super) fn serves(d: &[(Domain, Domain)], pairs: &[(Domain, Domain)]) -> bool {
    pairs.iter().all(|(local, theirs)| d.iter().any(|(l, t)| l.same_kind(*local) && t.same_kind(*theirs)))
}

/// The distinct (local, remote) domain pairs of a batch, in the order first met. A batch
/// almost always has one: up to two are kept without an allocation.
#[derive(Clone, Debug)]
pub(super) enum DomainPairs {
    /// Up to two pairs, and how many.
    Inline([DomainPair; 2], usize),
    /// More.
    Heap(Vec<DomainPair>),
}

impl Default for DomainPairs {
    fn default() -> Self {
        DomainPairs::Inline([(Domain::Host, Domain::Host); 2], 0)
    }
}

impl DomainPairs {
    /// Adds `p` unless it is there.
    pub(super) fn insert(&mut self, p: DomainPair) {
        if self.contains(&p) {
            return;
        }
        match self {
            DomainPairs::Inline(a, n) if *n < a.len() => {
                a[*n] = p;
                *n += 1;
            }
            DomainPairs::Inline(a, _) => *self = DomainPairs::Heap(a.iter().copied().chain([p]).collect()),
            DomainPairs::Heap(v) => v.push(p),
        }
    }

    /// Forgets every pair.
    pub(super) fn clear(&mut self) {
        *self = DomainPairs::default();
    }
}

impl std::ops::Deref for DomainPairs {
    type Target = [DomainPair];
    fn deref(&self) -> &[DomainPair] {
        match self {
            DomainPairs::Inline(a, n) => &a[..*n],
            DomainPairs::Heap(v) => v,
        }
    }
}

/// Whether some path to the peer moves data between these two memory domains (see `route`);
/// records the pair in `pairs` (each once).
pub(super) fn check_domains(
    conn: &PeerConn,
    remote: &str,
    local: Domain,
    theirs: Domain,
    pairs: &mut DomainPairs,
) -> Result<()> {
    // A pair met before was checked then; the link's own backend is asked before the later
    // ones (whose list is built only when needed).
    if pairs.contains(&(local, theirs))
        || serves(conn.domains(), &[(local, theirs)])
        || route(&[], &conn.later_domains(), &[(local, theirs)]).is_some()
    {
        pairs.insert((local, theirs));
        return Ok(());
    }
    Err(Error::new(
        Status::Unsupported,
        format!(
            "the {} backend chosen for {remote} does not move data between {local} memory here and \
             {theirs} memory there, nor does any later backend of hixl.backends that it offers{}",
            conn.link.backend(),
            if local.is_device() || theirs.is_device() {
                " (device memory moves over cuda_ipc between processes of one host, and over tcp \
                 through pinned host buffers)"
            } else {
                ""
            }
        ),
    ))
}

/// Runs a validation; when it failed only because a remote range is missing from our copy of
/// the peer's table, asks the peer for its current table once and validates again. A range
/// the peer registered a moment ago (and announced through another channel) then works,
/// while a wrong range still fails, one round trip later.
pub(super) fn with_fresh_table<T>(
    r: &Running,
    conn: &PeerConn,
    mut check: impl FnMut(&mut bool) -> Result<T>,
) -> Result<T> {
    let mut miss = false;
    match check(&mut miss) {
        Err(e) if miss => {
            if conn.control.refresh_table(r.opts.handshake_timeout).is_err() {
                return Err(e);
            }
            check(&mut false)
        }
        other => other,
    }
}

/// Checks every descriptor, pins the local regions, merges adjacent descriptors.
pub(super) fn validate(
    r: &Running,
    conn: &PeerConn,
    remote: &str,
    descs: &[TransferOpDesc],
    write: bool,
    remote_miss: &mut bool,
    pairs: &mut DomainPairs,
) -> Result<(Vec<SegPair>, Vec<Pin>, u64)> {
    let table = conn.control.table();
    let holder: Arc<dyn Abort> = conn.link.clone();
    let mut pins: Vec<Pin> = Vec::new();
    let mut segs: Vec<SegPair> = Vec::with_capacity(descs.len());
    let mut bytes = 0u64;
    // The (local, remote) regions of the last descriptor: only descriptors within the same two
    // regions merge, since a segment must lie inside one region on each side.
    let mut last_regions: Option<(u64, u64)> = None;
    for (i, d) in descs.iter().enumerate() {
        if d.len == 0 {
            return Err(Error::param(format!("descriptor {i}: length is 0")));
        }
        let pinned = pins.iter().position(|p| p.region().contains(d.local_addr, d.len));
        let (local, local_id) = match pinned {
            Some(k) => (pins[k].region().mem_type, pins[k].region().id),
            None => {
                let region = r
                    .registry
                    .lookup(d.local_addr, d.len, "local")
                    .map_err(|e| Error::param(format!("descriptor {i}: {}", e.message)))?;
                if !write && region.access == Access::Immutable {
                    return Err(Error::param(format!(
                        "descriptor {i}: {}",
                        read_only_destination(d.local_addr, d.len).message
                    )));
                }
                pins.push(region.pin(&holder)?);
                (region.mem_type, region.id)
            }
        };
        let remote_id = match table.find(d.remote_addr, d.len) {
            None => {
                *remote_miss = true;
                return Err(Error::param(format!(
                    "descriptor {i}: remote range 0x{:x}+{} is not inside a region registered at \
                     {remote} (as of its last region-table update)",
                    d.remote_addr, d.len
                )));
            }
            Some(e) if write && !e.writable => {
                return Err(Error::param(format!(
                    "descriptor {i}: {}",
                    read_only(d.remote_addr, d.len).message
                )))
            }
            Some(e) => {
                check_domains(conn, remote, local, e.domain, pairs)
                    .map_err(|e| e.context(&format!("descriptor {i}")))?;
                e.id
            }
        };
        bytes += d.len;
        if last_regions == Some((local_id, remote_id)) {
            push_merged(&mut segs, d);
        } else {
            segs.push(SegPair { local: d.local_addr, remote: d.remote_addr, len: d.len });
        }
        last_regions = Some((local_id, remote_id));
    }
    Ok((segs, pins, bytes))
}

/// Checks a strided descriptor (counts, strides, 64-byte alignment, both spans inside one
/// registered region) and pins the local region.
pub(super) fn validate_strided(
    r: &Running,
    conn: &PeerConn,
    remote: &str,
    (local_base, remote_base): (u64, u64),
    d: &StridedDesc,
    write: bool,
    remote_miss: &mut bool,
) -> Result<(Strided, Vec<Pin>, DomainPairs)> {
    let rstride = d.remote_stride.unwrap_or(d.stride);
    if d.count == 0 {
        return Err(Error::param("count=0: a strided descriptor needs at least one element"));
    }
    if d.size == 0 {
        return Err(Error::param("size=0: elements need at least one byte"));
    }
    for (name, v) in [("stride", d.stride), ("remote_stride", rstride)] {
        if v < d.size {
            return Err(Error::param(format!(
                "{name}={v} is smaller than size={}: elements would overlap",
                d.size
            )));
        }
    }
    if r.opts.strict_alignment {
        for (name, v) in [
            ("local_base", local_base),
            ("remote_base", remote_base),
            ("stride", d.stride),
            ("remote_stride", rstride),
        ] {
            if v % 64 != 0 {
                return Err(Error::param(format!(
                    "{name}=0x{v:x} ({v}) is not a multiple of 64 bytes (hixl.strict_alignment=0 relaxes this)"
                )));
            }
        }
    }
    let span = |stride: u64| (d.count - 1).checked_mul(stride).and_then(|x| x.checked_add(d.size));
    let (Some(lspan), Some(rspan)) = (span(d.stride), span(rstride)) else {
        return Err(Error::param(format!(
            "count={} with these strides overflows the address space",
            d.count
        )));
    };
    d.count
        .checked_mul(d.size)
        .ok_or_else(|| Error::param(format!("count={} x size={} overflows", d.count, d.size)))?;
    let region = r.registry.lookup(local_base, lspan, "local strided").map_err(|e| {
        Error::param(format!("{} (the whole strided range must lie in one region)", e.message))
    })?;
    if !write && region.access == Access::Immutable {
        return Err(read_only_destination(local_base, lspan));
    }
    let holder: Arc<dyn Abort> = conn.link.clone();
    let pin = region.pin(&holder)?;
    let mut pairs = DomainPairs::default();
    match conn.control.table().find(remote_base, rspan) {
        None => {
            *remote_miss = true;
            return Err(Error::param(format!(
            "remote strided range 0x{remote_base:x}+{rspan} is not inside one region registered at {remote}"
        )));
        }
        Some(e) if write && !e.writable => return Err(read_only(remote_base, rspan)),
        Some(e) => check_domains(conn, remote, region.mem_type, e.domain, &mut pairs)?,
    }
    let st = Strided {
        local: local_base,
        remote: remote_base,
        count: d.count,
        size: d.size,
        lstride: d.stride,
        rstride,
    };
    Ok((st, vec![pin], pairs))
}

/// A READ into a local region registered immutable: nothing hixl does writes into it.
fn read_only_destination(addr: u64, len: u64) -> Error {
    Error::param(format!(
        "local range 0x{addr:x}+{len} lies in a region of memory that must not change (a read-only \
         buffer, registered immutable): it cannot be the destination of a READ/get; use a writable \
         buffer as the destination"
    ))
}

/// Appends a descriptor, extending the last segment when both sides continue it (public for
/// the hot-path benches).
pub fn push_merged(segs: &mut Vec<SegPair>, d: &TransferOpDesc) {
    match segs.last_mut() {
        Some(p) if p.local + p.len == d.local_addr && p.remote + p.len == d.remote_addr => p.len += d.len,
        _ => segs.push(SegPair { local: d.local_addr, remote: d.remote_addr, len: d.len }),
    }
}

/// `split`, as the bodies of data parts; the common small batch (one part) costs no allocation
/// beyond the list of bodies.
pub(super) fn split_bodies(
    segs: Vec<SegPair>,
    bytes: u64,
    streams: usize,
    split_bytes: u64,
) -> Vec<PartBody> {
    let shares = if bytes >= split_bytes && streams > 1 { streams } else { 1 };
    if shares == 1 && !segs.is_empty() && segs.len() <= MAX_DESCS {
        return vec![PartBody::Data(segs)];
    }
    split(segs, bytes, streams, split_bytes).into_iter().map(PartBody::Data).collect()
}

/// Cuts merged segments into parts: one per stream for large batches (splitting segments at
/// the boundaries), never more than `MAX_DESCS` segments per part.
pub fn split(segs: Vec<SegPair>, bytes: u64, streams: usize, split_bytes: u64) -> Vec<Vec<SegPair>> {
    let shares = if bytes >= split_bytes && streams > 1 { streams as u64 } else { 1 };
    if shares == 1 && !segs.is_empty() && segs.len() <= MAX_DESCS {
        // The common small batch: one part, as it is (no copy of the segment list).
        return vec![segs];
    }
    let per = bytes.div_ceil(shares).max(1);
    let mut parts = Vec::new();
    let mut cur: Vec<SegPair> = Vec::new();
    let mut cur_bytes = 0u64;
    for mut s in segs {
        while s.len > 0 {
            let room = per - cur_bytes;
            let take = s.len.min(room);
            cur.push(SegPair { local: s.local, remote: s.remote, len: take });
            cur_bytes += take;
            s.local += take;
            s.remote += take;
            s.len -= take;
            if cur_bytes == per || cur.len() == MAX_DESCS {
                parts.push(std::mem::take(&mut cur));
                cur_bytes = 0;
            }
        }
    }
    if !cur.is_empty() {
        parts.push(cur);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bug this fixes: between two RDMA hosts `auto` picks rdma (host memory only), and a
    /// batch touching device memory was refused instead of going over tcp (which stages it).
    #[test]
    fn a_batch_goes_over_the_first_path_that_serves_all_its_domain_pairs() {
        use crate::transport::backend::HOST_TO_HOST;
        use crate::transport::staging::TCP_PAIRS;
        let (h, c, c1) = (Domain::Host, Domain::Cuda(0), Domain::Cuda(1));
        // rdma chosen, tcp after it: host memory stays on rdma, device memory goes to tcp.
        assert_eq!(route(HOST_TO_HOST, &[TCP_PAIRS], &[(h, h)]), Some(None));
        assert_eq!(route(HOST_TO_HOST, &[TCP_PAIRS], &[(c, h)]), Some(Some(0)));
        assert_eq!(route(HOST_TO_HOST, &[TCP_PAIRS], &[(h, c1)]), Some(Some(0)), "any device number");
        assert_eq!(route(HOST_TO_HOST, &[TCP_PAIRS], &[(h, h), (c1, c)]), Some(Some(0)), "a mixed batch");
        // The first later backend that serves every pair, not the first that serves one.
        let device_only: &[(Domain, Domain)] = &[(c, c)];
        assert_eq!(route(HOST_TO_HOST, &[device_only, TCP_PAIRS], &[(c, c)]), Some(Some(0)));
        assert_eq!(route(HOST_TO_HOST, &[device_only, TCP_PAIRS], &[(c, h)]), Some(Some(1)));
        assert_eq!(route(HOST_TO_HOST, &[device_only, TCP_PAIRS], &[(c, c), (h, h)]), Some(Some(1)));
        // Nothing after rdma (hixl.backends=rdma), or the peer offers tcp for host memory only.
        assert_eq!(route(HOST_TO_HOST, &[], &[(c, h)]), None);
        assert_eq!(route(HOST_TO_HOST, &[HOST_TO_HOST], &[(h, c)]), None);
        // A link on tcp needs nothing else.
        assert_eq!(route(TCP_PAIRS, &[], &[(c, c), (h, h)]), Some(None));
    }

    #[test]
    fn domain_pairs_keep_each_pair_once_in_order_past_the_inline_two() {
        let (h, c0, c1) = (Domain::Host, Domain::Cuda(0), Domain::Cuda(1));
        let mut p = DomainPairs::default();
        assert!(p.is_empty());
        for x in [(h, h), (h, h), (c0, h), (h, h)] {
            p.insert(x);
        }
        assert_eq!(&*p, &[(h, h), (c0, h)]);
        assert!(matches!(p, DomainPairs::Inline(..)), "two pairs need no allocation");
        for x in [(c1, c0), (c0, h), (h, c1)] {
            p.insert(x);
        }
        assert_eq!(&*p, &[(h, h), (c0, h), (c1, c0), (h, c1)]);
        p.clear();
        assert!(p.is_empty());
    }

    #[test]
    fn split_bodies_are_the_parts_of_split() {
        let cases = [
            (vec![sp(0, 100, 10), sp(50, 200, 10)], 20, 2, 1 << 20),
            (vec![sp(0, 1000, 30), sp(100, 2000, 10)], 40, 2, 16),
            (
                (0..(MAX_DESCS as u64 + 5)).map(|i| sp(i * 2, i * 2, 1)).collect(),
                MAX_DESCS as u64 + 5,
                1,
                u64::MAX,
            ),
        ];
        for (segs, bytes, streams, at) in cases {
            let bodies = split_bodies(segs.clone(), bytes, streams, at);
            let parts = split(segs, bytes, streams, at);
            assert_eq!(bodies.len(), parts.len());
            for (b, p) in bodies.iter().zip(&parts) {
                assert!(matches!(b, PartBody::Data(s) if s == p));
            }
        }
    }

    fn sp(local: u64, remote: u64, len: u64) -> SegPair {
        SegPair { local, remote, len }
    }

    #[test]
    fn adjacent_descriptors_merge_into_one_segment() {
        let d = |l, r, n| TransferOpDesc { local_addr: l, remote_addr: r, len: n };
        let mut segs = Vec::new();
        // 4 blocks contiguous on both sides, then one contiguous only locally, then a gap.
        for x in
            [d(0, 1000, 10), d(10, 1010, 10), d(20, 1020, 5), d(25, 1025, 5), d(30, 2000, 8), d(50, 2008, 2)]
        {
            push_merged(&mut segs, &x);
        }
        assert_eq!(segs, vec![sp(0, 1000, 30), sp(30, 2000, 8), sp(50, 2008, 2)]);
    }

    #[test]
    fn split_small_batch_is_one_part() {
        let p = split(vec![sp(0, 100, 10), sp(50, 200, 10)], 20, 2, 1 << 20);
        assert_eq!(p, vec![vec![sp(0, 100, 10), sp(50, 200, 10)]]);
    }

    #[test]
    fn split_large_batch_cuts_segments_evenly() {
        let p = split(vec![sp(0, 1000, 30), sp(100, 2000, 10)], 40, 2, 16);
        assert_eq!(p, vec![vec![sp(0, 1000, 20)], vec![sp(20, 1020, 10), sp(100, 2000, 10)]]);
        let total: u64 = p.iter().flatten().map(|s| s.len).sum();
        assert_eq!(total, 40);
    }

    #[test]
    fn split_caps_segments_per_part() {
        let segs: Vec<_> = (0..(MAX_DESCS as u64 + 5)).map(|i| sp(i * 2, i * 2, 1)).collect();
        let n = segs.len() as u64;
        let p = split(segs, n, 1, u64::MAX);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].len(), MAX_DESCS);
        assert_eq!(p[1].len(), 5);
    }
}
