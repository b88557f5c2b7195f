//! The `rdma` data path to one peer: `hixl.rdma.qps` RC queue pairs. A part becomes a chain of
//! work requests on one QP (see `wrs`), posted with one doorbell as far as the send queue has
//! room; the engine's poller reports completions here, which settle parts through the link's
//! completer (the notification after the data then goes over the control channel). A QP that
//! fails because of one request's range is replaced by a fresh one, and the parts it flushed
//! are posted again on it (see `book`); a QP that finds the peer unreachable closes the link,
//! or, with a rescuer set (failover) and the control channel alive, ends the RDMA path alone
//! and hands the parts that did not land to the rescuer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::book::{Finished, QpBook};
use super::nic::Nic;
use super::verbs::{wc, Qp, QpTransition, Wc};
use super::{exchange, open_qps, wrs, Opened};
use crate::complete::Completer;
use crate::error::{Error, Result, Status};
use crate::queue::{Part, PartBody, TransferStatus};
use crate::registry::{new_holder_id, Abort};
use crate::stats::PeerStats;
use crate::transport::tcp::TcpLink;
use crate::transport::{DataPath, Rescue};
use crate::wire::rdma::RdmaOpen;

/// How long `close` lets flushed requests come back before it destroys the QPs.
const FLUSH_WAIT: Duration = Duration::from_secs(1);

struct Slot {
    /// None once destroyed (the link closed).
    qp: Option<Qp>,
    qpn: u32,
    /// The peer's QP this one is connected to.
    target_qpn: u32,
    book: QpBook,
}

/// An RDMA link to one peer.
pub struct RdmaLink {
    id: u32,
    holder_id: u64,
    nic: Arc<Nic>,
    control: Arc<TcpLink>,
    done: Completer,
    slots: Vec<Mutex<Slot>>,
    repairing: Vec<AtomicBool>,
    next: AtomicUsize,
    closed: AtomicBool,
    reason: Mutex<Option<Error>>,
    /// Parts held by the QPs' books, at most `queue_depth`.
    held: AtomicUsize,
    queue_depth: usize,
    timeout: Duration,
    /// Threads replacing failed QPs (at most one per QP at a time), joined by `close`.
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
    pub(super) fn new(
        id: u32,
        nic: Arc<Nic>,
        control: Arc<TcpLink>,
        qps: Vec<Opened>,
        queue_depth: usize,
        timeout: Duration,
    ) -> RdmaLink {
        control.set_label("rdma");
        let done = Completer::new("rdma", &control.peer_info().engine_id, control.stats());
        let peer = control.peer().to_string();
        let slots = qps
            .into_iter()
            .enumerate()
            .map(|(i, o)| {
                let label = format!("QP {} (to {peer})", o.created.qpn);
                Mutex::new(Slot {
                    qp: Some(o.created.qp),
                    qpn: o.created.qpn,
                    target_qpn: o.remote_qpn,
                    // The depth asked for, not a larger one the device may have given: the
                    // engine's CQ has room for that many of this QP's completions.
                    book: QpBook::new(
                        (id as u64) << 8 | i as u64,
                        o.created.caps.max_send_wr.min(nic.limits.sq_depth) as usize,
                        label,
                    ),
                })
            })
            .collect::<Vec<_>>();
        RdmaLink {
            id,
            holder_id: new_holder_id(),
            repairing: slots.iter().map(|_| AtomicBool::new(false)).collect(),
            nic,
            control,
            done,
            slots,
            next: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            reason: Mutex::new(None),
            held: AtomicUsize::new(0),
            queue_depth,
            timeout,
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
                res => self.control.finish_elsewhere(&self.done, part, res),
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

    /// Posts what the slot's book has ready, with one doorbell.
    fn post_now(&self, slot: &mut Slot) -> Finished {
        let mut out = slot.book.take_orphans();
        let Some(qp) = slot.qp else { return out };
        let batch = slot.book.next_batch();
        if batch.is_empty() {
            return out;
        }
        // SAFETY: every SGE was built from a local range inside a region registered on this
        // NIC (its lkey was found), which the request pins until it settles; a request settles
        // only after its last work request completed or its QP was destroyed.
        if let Err(pe) = unsafe { self.nic.verbs.post_send(qp, &batch) } {
            let _ = self.nic.verbs.modify_qp(qp, &QpTransition::Err);
            let err = Error::failed(format!(
                "ibv_post_send refused work request {} of {} on QP {} (errno {})",
                pe.bad_wr,
                batch.len(),
                slot.qpn,
                pe.errno
            ));
            out.append(&mut slot.book.unposted(&batch, pe.bad_wr, err));
        }
        out
    }

    /// Completions of this link's work requests, from the engine's poller.
    pub(super) fn on_completions(self: &Arc<Self>, wcs: &[Wc]) {
        let mut done: Finished = Vec::new();
        let mut touched: Vec<usize> = Vec::new();
        let mut port_down: Option<bool> = None;
        for w in wcs {
            let idx = ((w.wr_id >> 32) & 0xFF) as usize;
            let Some(slot) = self.slots.get(idx) else { continue };
            if w.status != wc::SUCCESS && w.status != wc::WR_FLUSH_ERR {
                tracing::warn!(
                    peer = %self.control.peer(), qp = w.qp_num, status = wc::name(w.status),
                    vendor_err = w.vendor_err, "RDMA work request failed"
                );
            }
            let mut status = w.status;
            if status == wc::LOC_QP_OP_ERR && *port_down.get_or_insert_with(|| !self.nic.port_active()) {
                status = super::book::PORT_DOWN;
            }
            done.append(&mut slot.lock().unwrap().book.on_wc(w.wr_id as u32, status));
            if !touched.contains(&idx) {
                touched.push(idx);
            }
        }
        let mut close: Option<Error> = None;
        let mut repair: Vec<usize> = Vec::new();
        for idx in touched {
            let mut s = self.slots[idx].lock().unwrap();
            match s.book.dead().cloned() {
                None => done.append(&mut self.post_now(&mut s)),
                Some(_) if !s.book.drained() => {}
                Some(cause) if cause.status == Status::NotConnected => close = Some(cause),
                Some(_) => repair.push(idx),
            }
        }
        self.finish(done);
        if let Some(cause) = close {
            self.die(cause);
            return;
        }
        for idx in repair {
            self.repair(idx);
        }
    }

    /// Replaces the failed QP of slot `idx` by a fresh pair (the peer retires its old one) on a
    /// thread of its own, then posts what waited; if that fails, the link closes.
    fn repair(self: &Arc<Self>, idx: usize) {
        if self.closed.load(Ordering::Acquire) || self.repairing[idx].swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.clone();
        let spawned = std::thread::Builder::new().name(format!("hixl-rdma-fix{idx}")).spawn(move || {
            if let Err(e) = link.replace_qp(idx) {
                link.die(Error::not_connected(format!(
                    "cannot replace a failed QP to {}: {}",
                    link.control.peer(),
                    e.message
                )));
            }
            link.repairing[idx].store(false, Ordering::Release);
        });
        match spawned {
            Ok(h) => {
                let mut t = self.threads.lock().unwrap();
                t.retain(|h| !h.is_finished());
                t.push(h);
            }
            Err(e) => {
                self.repairing[idx].store(false, Ordering::Release);
                self.close(Error::failed(format!("cannot start a thread to replace a failed QP: {e}")));
            }
        }
    }

    fn replace_qp(&self, idx: usize) -> Result<()> {
        let (old, old_target) = {
            let s = self.slots[idx].lock().unwrap();
            (s.qp, s.target_qpn)
        };
        let mut fresh = open_qps(&self.nic, 1, 0)?;
        let mut open = RdmaOpen { retire: vec![old_target], qps: vec![fresh[0].addr] };
        let answer = exchange(&self.control, &open, self.timeout);
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                self.nic.destroy_qp(fresh[0].created.qp, true);
                return Err(e);
            }
        };
        let o = fresh.pop().expect("one QP");
        if let Err(e) = super::connect_qps(&self.nic, std::slice::from_ref(&o), &answer.qps, true) {
            self.nic.destroy_qp(o.created.qp, true);
            return Err(e);
        }
        open.qps.clear();
        let mut s = self.slots[idx].lock().unwrap();
        if self.closed.load(Ordering::Acquire) || s.qp != old {
            drop(s);
            self.nic.destroy_qp(o.created.qp, true);
            return Ok(());
        }
        if let Some(q) = old {
            self.nic.destroy_qp(q, true);
        }
        tracing::info!(peer = %self.control.peer(), old = s.qpn, new = o.created.qpn, "RDMA QP replaced after an error");
        s.qp = Some(o.created.qp);
        s.qpn = o.created.qpn;
        s.target_qpn = answer.qps[0].qpn;
        s.book.revive(format!("QP {} (to {})", o.created.qpn, self.control.peer()));
        let done = self.post_now(&mut s);
        drop(s);
        self.finish(done);
        Ok(())
    }
}

impl DataPath for RdmaLink {
    fn backend(&self) -> &'static str {
        "rdma"
    }

    fn parallelism(&self) -> usize {
        self.slots.len()
    }

    fn submit(&self, parts: Vec<Part>, extra_slots: usize) -> Result<()> {
        if !self.is_alive() {
            return Err(self.reason());
        }
        if parts.iter().all(|p| matches!(p.body, PartBody::Notify(_))) {
            return self.control.submit(parts, extra_slots);
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
        let mut failed: Finished = Vec::new();
        let mut per_slot: Vec<Vec<(Part, Vec<super::verbs::SendWr>)>> =
            self.slots.iter().map(|_| Vec::new()).collect();
        let start = self.next.fetch_add(n, Ordering::Relaxed);
        {
            let table = self.control.table();
            for (i, part) in parts.into_iter().enumerate() {
                match wrs::build(&self.nic, &table, &part) {
                    Ok(w) => per_slot[(start + i) % self.slots.len()].push((part, w)),
                    Err(e) => failed.push((part, Err(e))),
                }
            }
        }
        let mut done = failed;
        for (idx, jobs) in per_slot.into_iter().enumerate() {
            if jobs.is_empty() {
                continue;
            }
            let mut s = self.slots[idx].lock().unwrap();
            for (part, w) in jobs {
                s.book.add(part, w);
            }
            if s.qp.is_none() {
                // The link closed since `is_alive` above and its QPs are gone: nothing would
                // post or flush these parts (they would wait for their deadline).
                done.append(&mut s.book.fail_all(&self.reason()));
            } else if s.book.dead().is_none() {
                done.append(&mut self.post_now(&mut s));
            }
        }
        self.finish(done);
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

    fn stats(&self) -> Arc<PeerStats> {
        self.control.stats()
    }

    fn queue_slots(&self) -> (usize, usize) {
        (self.held.load(Ordering::Relaxed), self.queue_depth)
    }

    fn set_rescue(&self, to: std::sync::Weak<dyn Rescue>) -> bool {
        self.rescue.set(to).is_ok()
    }
}

impl RdmaLink {
    /// Ends the RDMA path (not its control channel): QPs to the error state, a bounded wait
    /// for their flush, QPs destroyed, every part ended (or rescued, see `finish`). A second
    /// call waits, bounded, for the first one's QPs to be gone.
    fn shut(&self, why: Error) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            *self.reason.lock().unwrap() = Some(why.clone());
            for slot in &self.slots {
                let mut s = slot.lock().unwrap();
                s.book.kill(why.clone());
                if let Some(q) = s.qp {
                    let _ = self.nic.verbs.modify_qp(q, &QpTransition::Err);
                }
            }
            // Flushed requests come back through the poller (unless this is the poller).
            if !self.nic.on_poller() {
                let until = Instant::now() + FLUSH_WAIT;
                while Instant::now() < until && self.slots.iter().any(|s| !s.lock().unwrap().book.drained()) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            self.nic.remove_link(self.id);
            let mut done: Finished = Vec::new();
            for slot in &self.slots {
                let mut s = slot.lock().unwrap();
                // Destroyed first: after this the device touches none of the parts' memory.
                if let Some(q) = s.qp.take() {
                    self.nic.destroy_qp(q, true);
                }
                done.append(&mut s.book.fail_all(&why));
            }
            self.finish(done);
            *self.closed_done.0.lock().unwrap() = true;
            self.closed_done.1.notify_all();
        } else if !self.nic.on_poller() {
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

impl Abort for RdmaLink {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
