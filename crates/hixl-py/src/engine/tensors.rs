//! The registered torch tensors whose storage can tell a resize, and the check a transfer
//! makes of the ones its local ranges start in (never of every registered tensor: a KV cache
//! registers one per layer, and each check calls into Python twice).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The `(addr, len)` keys of `Hixl::keep` that are checkable torch tensors.
#[derive(Default)]
pub(crate) struct TensorSpans {
    /// How many there are: the transfer path's only cost while none is registered.
    count: AtomicUsize,
    inner: Mutex<Spans>,
}

#[derive(Default)]
struct Spans {
    keys: BTreeSet<(u64, u64)>,
    /// The longest ever added: a lookup walks back from an address no further than this.
    max_len: u64,
}

impl TensorSpans {
    /// Records a registered tensor's range.
    pub(crate) fn add(&self, key: (u64, u64)) {
        let mut g = self.inner.lock().unwrap();
        if g.keys.insert(key) {
            g.max_len = g.max_len.max(key.1);
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets a deregistered tensor's range.
    pub(crate) fn remove(&self, key: (u64, u64)) {
        if self.inner.lock().unwrap().keys.remove(&key) {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Forgets every range (finalize).
    pub(crate) fn clear(&self) {
        let mut g = self.inner.lock().unwrap();
        g.keys.clear();
        self.count.store(0, Ordering::Relaxed);
    }

    /// The registered tensor ranges that contain one of `addrs`, each once.
    pub(crate) fn touched(&self, addrs: impl IntoIterator<Item = u64>) -> Vec<(u64, u64)> {
        if self.count.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let g = self.inner.lock().unwrap();
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut last = None;
        for a in addrs {
            if last == Some(a) {
                continue;
            }
            last = Some(a);
            for &(start, len) in g.keys.range(..=(a, u64::MAX)).rev() {
                if start.saturating_add(g.max_len) <= a {
                    break;
                }
                if a < start.saturating_add(len) && !out.contains(&(start, len)) {
                    out.push((start, len));
                }
            }
        }
        out
    }
}
