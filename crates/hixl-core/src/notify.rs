//! Received notifications, bounded per sending peer.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::error::{Error, Result, Status};
use crate::queue::NotifyDesc;

/// Notifications received and not yet collected by `get_notifies`.
pub struct NotifyStore {
    cap_per_peer: usize,
    inner: Mutex<(VecDeque<NotifyDesc>, HashMap<String, usize>)>,
}

impl NotifyStore {
    /// A store holding at most `cap_per_peer` pending notifications from each peer.
    pub fn new(cap_per_peer: usize) -> Self {
        NotifyStore { cap_per_peer, inner: Mutex::new((VecDeque::new(), HashMap::new())) }
    }

    /// Adds one; `RESOURCE_EXHAUSTED` when that peer already has the maximum pending.
    pub fn push(&self, peer: &str, name: String, msg: String) -> Result<()> {
        let mut g = self.inner.lock().unwrap();
        let n = g.1.entry(peer.to_string()).or_insert(0);
        if *n >= self.cap_per_peer {
            return Err(Error::new(
                Status::ResourceExhausted,
                format!(
                    "{} notifications from {peer} are pending at the target (limit hixl.max_notifies={}); \
                     the target must call get_notifies",
                    n, self.cap_per_peer
                ),
            ));
        }
        *n += 1;
        g.0.push_back(NotifyDesc { name, msg });
        Ok(())
    }

    /// Returns and clears everything pending, in arrival order.
    pub fn take(&self) -> Vec<NotifyDesc> {
        let mut g = self.inner.lock().unwrap();
        g.1.clear();
        g.0.drain(..).collect()
    }
}
