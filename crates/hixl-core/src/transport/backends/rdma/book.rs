//! The send-queue bookkeeping of one queue pair, without any verbs call, so that it is tested
//! alone: which work requests are posted, which are signaled, which part each belongs to, what
//! a completion settles, and what an error does to the others.
//!
//! Rules it keeps:
//! - A part's work requests go to one QP, in order; its last one is signaled, and so is every
//!   [`SIGNAL_EVERY`]th and the last of every doorbell batch, so that send-queue slots (which an
//!   unsignaled request holds until a later signaled one completes) always come back.
//! - RC completes in order: a successful completion retires every record before it.
//! - An error completion fails its own part, retires the records before it as successful, and
//!   marks the QP dead; every record after it then comes back flushed (WR_FLUSH_ERR).
//! - A part that was only flushed (its own requests were fine) after an error caused by another
//!   request's range (a remote access or local protection error: PARAM_INVALID) is re-posted
//!   once, from its first request, on the QP that replaces this one (`revive`). After a
//!   NOT_CONNECTED cause (retries exceeded: the peer is unreachable) or when the link closes,
//!   flushed parts fail with that cause.
//! - With `failover` (a link of several rails), a part that failed or was flushed after any
//!   other cause (the rail's peer unreachable, the device gone) is held, neither failed nor
//!   re-posted here: once the QP drained, the link moves every part it holds to another rail
//!   (`evacuate`), or, on a rail that is kept, the QP that replaces this one posts them again
//!   (`revive`).

use std::collections::{HashMap, VecDeque};

use super::verbs::{wc, SendWr};
use crate::error::{Error, Status};
use crate::queue::{Part, TransferStatus};

/// Every this many work requests one is signaled (besides the last of each part and batch).
pub(super) const SIGNAL_EVERY: u32 = 16;

/// One part and the work requests that carry it.
struct Job {
    part: Part,
    wrs: Vec<SendWr>,
    /// Index of its next request to post.
    cursor: usize,
    /// Its requests posted and not yet completed.
    outstanding: usize,
    /// Its first error; `own` when one of its own requests failed (not just flushed).
    err: Option<Error>,
    own: bool,
    reposted: bool,
}

struct Rec {
    seq: u32,
    job: u64,
    last: bool,
}

/// What ended: a part and its result.
pub(super) type Finished = Vec<(Part, Result<(), Error>)>;

/// The bookkeeping of one QP.
pub(super) struct QpBook {
    /// The high bits of every wr_id it makes (the link and the QP's index).
    tag: u64,
    /// Slots of the send queue (`max_send_wr`).
    depth: usize,
    /// Names the QP in messages.
    label: String,
    posted: VecDeque<Rec>,
    next_seq: u32,
    since_signal: u32,
    jobs: HashMap<u64, Job>,
    backlog: VecDeque<u64>,
    next_job: u64,
    /// Why the QP is in the error state (set at its first error completion).
    dead: Option<Error>,
    /// Parts that ended before any of their requests was posted (their request ended).
    orphans: Finished,
    /// Hold parts failed by a cause other than a range, for another rail (see the rules).
    failover: bool,
}

/// Not an `ibv_wc_status`: what the link reports for a LOC_QP_OP_ERR completion while the
/// NIC's port is not active (rdma_rxe fails a send it cannot route so when its netdev is
/// down): the peer cannot be reached through this NIC, as after RETRY_EXC_ERR.
pub(super) const PORT_DOWN: u32 = 0x1_0000;

/// The error a work completion stands for.
pub(super) fn wc_error(status: u32, label: &str) -> Error {
    let name = wc::name(status);
    match status {
        wc::REM_ACCESS_ERR | wc::REM_INV_REQ_ERR => Error::param(format!(
            "the peer's NIC refused a remote range ({name}: its rkey, bounds or access do not allow \
             this operation) on {label}"
        )),
        wc::LOC_PROT_ERR | wc::LOC_LEN_ERR => {
            Error::param(format!("a local range was refused by this NIC ({name}) on {label}"))
        }
        PORT_DOWN => Error::not_connected(format!(
            "this NIC's port is down (local QP operation error while it was not active: the \
             peer cannot be reached through it) on {label}"
        )),
        wc::RETRY_EXC_ERR => Error::not_connected(format!(
            "the peer's NIC did not answer ({name}: the peer is unreachable or gone) on {label}"
        )),
        _ => Error::failed(format!("work request failed ({name}, status {status}) on {label}")),
    }
}

impl QpBook {
    /// Bookkeeping for a QP with `depth` send-queue slots whose wr_ids carry `tag` in their
    /// high 32 bits.
    pub(super) fn new(tag: u64, depth: usize, label: String) -> QpBook {
        QpBook {
            tag,
            depth: depth.max(1),
            label,
            posted: VecDeque::new(),
            next_seq: 1,
            since_signal: 0,
            jobs: HashMap::new(),
            backlog: VecDeque::new(),
            next_job: 1,
            dead: None,
            orphans: Vec::new(),
            failover: false,
        }
    }

    /// Holds parts failed by a cause other than a range instead of failing them (a link of
    /// several rails moves them to another).
    pub(super) fn with_failover(mut self, on: bool) -> QpBook {
        self.failover = on;
        self
    }

    /// Why the QP is in the error state, if it is.
    pub(super) fn dead(&self) -> Option<&Error> {
        self.dead.as_ref()
    }

    /// Whether every posted request has come back (a dead QP may then be replaced).
    pub(super) fn drained(&self) -> bool {
        self.posted.is_empty()
    }

    /// Parts held (posted or waiting to be).
    #[cfg(test)]
    pub(super) fn parts(&self) -> usize {
        self.jobs.len()
    }

    /// Queues a part and the requests that carry it (posted by the next `next_batch`).
    pub(super) fn add(&mut self, part: Part, wrs: Vec<SendWr>) {
        let id = self.next_job;
        self.next_job += 1;
        self.jobs
            .insert(id, Job { part, wrs, cursor: 0, outstanding: 0, err: None, own: false, reposted: false });
        self.backlog.push_back(id);
    }

    /// The next chained list to post (one doorbell): as many requests as the send queue has
    /// room for, with wr_ids and signaled flags set and their records kept; empty while dead.
    pub(super) fn next_batch(&mut self) -> Vec<SendWr> {
        let mut out: Vec<SendWr> = Vec::new();
        if self.dead.is_some() {
            return out;
        }
        let room = self.depth.saturating_sub(self.posted.len());
        while out.len() < room {
            let Some(&id) = self.backlog.front() else { break };
            let job = self.jobs.get_mut(&id).expect("a queued job exists");
            if job.part.req.status() != TransferStatus::Waiting && job.cursor == 0 {
                // Ended (its deadline passed) before any of it was posted: not sent at all.
                self.backlog.pop_front();
                let job = self.jobs.remove(&id).expect("exists");
                let err = job
                    .part
                    .req
                    .error()
                    .unwrap_or_else(|| Error::timeout("request ended before it was posted"));
                self.orphans.push((job.part, Err(err)));
                continue;
            }
            while job.cursor < job.wrs.len() && out.len() < room {
                let mut wr = job.wrs[job.cursor].clone();
                job.cursor += 1;
                job.outstanding += 1;
                let last = job.cursor == job.wrs.len();
                let seq = self.next_seq;
                self.next_seq = self.next_seq.wrapping_add(1).max(1);
                self.since_signal += 1;
                wr.wr_id = self.tag << 32 | seq as u64;
                wr.signaled = last || self.since_signal >= SIGNAL_EVERY;
                if wr.signaled {
                    self.since_signal = 0;
                }
                self.posted.push_back(Rec { seq, job: id, last });
                out.push(wr);
            }
            if job.cursor == job.wrs.len() {
                self.backlog.pop_front();
            }
        }
        if let Some(l) = out.last_mut() {
            if !l.signaled {
                l.signaled = true;
                self.since_signal = 0;
            }
        }
        out
    }

    /// Parts that ended without being posted (their request ended first), since the last call.
    pub(super) fn take_orphans(&mut self) -> Finished {
        std::mem::take(&mut self.orphans)
    }

    /// Records one work completion from the CQ (`seq` = the low 32 bits of its wr_id); returns
    /// the parts that ended. A completion for no record (of a QP already replaced) is ignored.
    pub(super) fn on_wc(&mut self, seq: u32, status: u32) -> Finished {
        self.on_wc_at(seq, status, true)
    }

    /// `from_cq`: the completion came from the CQ, where a QP's completions come in posting
    /// order, so the records still before it are requests that completed with no completion of
    /// their own (unsignaled, before a request that failed or was flushed: a QP moved to the
    /// error state on purpose flushes what follows them). Not so for requests the QP never
    /// took (`unposted`).
    fn on_wc_at(&mut self, seq: u32, status: u32, from_cq: bool) -> Finished {
        let Some(pos) = self.posted.iter().position(|r| r.seq == seq) else { return Vec::new() };
        let mut touched: Vec<u64> = Vec::new();
        // Everything before it completed: in order on RC, or before the failing request.
        let before = if status == wc::WR_FLUSH_ERR && !from_cq { 0 } else { pos };
        for _ in 0..before {
            let r = self.posted.pop_front().expect("counted");
            self.retire(&r, None, &mut touched);
        }
        let r = self.posted.remove(pos - before).expect("found");
        let err = match status {
            wc::SUCCESS => None,
            wc::WR_FLUSH_ERR => {
                let cause = self
                    .dead
                    .get_or_insert_with(|| {
                        Error::failed(format!("{} was moved to the error state", self.label))
                    })
                    .clone();
                Some(flushed(&cause, &self.label))
            }
            s => {
                let e = wc_error(s, &self.label);
                self.dead.get_or_insert_with(|| e.clone());
                if let Some(j) = self.jobs.get_mut(&r.job) {
                    j.own = true;
                }
                Some(e)
            }
        };
        self.retire(&r, err, &mut touched);
        let mut out = self.settle(touched);
        out.append(&mut self.orphans);
        out
    }

    fn retire(&mut self, r: &Rec, err: Option<Error>, touched: &mut Vec<u64>) {
        if let Some(j) = self.jobs.get_mut(&r.job) {
            j.outstanding -= 1;
            if let Some(e) = err {
                j.err.get_or_insert(e);
            }
            if r.last || j.err.is_some() {
                touched.push(r.job);
            }
        }
    }

    /// Ends (or re-queues) the touched jobs that have nothing outstanding.
    fn settle(&mut self, mut touched: Vec<u64>) -> Finished {
        touched.sort_unstable();
        touched.dedup();
        let mut out = Vec::new();
        let mut again: Vec<u64> = Vec::new();
        for id in touched {
            let Some(j) = self.jobs.get(&id) else { continue };
            let complete = j.err.is_none() && j.cursor == j.wrs.len();
            if j.outstanding > 0 || !(complete || j.err.is_some()) {
                continue;
            }
            let retry = j.err.is_some()
                && !j.own
                && !j.reposted
                && self.dead.as_ref().is_some_and(|c| c.status == Status::ParamInvalid)
                && j.part.req.status() == TransferStatus::Waiting;
            if retry {
                again.push(id);
                continue;
            }
            let range = |e: &Error| e.status == Status::ParamInvalid;
            let hold = self.failover
                && self.dead.as_ref().is_some_and(|c| !range(c))
                && !(j.own && j.err.as_ref().is_some_and(range));
            if hold {
                continue; // for `evacuate` or `revive`
            }
            self.backlog.retain(|b| *b != id);
            let j = self.jobs.remove(&id).expect("exists");
            out.push((j.part, j.err.map_or(Ok(()), Err)));
        }
        for id in again {
            let j = self.jobs.get_mut(&id).expect("exists");
            (j.cursor, j.err, j.reposted) = (0, None, true);
            // Back in submission order (job ids grow with it; the backlog stays sorted).
            self.backlog.retain(|b| *b != id);
            let at = self.backlog.iter().position(|b| *b > id).unwrap_or(self.backlog.len());
            self.backlog.insert(at, id);
        }
        out
    }

    /// The WRs from `from` on of a batch `next_batch` returned were not posted (the QP refused
    /// them): the QP is treated as failed with `err` and those records come back flushed.
    pub(super) fn unposted(&mut self, batch: &[SendWr], from: usize, err: Error) -> Finished {
        self.dead.get_or_insert(err);
        let mut out = Vec::new();
        for wr in batch[from..].iter().rev() {
            out.append(&mut self.on_wc_at(wr.wr_id as u32, wc::WR_FLUSH_ERR, false));
        }
        out
    }

    /// The QP is being moved to the error state on purpose (the link closes): its flushed
    /// requests fail with `cause`, and nothing more is posted.
    pub(super) fn kill(&mut self, cause: Error) {
        self.dead.get_or_insert(cause);
    }

    /// The QP was replaced by a fresh one: waiting, re-queued and held parts are posted on it.
    pub(super) fn revive(&mut self, label: String) {
        debug_assert!(self.posted.is_empty());
        self.dead = None;
        self.since_signal = 0;
        self.label = label;
        let held: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.err.is_some() && j.outstanding == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in held {
            let j = self.jobs.get_mut(&id).expect("exists");
            (j.cursor, j.err, j.own, j.reposted) = (0, None, false, true);
            self.backlog.retain(|b| *b != id);
            let at = self.backlog.iter().position(|b| *b > id).unwrap_or(self.backlog.len());
            self.backlog.insert(at, id);
        }
    }

    /// The QP's rail is out and the QP drained: every part leaves it. Returns, in submission
    /// order, the parts to post on another rail (a READ or WRITE may run again: the same bytes
    /// land in the same place), and those that end here: a part one of whose own requests was
    /// refused for its range, and parts whose request ended meanwhile.
    pub(super) fn evacuate(&mut self) -> (Vec<Part>, Finished) {
        debug_assert!(self.posted.is_empty());
        self.backlog.clear();
        let mut out = std::mem::take(&mut self.orphans);
        let mut ids: Vec<u64> = self.jobs.keys().copied().collect();
        ids.sort_unstable();
        let mut again = Vec::new();
        for id in ids {
            let j = self.jobs.remove(&id).expect("exists");
            match j.err {
                Some(e) if j.own && e.status == Status::ParamInvalid => out.push((j.part, Err(e))),
                _ if j.part.req.status() != TransferStatus::Waiting => {
                    let e = j
                        .part
                        .req
                        .error()
                        .unwrap_or_else(|| Error::timeout("request ended before it was re-posted"));
                    out.push((j.part, Err(e)));
                }
                _ => again.push(j.part),
            }
        }
        (again, out)
    }

    /// Ends every part it holds with `err` (the link closes; the QP is destroyed or was).
    pub(super) fn fail_all(&mut self, err: &Error) -> Finished {
        self.posted.clear();
        self.backlog.clear();
        let mut out: Finished =
            self.jobs.drain().map(|(_, j)| (j.part, Err(j.err.unwrap_or_else(|| err.clone())))).collect();
        out.append(&mut self.orphans);
        out
    }
}

/// The error of a request flushed because its QP failed with `cause`.
fn flushed(cause: &Error, label: &str) -> Error {
    let msg = format!("flushed: {label} went to the error state ({})", cause.message);
    match cause.status {
        Status::NotConnected => Error::not_connected(msg),
        _ => Error::failed(msg),
    }
}

#[cfg(test)]
mod tests;
