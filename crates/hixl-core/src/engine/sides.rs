//! Paths besides the chosen one: a batch whose memory domains the link's data path does not
//! serve (device memory on an `rdma` link, which moves host memory only) goes over the first
//! backend after it in `hixl.backends` that the peer offers for those domains (`tcp`, which
//! stages device memory through pinned host buffers), opened at the first such batch over the
//! link's control channel and kept with the link (see `validate::route`).

use std::sync::{Arc, Mutex};

use super::failover::Opener;
use crate::error::{Error, Result, Status};
use crate::transport::backend::Backend;
use crate::transport::control::channel::ControlChannel;
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// A later backend the peer offers, and its path once opened.
struct Later {
    backend: Arc<dyn Backend>,
    offer: Capability,
    /// The pairs both sides serve with it.
    domains: Vec<(Domain, Domain)>,
    path: Mutex<Option<Arc<dyn DataPath>>>,
}

/// The later backends of one link.
pub(super) struct Sides {
    later: Vec<Later>,
    opener: Opener,
}

impl Sides {
    /// The backends of `opener.next` that the peer offers (per `control`'s handshake).
    pub(super) fn new(control: &dyn ControlChannel, opener: Opener) -> Sides {
        let later = opener
            .next
            .iter()
            .filter_map(|b| {
                let offer = control.handshake().offer(b.name())?.clone();
                let domains: Vec<(Domain, Domain)> = b
                    .domains()
                    .iter()
                    .copied()
                    .filter(|(l, t)| {
                        offer.domains.iter().any(|(ol, ot)| ol.same_kind(*l) && ot.same_kind(*t))
                    })
                    .collect();
                Some(Later { backend: b.clone(), offer, domains, path: Mutex::new(None) })
            })
            .collect();
        Sides { later, opener }
    }

    /// The domain pairs of each later backend, in order.
    pub(super) fn domains(&self) -> Vec<&[(Domain, Domain)]> {
        self.later.iter().map(|l| l.domains.as_slice()).collect()
    }

    /// The path of later backend `i`, opened now over `control` if it is not open (or died).
    pub(super) fn path(&self, i: usize, control: &Arc<dyn ControlChannel>) -> Result<Arc<dyn DataPath>> {
        let l = &self.later[i];
        let mut path = l.path.lock().unwrap();
        if let Some(p) = path.as_ref().filter(|p| p.is_alive()) {
            return Ok(p.clone());
        }
        let p = l.backend.connect(&self.opener.ctx(), control, &l.offer).map_err(|why| {
            Error::new(
                Status::NotConnected,
                format!(
                    "cannot open the {} path to {} for this memory: {why}",
                    l.backend.name(),
                    control.peer()
                ),
            )
        })?;
        tracing::info!(peer = %control.peer(), backend = l.backend.name(), "data path opened for other memory domains");
        *path = Some(p.clone());
        Ok(p)
    }

    /// Closes every path opened here.
    pub(super) fn close(&self, why: &Error) {
        for l in &self.later {
            let p = l.path.lock().unwrap().take();
            if let Some(p) = p {
                p.close(why.clone());
            }
        }
    }
}
