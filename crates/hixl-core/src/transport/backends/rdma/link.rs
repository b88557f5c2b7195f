//! The `rdma` data path to one peer: `hixl.rdma.qps` RC queue pairs on each rail. A part
//! becomes a chain of work requests on one QP (see `wrs`), posted with one doorbell as far as
//! the send queue has room; the engine's poller reports completions here, which settle parts
//! through the link's completer (the notification after the data then goes over the control
//! channel).
//!
//! Parts go round-robin over the rails that are up, then over each rail's QPs: the engine
//! splits a request of at least `hixl.split_bytes` into one part per QP of every rail, so a
//! large request is striped across the rails by bytes, and a smaller one (one part) stays on
//! one rail. What a failed QP does is in `qp_failure`. When the RDMA path dies by itself (the
//! peer's NIC unreachable on every rail, a failed QP not replaceable) while the control channel
//! lives and a rescuer is set (the engine's failover to the next backend), only the RDMA path
//! ends and the parts that did not land go to the rescuer.

mod qp_failure;
mod rail_probe;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::book::{Finished, QpBook};
use super::nic::{Nic, RailQp};
use super::rails::{CompletionSink, Rails};
use super::verbs::{QpTransition, SendWr, WrOp};
use super::{wrs, Opened};
use crate::complete::Completer;
use crate::error::{Error, Result, Status};
use crate::queue::{Part, Request, TransferStatus, WaitHelp};
use crate::registry::{new_holder_id, Abort};
use crate::stats::PeerStats;
use crate::transport::control::channel::ControlChannel;
use crate::transport::{DataPath, RailSnapshot, Rescue};

/// How long `close` lets flushed requests come back before it destroys the QPs.
const FLUSH_WAIT: Duration = Duration::from_secs(1);

struct Slot {
    /// None once destroyed (the link closed, or its rail is out). First: a slot dropped with
    /// its QP destroys it before its book's parts (and their pins) go.
    qp: Option<RailQp>,
    qpn: u32,
    /// The peer's QP this one is connected to.
    target_qpn: u32,
    book: QpBook,
}

/// One rail of the link: its QPs, whether it is up, what it carried.
struct Lane {
    /// The peer's rail its QPs are connected to (which rkey of a region they carry).
    peer_rail: AtomicU8,
    slots: Vec<Mutex<Slot>>,
    repairing: Vec<AtomicBool>,
    up: AtomicBool,
    /// Why it is out.
    out_why: Mutex<Option<String>>,
    /// Bytes of the parts it completed.
    bytes: AtomicU64,
    /// Times it came back after being left out.
    returns: AtomicU64,
    /// The last probe's completion (`rail_probe`): its sequence number << 32 | status.
    probe_done: AtomicU64,
    probe_seq: AtomicU64,
    /// After `slots` (fields drop in declaration order): QPs still held go before the device.
    nic: Arc<Nic>,
}

/// An RDMA link to one peer.
pub struct RdmaLink {
    id: u32,
    holder_id: u64,
    rails: Arc<Rails>,
    control: Arc<dyn ControlChannel>,
    done: Completer,
    lanes: Vec<Lane>,
    next: AtomicUsize,
    closed: AtomicBool,
    reason: Mutex<Option<Error>>,
    /// Parts held by the QPs' books, at most `queue_depth`.
    held: AtomicUsize,
    queue_depth: usize,
    timeout: Duration,
    /// `hixl.rdma.busy_poll_us`: how long a thread waiting for its request polls the CQ.
    busy_poll: Duration,
    /// A thread probes the rails that are out (`rail_probe`).
    probing: AtomicBool,
    /// Threads replacing failed QPs (at most one per QP at a time) and the prober, joined by
    /// `close`.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Set (and rung) when the first `close` has destroyed the QPs and failed the parts: a
    /// second `close` (finalize while a dead control channel's close runs) waits for it, so
    /// that no caller goes on while the device may still touch the parts' memory.
    closed_done: (Mutex<bool>, std::sync::Condvar),
    /// Takes the parts of a path that died by itself (see `die`); unset: they fail.
    rescue: std::sync::OnceLock<std::sync::Weak<dyn Rescue>>,
    /// Set by `close` (the engine closes the link): nothing is rescued from then on.
    closing: AtomicBool,
    /// Set at the first rescue: the rest of the path's parts go to the rescuer too, even once
    /// the link closes (the rescuer then fails them with the whole story).
    rescued: AtomicBool,
}

impl RdmaLink {
    /// Keeps a thread the link started (a QP repair, the rail prober) for `close` to join,
    /// forgetting those that have ended.
    fn keep_thread(&self, h: std::thread::JoinHandle<()>) {
        let mut t = self.threads.lock().unwrap();
        t.retain(|h| !h.is_finished());
        t.push(h);
    }

    /// The same link, whose waiters poll the CQs for `busy_poll` (`hixl.rdma.busy_poll_us`).
    pub(super) fn with_busy_poll(mut self, busy_poll: Duration) -> RdmaLink {
        self.busy_poll = busy_poll;
        self
    }

    /// A link over `qps`: `per_rail` connected QPs of each of the engine's rails, rail by rail.
    pub(super) fn new(
        id: u32,
        rails: Arc<Rails>,
        control: Arc<dyn ControlChannel>,
        qps: Vec<Opened>,
        per_rail: usize,
        queue_depth: usize,
        timeout: Duration,
    ) -> RdmaLink {
        let done = Completer::new(super::NAME, &control.peer_info().engine_id, control.stats());
        let peer = control.peer().to_string();
        let failover = rails.nics.len() > 1;
        let mut lanes: Vec<Lane> = rails
            .nics
            .iter()
            .map(|nic| Lane {
                nic: nic.clone(),
                peer_rail: AtomicU8::new(0),
                slots: Vec::with_capacity(per_rail),
                repairing: (0..per_rail).map(|_| AtomicBool::new(false)).collect(),
                up: AtomicBool::new(true),
                out_why: Mutex::new(None),
                bytes: AtomicU64::new(0),
                returns: AtomicU64::new(0),
                probe_done: AtomicU64::new(u64::MAX),
                probe_seq: AtomicU64::new(0),
            })
            .collect();
        for o in qps {
            let lane = &mut lanes[o.addr.rail as usize];
            lane.peer_rail.store(o.remote_rail, Ordering::Relaxed);
            let i = lane.slots.len();
            let qpn = o.qp.qpn();
            let label = format!("QP {qpn} of {} (to {peer})", lane.nic.device);
            // The depth asked for, not a larger one the device may have given: the rail's CQ
            // has room for that many of this QP's completions.
            let depth = o.qp.caps().max_send_wr.min(lane.nic.limits.sq_depth) as usize;
            lane.slots.push(Mutex::new(Slot {
                qp: Some(o.qp),
                qpn,
                target_qpn: o.remote_qpn,
                book: QpBook::new((id as u64) << 8 | i as u64, depth, label).with_failover(failover),
            }));
        }
        RdmaLink {
            id,
            holder_id: new_holder_id(),
            rails,
            control,
            done,
            lanes,
            next: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            reason: Mutex::new(None),
            held: AtomicUsize::new(0),
            queue_depth,
            timeout,
            busy_poll: Duration::ZERO,
            probing: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            closed_done: (Mutex::new(false), std::sync::Condvar::new()),
            rescue: std::sync::OnceLock::new(),
            closing: AtomicBool::new(false),
            rescued: AtomicBool::new(false),
        }
    }

    fn reason(&self) -> Error {
        if let Some(e) = self.reason.lock().unwrap().clone() {
            return e;
        }
        let why = self.control.close_reason();
        Error::new(why.status, format!("the RDMA link to {} is closed: {}", self.control.peer(), why.message))
    }

    /// The rescuer, while parts may still go to it: set, and either a rescue begun (the rest
    /// follows, whatever closes meanwhile) or the link not being closed and its control
    /// channel alive.
    fn rescuer(&self) -> Option<Arc<dyn Rescue>> {
        let begun = self.rescued.load(Ordering::Acquire);
        if !begun && (self.closing.load(Ordering::Acquire) || !self.control.is_alive()) {
            return None;
        }
        self.rescue.get().and_then(std::sync::Weak::upgrade)
    }

    fn finish(&self, done: Finished) {
        let rescuer = self.rescuer();
        let mut saved: Vec<Part> = Vec::new();
        let mut cause: Option<Error> = None;
        for (part, res) in done {
            self.held.fetch_sub(1, Ordering::AcqRel);
            match res {
                // The peer's NIC is unreachable (not this part's range): the part goes to the
                // next backend. READ and WRITE are idempotent, so bytes that landed already
                // are simply written again.
                Err(e)
                    if rescuer.is_some()
                        && e.status == Status::NotConnected
                        && part.req.status() == TransferStatus::Waiting =>
                {
                    cause.get_or_insert(e);
                    saved.push(part);
                }
                res => self.control.finish_after(&self.done, part, res),
            }
        }
        if let (Some(r), Some(why)) = (rescuer, cause) {
            self.rescued.store(true, Ordering::Release);
            r.rescue(saved, &why);
        }
    }

    /// The RDMA path died by itself with `why` (the peer's NIC unreachable, a failed QP not
    /// replaceable). With a rescuer and a live control channel, only the QPs go: their parts
    /// go to the rescuer and the control channel stays; otherwise the link closes.
    fn die(&self, why: Error) {
        match self.rescuer() {
            Some(r) => {
                self.rescued.store(true, Ordering::Release);
                r.rescue(Vec::new(), &why);
                self.shut(why);
            }
            None => self.close(why),
        }
    }

    /// The rails that are up.
    fn live(&self) -> Vec<usize> {
        (0..self.lanes.len()).filter(|r| self.lanes[*r].up.load(Ordering::Acquire)).collect()
    }

    /// Posts what the slot's book has ready, with one doorbell.
    fn post_now(&self, nic: &Nic, slot: &mut Slot) -> Finished {
        let mut out = slot.book.take_orphans();
        let Some(qp) = &slot.qp else { return out };
        let mut batch = slot.book.next_batch();
        if batch.is_empty() {
            return out;
        }
        // Small WRITEs go inline (their bytes copied at post time: no DMA read of them later).
        let inline = qp.caps().max_inline_data as u64;
        for w in batch.iter_mut() {
            w.inline = w.op == WrOp::Write && w.bytes() <= inline;
        }
        // Safe (`QueuePair::post_send`): the device moves bytes only through the SGEs' lkeys,
        // each checked against its memory region. That the bytes are the request's is the
        // book's part: `wrs::build` made every SGE from a local range `Nic::lkey` found in one
        // of this NIC's regions, and the book keeps the part (and so the request's pins) until
        // its last request completed or was flushed.
        if let Err(pe) = qp.post_send(&batch) {
            let _ = qp.modify(&QpTransition::Err);
            let err = Error::failed(format!(
                "ibv_post_send refused work request {} of {} on QP {} of {} (errno {})",
                pe.bad_wr,
                batch.len(),
                slot.qpn,
                nic.device,
                pe.errno
            ));
            out.append(&mut slot.book.unposted(&batch, pe.bad_wr, err));
        }
        out
    }

    /// Places parts on the rails that are up (round-robin over the rails, then over each
    /// rail's QPs), builds their work requests for that rail and posts them. A part that cannot
    /// be built ends with its error; with no rail up, every part ends with the link's reason
    /// and the link closes.
    fn place(&self, parts: Vec<Part>) {
        let live = self.live();
        if live.is_empty() {
            let why = self.reason.lock().unwrap().clone().unwrap_or_else(|| {
                Error::not_connected(format!("every RDMA rail to {} is out", self.control.peer()))
            });
            self.finish(parts.into_iter().map(|p| (p, Err(why.clone()))).collect());
            self.die(why);
            return;
        }
        let per_rail = self.lanes[0].slots.len();
        let mut done: Finished = Vec::new();
        let mut jobs: Vec<Vec<(Part, Vec<SendWr>)>> =
            (0..self.lanes.len() * per_rail).map(|_| Vec::new()).collect();
        let start = self.next.fetch_add(parts.len(), Ordering::Relaxed);
        {
            let table = self.control.table();
            for (i, part) in parts.into_iter().enumerate() {
                let k = start + i;
                let (r, q) = (live[k % live.len()], (k / live.len()) % per_rail);
                let lane = &self.lanes[r];
                match wrs::build(&lane.nic, &table, &part, lane.peer_rail.load(Ordering::Relaxed)) {
                    Ok(w) => jobs[r * per_rail + q].push((part, w)),
                    Err(e) => done.push((part, Err(e))),
                }
            }
        }
        let mut evacuate: Vec<(usize, usize)> = Vec::new();
        for (at, list) in jobs.into_iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let (r, q) = (at / per_rail, at % per_rail);
            let lane = &self.lanes[r];
            let mut s = lane.slots[q].lock().unwrap();
            for (part, w) in list {
                s.book.add(part, w);
            }
            if !lane.up.load(Ordering::Acquire) {
                // The rail went out since `live`: its parts leave again (see `rail_out`).
                evacuate.push((r, q));
            } else if s.qp.is_none() {
                // The link closed since `is_alive` and its QPs are gone: nothing would post or
                // flush these parts (they would wait for their deadline).
                done.append(&mut s.book.fail_all(&self.reason()));
            } else if s.book.dead().is_none() {
                done.append(&mut self.post_now(&lane.nic, &mut s));
            }
        }
        self.finish(done);
        for (r, q) in evacuate {
            self.evacuate(r, q);
        }
    }

    /// The link's rails: device, up or out (and why), bytes completed on each.
    fn rail_snapshots(&self) -> Vec<RailSnapshot> {
        self.lanes
            .iter()
            .map(|l| RailSnapshot {
                device: l.nic.device.clone(),
                up: l.up.load(Ordering::Acquire),
                out_why: l.out_why.lock().unwrap().clone().unwrap_or_default(),
                bytes: l.bytes.load(Ordering::Relaxed),
                returns: l.returns.load(Ordering::Relaxed),
            })
            .collect()
    }
}

impl DataPath for RdmaLink {
    fn backend(&self) -> &'static str {
        super::NAME
    }

    fn parallelism(&self) -> usize {
        (self.live().len() * self.lanes[0].slots.len()).max(1)
    }

    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        if !self.is_alive() {
            return Err(self.reason());
        }
        let n = parts.len();
        let held = self.held.fetch_add(n, Ordering::AcqRel);
        if held + n > self.queue_depth {
            self.held.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::new(
                Status::ResourceExhausted,
                format!(
                    "RDMA link to {} holds {held} of {} parts, {n} more needed (raise hixl.queue_depth \
                     or wait for transfers to finish)",
                    self.control.peer(),
                    self.queue_depth
                ),
            ));
        }
        self.place(parts);
        Ok(())
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && self.control.is_alive()
    }

    fn dead_reason(&self) -> Option<String> {
        let own = self.reason.lock().unwrap().as_ref().map(|e| e.message.clone());
        own.or_else(|| self.control.dead_reason())
    }

    fn close(&self, why: Error) {
        self.closing.store(true, Ordering::Release);
        self.shut(why.clone());
        self.control.close(why);
        // Bounded: a replacement waits for the control channel, which is closed now.
        let me = std::thread::current().id();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap());
        for h in threads {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }

    fn set_rescue(&self, to: std::sync::Weak<dyn Rescue>) -> bool {
        self.rescue.set(to).is_ok()
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.control.stats()
    }

    fn wait_help(self: Arc<Self>) -> Option<std::sync::Weak<dyn WaitHelp>> {
        if self.busy_poll.is_zero() {
            return None;
        }
        let me: Arc<dyn WaitHelp> = self;
        Some(Arc::downgrade(&me))
    }

    fn queue_slots(&self) -> (usize, usize) {
        (self.held.load(Ordering::Relaxed), self.queue_depth)
    }

    fn rails(&self) -> Vec<RailSnapshot> {
        self.rail_snapshots()
    }
}

impl RdmaLink {
    /// Ends the RDMA path (not its control channel): QPs to the error state, a bounded wait
    /// for their flush, QPs destroyed, every part ended (or rescued, see `finish`). A second
    /// call waits, bounded, for the first one's QPs to be gone.
    fn shut(&self, why: Error) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            *self.reason.lock().unwrap() = Some(why.clone());
            let slots = || self.lanes.iter().flat_map(|l| l.slots.iter());
            for slot in slots() {
                let mut s = slot.lock().unwrap();
                s.book.kill(why.clone());
                if let Some(q) = &s.qp {
                    let _ = q.modify(&QpTransition::Err);
                }
            }
            // Flushed requests come back through the poller (unless this is the poller).
            if !self.rails.on_poller() {
                let until = Instant::now() + FLUSH_WAIT;
                while Instant::now() < until && slots().any(|s| !s.lock().unwrap().book.drained()) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            self.rails.remove_link(self.id);
            let mut done: Finished = Vec::new();
            for slot in slots() {
                let mut s = slot.lock().unwrap();
                // Destroyed first: after this the device touches none of the parts' memory.
                drop(s.qp.take());
                done.append(&mut s.book.fail_all(&why));
            }
            self.finish(done);
            *self.closed_done.0.lock().unwrap() = true;
            self.closed_done.1.notify_all();
        } else if !self.rails.on_poller() {
            // Another thread is closing this link: wait until its QPs are gone (bounded: the
            // first close waits at most FLUSH_WAIT for the flush, then destroys them).
            let (m, cv) = &self.closed_done;
            let until = Instant::now() + FLUSH_WAIT + Duration::from_secs(1);
            let mut done = m.lock().unwrap();
            while !*done {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                done = cv.wait_timeout(done, left).unwrap().0;
            }
        }
    }
}

/// A thread waiting for its request polls the engine's CQ for up to `hixl.rdma.busy_poll_us`
/// (as perftest's latency loop does): the completion is handled on that thread, which need not
/// be woken for it.
impl CompletionSink for RdmaLink {
    fn on_completions(self: Arc<Self>, rail: usize, wcs: &[super::verbs::Wc]) {
        RdmaLink::on_completions(&self, rail, wcs);
    }

    fn fail(&self, e: Error) {
        DataPath::close(self, e);
    }
}

impl WaitHelp for RdmaLink {
    fn help(&self, req: &Request, until: Instant) {
        let until = until.min(Instant::now() + self.busy_poll);
        self.rails.poll_until(&|| req.has_ended(), until);
    }
}

impl Abort for RdmaLink {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
