//! Allocations of a peer opened in this process, by IPC handle. A legacy IPC handle can be
//! opened only once per process (a second `cuIpcOpenMemHandle` of it fails), and many regions
//! of a peer may lie in one allocation, so each allocation is opened on first use, shared by
//! every region in it, and closed when no region of the peer's current table uses it any more.
//! Generic over the opened value (a device address in the backend, anything in tests).

use std::collections::{HashMap, HashSet};

/// One opened allocation.
struct Opened<V> {
    value: V,
    alloc_len: u64,
    /// The peer's region ids that lie in it.
    regions: HashSet<u64>,
}

/// Opened allocations by handle.
pub(crate) struct HandleCache<V> {
    open: HashMap<[u8; 64], Opened<V>>,
}

impl<V: Copy> HandleCache<V> {
    /// An empty cache.
    pub(crate) fn new() -> Self {
        HandleCache { open: HashMap::new() }
    }

    /// How many allocations are open.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.open.len()
    }

    /// The opened allocation of `handle` for region `region` (opened with `open` on first use).
    /// A handle already open with another allocation length is refused: the peer contradicts
    /// itself, and the mapping made for the first length must not serve the second.
    pub(crate) fn get_or_open(
        &mut self,
        handle: &[u8; 64],
        alloc_len: u64,
        region: u64,
        open: impl FnOnce() -> Result<V, String>,
    ) -> Result<V, String> {
        if let Some(o) = self.open.get_mut(handle) {
            if o.alloc_len != alloc_len {
                return Err(format!(
                    "the peer gave one IPC handle two allocation lengths ({} and {alloc_len})",
                    o.alloc_len
                ));
            }
            o.regions.insert(region);
            return Ok(o.value);
        }
        let value = open()?;
        self.open.insert(*handle, Opened { value, alloc_len, regions: HashSet::from([region]) });
        Ok(value)
    }

    /// Forgets the regions for which `live` is false, and closes (with `close`) every
    /// allocation no live region uses.
    pub(crate) fn retain(&mut self, live: impl Fn(u64) -> bool, mut close: impl FnMut(V)) {
        self.open.retain(|_, o| {
            o.regions.retain(|id| live(*id));
            if o.regions.is_empty() {
                close(o.value);
                false
            } else {
                true
            }
        });
    }

    /// Closes everything.
    pub(crate) fn clear(&mut self, close: impl FnMut(V)) {
        self.retain(|_| false, close);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> [u8; 64] {
        [b; 64]
    }

    #[test]
    fn each_allocation_is_opened_once_and_closed_when_its_last_region_goes() {
        let mut c: HandleCache<u64> = HandleCache::new();
        let opens = std::cell::Cell::new(0);
        let open = |v: u64| {
            let opens = &opens;
            move || {
                opens.set(opens.get() + 1);
                Ok::<u64, String>(v)
            }
        };
        assert_eq!(c.get_or_open(&h(1), 1 << 20, 10, open(0x1000)).unwrap(), 0x1000);
        // A second region of the same allocation: no second open (it would fail in CUDA).
        assert_eq!(c.get_or_open(&h(1), 1 << 20, 11, open(0x9999)).unwrap(), 0x1000);
        assert_eq!(c.get_or_open(&h(2), 4096, 12, open(0x2000)).unwrap(), 0x2000);
        assert_eq!(opens.get(), 2, "the repeated handle was not opened again");
        assert_eq!(c.len(), 2);

        let mut closed = vec![];
        // Region 10 left the table: allocation 1 still serves region 11.
        c.retain(|id| id != 10, |v| closed.push(v));
        assert!(closed.is_empty());
        c.retain(|id| id == 12, |v| closed.push(v));
        assert_eq!(closed, vec![0x1000]);
        assert_eq!(c.len(), 1);
        c.clear(|v| closed.push(v));
        assert_eq!(closed, vec![0x1000, 0x2000]);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn a_failed_open_is_not_cached_and_a_contradicting_length_is_refused() {
        let mut c: HandleCache<u64> = HandleCache::new();
        let e = c.get_or_open(&h(1), 4096, 1, || Err("CUDA_ERROR_INVALID_VALUE".into())).unwrap_err();
        assert!(e.contains("INVALID_VALUE"));
        assert_eq!(c.len(), 0);
        c.get_or_open(&h(1), 4096, 1, || Ok(7)).unwrap();
        let e = c.get_or_open(&h(1), 8192, 2, || Ok(8)).unwrap_err();
        assert!(e.contains("4096 and 8192"), "{e}");
    }
}
