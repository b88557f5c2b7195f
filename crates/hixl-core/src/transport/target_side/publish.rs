//! Region-table updates to the initiators a server serves: queued as a version number (the
//! newest table replaces every older one) and sent by each stream's writer; a retry timer runs
//! while some peer owes an update (and only then, so an idle engine does not wake for it) and
//! disconnects a peer that has not taken one within the deregistration timeout.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::registry::Abort;
use crate::transport::reactor::Tick;
use crate::transport::target_side::{Served, Server};

/// How often the region-update backlog is checked for peers that fell behind (while one owes
/// an update; the timer stops when none does).
const PUBLISH_CHECK: Duration = Duration::from_millis(250);

impl Server {
    /// Has a peer's writer send a due update, or disconnects the peer once it has owed one
    /// for `slow_peer_timeout`.
    fn push_update(&self, s: &Served) {
        let since = *s.due_since.lock().unwrap().get_or_insert_with(Instant::now);
        if since.elapsed() > self.ctx.slow_peer_timeout {
            tracing::warn!(peer = %s.peer_addr, "peer did not take a region update in time: disconnecting it");
            s.abort("peer fell behind on region updates");
            return;
        }
        let token = s.writer_token.load(Ordering::Acquire);
        if token != 0 {
            self.ctx.reactor.schedule(token);
        }
        self.retry_updates();
    }

    /// Arms the update-retry timer unless it runs.
    fn retry_updates(&self) {
        if self.retrying.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(me) = self.me.upgrade() {
            let tick: Arc<dyn Tick> = me;
            self.ctx.reactor.every(PUBLISH_CHECK, Arc::downgrade(&tick));
        }
    }

    /// The streams that owe an update now.
    fn owing(&self) -> Vec<Arc<Served>> {
        self.served.lock().unwrap().values().filter(|s| owes_update(s)).cloned().collect()
    }

    /// Queues the current region table for every connected initiator (the publisher thread
    /// sends it). With `wait`, also waits until every initiator proven to be on this host
    /// (which accesses memory directly, without the target-side check) confirmed it; one that
    /// does not within `wait` is disconnected and the call fails, so the caller must not free
    /// the memory. Never sends on a socket itself.
    pub fn publish_regions(&self, wait: Option<Duration>) -> Result<()> {
        let version = self.ctx.registry.version();
        let heads: Vec<Arc<Served>> = self
            .served
            .lock()
            .unwrap()
            .values()
            .filter(|s| s.link_head.load(Ordering::Acquire))
            .cloned()
            .collect();
        for s in &heads {
            s.due.fetch_max(version, Ordering::SeqCst);
            if owes_update(s) {
                self.push_update(s);
            }
        }
        let Some(wait) = wait else { return Ok(()) };
        let deadline = Instant::now() + wait;
        let mut g = self.live.lock().unwrap();
        loop {
            let pending: Vec<_> = heads
                .iter()
                .filter(|s| {
                    s.acks_updates.load(Ordering::SeqCst)
                        && s.acked.load(Ordering::Acquire) < version
                        && !s.ended.load(Ordering::Acquire)
                })
                .collect();
            let now = Instant::now();
            if pending.is_empty() {
                return Ok(());
            }
            if now >= deadline {
                for s in &pending {
                    s.abort("peer did not confirm a region update");
                }
                return Err(Error::failed(format!(
                    "{} same-host peer(s) did not confirm the region update within {wait:?}; they \
                     were disconnected, and the memory must stay allocated",
                    pending.len()
                )));
            }
            g = self.acks.wait_timeout(g, (deadline - now).min(Duration::from_millis(50))).unwrap().0;
        }
    }
}

impl Tick for Server {
    /// Retries the updates still owed, and disconnects peers that owe one for too long.
    fn tick(&self, _now: Instant) -> bool {
        if self.stopping.load(Ordering::Acquire) {
            return false;
        }
        let mut owing = self.owing();
        if owing.is_empty() {
            self.retrying.store(false, Ordering::Release);
            // An update owed since the check above armed no timer (this one ran): keep it.
            owing = self.owing();
            if owing.is_empty() || self.retrying.swap(true, Ordering::AcqRel) {
                return false;
            }
        }
        for s in owing {
            self.push_update(&s);
        }
        true
    }
}

fn owes_update(s: &Served) -> bool {
    s.welcomed.load(Ordering::Acquire)
        && !s.ended.load(Ordering::Acquire)
        && (s.due.load(Ordering::Acquire) > s.sent.load(Ordering::Acquire)
            || s.due_since.lock().unwrap().is_some())
}
