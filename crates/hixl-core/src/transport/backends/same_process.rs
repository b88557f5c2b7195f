//! The `self` backend: two engines in one process. Data moves by plain memcpy on the calling
//! thread (no system call, no socket on the data path); control stays on the link's TCP
//! channel like every backend's.
//!
//! Being in the same process is proven, never claimed: the peer's Welcome names its same-host
//! socket, and only an engine of this very process is found under that name in the
//! process-local table of listening engines; that engine must hold the other end of this
//! link's stream 0 (an in-process look at its served streams). Every remote range is checked
//! against the target engine's own registry, and its region pinned, exactly as its server
//! would for a TCP frame: the copy can never touch memory the target did not register, nor a
//! region being deregistered.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::complete::Completer;
use crate::error::{Error, Result};
use crate::options::{no_host_facts, BackendDecl, Reach};
use crate::queue::{Part, PartBody, PinSet, SegPair, TransferOp};
use crate::registry::{new_holder_id, Abort, Pin};
use crate::stats::PeerStats;
use crate::sys::mem::{copy_covered, not_covered, PinnedMemory};
use crate::transport::backend::{with_local_socket, Backend, OpenCtx, HOST_TO_HOST};
use crate::transport::control::channel::ControlChannel;
use crate::transport::target_side::{find, Server};
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// The backend's name, as `hixl.backends` and `stats()` spell it.
pub(crate) const NAME: &str = "self";

/// The `self` backend's declaration: its entry in the one table (`transport::backends`).
pub(crate) const DECL: BackendDecl = BackendDecl {
    name: NAME,
    meaning: "same process",
    reach: Reach::Process,
    domains: "host",
    offered: "",
    cli: false,
    baseline: "memcpy",
    options: &[],
    host_facts: no_host_facts,
};

/// A link to an engine of this same process.
pub struct SameProcessLink {
    /// This link as a holder of its own side's region pins.
    holder_id: u64,
    tcp: Arc<dyn ControlChannel>,
    target: Arc<Server>,
    done: Completer,
    closed: AtomicBool,
    /// Stand-in holder for pins (the copy runs on the caller's thread, so nothing to abort).
    holder: Arc<dyn Abort>,
}

struct NoAbort(u64);
impl Abort for NoAbort {
    fn abort(&self, _why: &str) {}

    fn holder_id(&self) -> u64 {
        self.0
    }
}

impl SameProcessLink {
    /// Wraps a connected TCP link whose peer is `target`, an engine of this process.
    pub(crate) fn new(tcp: Arc<dyn ControlChannel>, target: Arc<Server>) -> Arc<SameProcessLink> {
        let done = Completer::new(NAME, &tcp.peer_info().engine_id, tcp.stats());
        Arc::new(SameProcessLink {
            holder_id: new_holder_id(),
            tcp,
            target,
            done,
            closed: AtomicBool::new(false),
            holder: Arc::new(NoAbort(new_holder_id())),
        })
    }

    /// Checks and pins the remote range in the target's own registry.
    fn pin_remote(&self, addr: u64, len: u64, write: bool) -> Result<Pin> {
        let region = self.target.ctx.registry.lookup_for(addr, len, "remote", write)?;
        region.pin(&self.holder)
    }

    /// Copies the segments between `local` (the part's pins) and the target's regions, each
    /// remote range checked against the target engine's registry and its region pinned until
    /// the copy ends (`copy_covered` checks both sides; memmove tolerates overlap).
    fn copy(&self, op: TransferOp, local: &dyn PinnedMemory, segs: &[SegPair]) -> Result<()> {
        let write = op == TransferOp::Write;
        let mut pins: Vec<Pin> = Vec::new();
        for s in segs {
            if !pins.iter().any(|p| p.region().contains(s.remote, s.len)) {
                pins.push(self.pin_remote(s.remote, s.len, write)?);
            }
        }
        let remote = PinSet::new(pins);
        for s in segs {
            let copied = if write {
                copy_covered(&remote, s.remote, local, s.local, s.len)
            } else {
                copy_covered(local, s.local, &remote, s.remote, s.len)
            };
            if !copied {
                return Err(not_covered(s.local, s.len));
            }
        }
        Ok(())
    }

    fn execute(&self, part: &Part) -> Result<()> {
        if !self.is_alive() {
            let why = self.tcp.close_reason();
            return Err(Error::new(why.status, format!("the link is closed: {}", why.message)));
        }
        match (&part.body, part.memory()) {
            (PartBody::Notify(_), _) => Err(Error::failed("a notification reached the copy path")),
            (_, None) => Err(crate::queue::unpinned_part()),
            (PartBody::Data(segs), Some(local)) => self.copy(part.req.op, &**local, segs),
            (PartBody::Strided(st), Some(local)) => {
                st.for_each_chunk(1024, |c| self.copy(part.req.op, &**local, c))
            }
        }
    }

    fn finish_part(&self, part: Part, res: Result<()>) {
        self.tcp.finish_after(&self.done, part, res);
    }
}

impl DataPath for SameProcessLink {
    fn backend(&self) -> &'static str {
        NAME
    }

    fn parallelism(&self) -> usize {
        1
    }

    /// Copies at once, on the calling thread: the request is settled when this returns.
    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        for part in parts {
            let res = self.execute(&part);
            self.finish_part(part, res);
        }
        Ok(())
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && self.tcp.is_alive()
    }

    fn dead_reason(&self) -> Option<String> {
        self.tcp.dead_reason()
    }

    fn close(&self, why: Error) {
        self.closed.store(true, Ordering::Release);
        self.tcp.close(why);
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.tcp.stats()
    }
}

impl Abort for SameProcessLink {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}

/// Two engines of one process: memcpy, after an in-process check that the peer engine holds
/// this very stream (see this module).
pub(crate) struct SameProcess;

impl Backend for SameProcess {
    fn name(&self) -> &'static str {
        NAME
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        HOST_TO_HOST
    }

    fn capability(&self, local_socket: &str) -> Option<Capability> {
        with_local_socket(self, local_socket)
    }

    fn connect(
        &self,
        _ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        let (ours, theirs) = control.stream0_ends().map_err(|e| e.message)?;
        let target = find(&offer.param, &ours, &theirs)?;
        Ok(SameProcessLink::new(control.clone(), target))
    }
}
