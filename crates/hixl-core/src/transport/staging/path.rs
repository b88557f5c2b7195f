//! The `tcp` backend's data path as the engine sees it: the link's own path wrapped so that
//! the parts of requests that touch device memory go through the engine's [`Stager`], which
//! runs them as chunk-sized host transfers on that same inner path, and every other part goes
//! to the inner path as it is. Chosen at connect time (`backends::tcp`), so neither the engine
//! nor the TCP code asks whether a path stages.

use std::sync::{Arc, Weak};

use super::Stager;
use crate::complete::Completer;
use crate::error::{Error, Result};
use crate::queue::{Part, Request, WaitHelp};
use crate::registry::{new_holder_id, Abort};
use crate::stats::PeerStats;
use crate::transport::control::channel::ControlChannel;
use crate::transport::{DataPath, RailSnapshot, Rescue};

/// A data path that moves host memory only, with device memory staged through the engine's
/// stager (see this module).
pub(crate) struct StagedPath {
    inner: Arc<dyn DataPath>,
    /// The link's control channel: a staged request's notification after the data goes over
    /// it, and a staged part that cannot be queued is reported to it.
    control: Arc<dyn ControlChannel>,
    stager: Arc<Stager>,
    holder_id: u64,
}

impl StagedPath {
    /// `inner`, staging device memory through `stager`.
    pub(crate) fn wrap(
        inner: Arc<dyn DataPath>,
        control: Arc<dyn ControlChannel>,
        stager: Arc<Stager>,
    ) -> Arc<dyn DataPath> {
        Arc::new(StagedPath { inner, control, stager, holder_id: new_holder_id() })
    }

    /// Fails `parts` (their request could not be staged) the way the inner path fails a part
    /// it took: through the completer, counted in the peer's stats.
    fn fail(&self, parts: Vec<Part>, err: &Error) {
        let done = Completer::new(self.inner.backend(), &self.control.peer_info().engine_id, self.stats());
        for p in parts {
            self.control.finish_after(&done, p, Err(err.clone()));
        }
    }
}

/// The parts of each request, in the order the requests first appear.
fn by_request(parts: Vec<Part>) -> Vec<Vec<Part>> {
    let mut groups: Vec<(Arc<Request>, Vec<Part>)> = Vec::new();
    for p in parts {
        match groups.iter_mut().find(|(r, _)| Arc::ptr_eq(r, &p.req)) {
            Some((_, g)) => g.push(p),
            None => groups.push((p.req.clone(), vec![p])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

impl DataPath for StagedPath {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn parallelism(&self) -> usize {
        self.inner.parallelism()
    }

    /// Host-only parts go to the inner path; the parts of each request that touches device
    /// memory go to the stager as one job. Err (nothing taken) when the host parts are
    /// refused, or when the parts are those of one staged request that the stager refuses
    /// (UNSUPPORTED without CUDA); a staged request of several in one call that the stager
    /// refuses fails through the completer instead, since the others were taken.
    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        if !parts.iter().any(|p| p.req.touches_device) {
            return self.inner.submit(parts);
        }
        let (staged, host): (Vec<Part>, Vec<Part>) = parts.into_iter().partition(|p| p.req.touches_device);
        let alone = host.is_empty();
        if !alone {
            self.inner.submit(host)?;
        }
        let mut groups = by_request(staged);
        if alone && groups.len() == 1 {
            let parts = groups.pop().expect("one group");
            return self.stager.submit(self.inner.clone(), self.control.clone(), parts).map_err(|(e, _)| e);
        }
        for parts in groups {
            if let Err((e, parts)) = self.stager.submit(self.inner.clone(), self.control.clone(), parts) {
                self.fail(parts, &e);
            }
        }
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.inner.is_alive()
    }

    fn dead_reason(&self) -> Option<String> {
        self.inner.dead_reason()
    }

    fn close(&self, why: Error) {
        self.inner.close(why)
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.inner.stats()
    }

    fn wait_help(self: Arc<Self>) -> Option<Weak<dyn WaitHelp>> {
        self.inner.clone().wait_help()
    }

    fn queue_slots(&self) -> (usize, usize) {
        self.inner.queue_slots()
    }

    fn rails(&self) -> Vec<RailSnapshot> {
        self.inner.rails()
    }

    fn set_rescue(&self, to: Weak<dyn Rescue>) -> bool {
        self.inner.set_rescue(to)
    }
}

impl Abort for StagedPath {
    fn abort(&self, why: &str) {
        self.inner.abort(why)
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
