//! What a failed QP does to its link:
//! - failed because of one request's range (PARAM_INVALID: the peer's NIC refused an rkey,
//!   bounds or access; a local range refused): the QP is replaced by a fresh one on the same
//!   rail, and the parts it flushed are posted again on it (see `book`);
//! - failed for any other reason (retries exceeded: the peer's port unreachable; the device
//!   gone) on a link with another rail up: its rail is left out. Every QP of the rail is moved
//!   to the error state, and once each drained its parts, the failed and flushed ones
//!   included, are placed on the rails that are up (a READ or WRITE may run again: the same
//!   bytes land in the same place); a prober brings it back once it works (`rail_probe`);
//! - on the last rail up: retries exceeded (or the port down) ends the RDMA path (the peer is
//!   unreachable): the link closes, or fails over (see `die`); another cause replaces the QP,
//!   as a range does.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::RdmaLink;
use crate::error::{Error, Result, Status};
use crate::transport::backends::rdma::book::Finished;
use crate::transport::backends::rdma::verbs::{wc, QpTransition, Wc};
use crate::transport::backends::rdma::{connect_qps, exchange, open_qps};
use crate::transport::DataPath;
use crate::wire::rdma::{QpRef, RdmaOpen};

impl RdmaLink {
    /// Completions of this link's work requests on rail `rail`, from the engine's poller.
    pub(in crate::transport::backends::rdma) fn on_completions(self: &Arc<Self>, rail: usize, wcs: &[Wc]) {
        let Some(lane) = self.lanes.get(rail) else { return };
        let mut done: Finished = Vec::new();
        let mut touched: Vec<usize> = Vec::new();
        let mut port_down: Option<bool> = None;
        for w in wcs {
            let idx = ((w.wr_id >> 32) & 0xFF) as usize;
            if idx == super::rail_probe::PROBE_IDX {
                lane.probe_done.store((w.wr_id & 0xFFFF_FFFF) << 32 | w.status as u64, Ordering::Release);
                continue;
            }
            let Some(slot) = lane.slots.get(idx) else { continue };
            if w.status != wc::SUCCESS && w.status != wc::WR_FLUSH_ERR {
                tracing::warn!(
                    peer = %self.control.peer(), device = %lane.nic.device, qp = w.qp_num,
                    status = wc::name(w.status), vendor_err = w.vendor_err, "RDMA work request failed"
                );
            }
            // rdma_rxe fails a send it cannot route (its netdev down) as a local QP error: the
            // peer is unreachable through this NIC, as after retries exceeded.
            let mut status = w.status;
            if status == wc::LOC_QP_OP_ERR && *port_down.get_or_insert_with(|| !lane.nic.port_active()) {
                status = crate::transport::backends::rdma::book::PORT_DOWN;
            }
            let ended = slot.lock().unwrap().book.on_wc(w.wr_id as u32, status);
            let ok: u64 = ended.iter().filter(|(_, r)| r.is_ok()).map(|(p, _)| p.body.bytes()).sum();
            lane.bytes.fetch_add(ok, Ordering::Relaxed);
            done.extend(ended);
            if !touched.contains(&idx) {
                touched.push(idx);
            }
        }
        let (mut close, mut out) = (None, None);
        let (mut repair, mut evacuate) = (Vec::new(), Vec::new());
        for idx in touched {
            let mut s = lane.slots[idx].lock().unwrap();
            if self.closed.load(Ordering::Acquire) {
                break; // `close` fails what is left
            }
            let others_up = self.live().iter().any(|r| *r != rail);
            match s.book.dead().cloned() {
                None => done.append(&mut self.post_now(&lane.nic, &mut s)),
                Some(_) if !s.book.drained() => {}
                Some(_) if !lane.up.load(Ordering::Acquire) => evacuate.push(idx),
                Some(cause) if cause.status == Status::ParamInvalid => repair.push(idx),
                Some(cause) if others_up => out = Some(cause),
                Some(cause) if cause.status == Status::NotConnected => close = Some(cause),
                Some(_) => repair.push(idx),
            }
        }
        self.finish(done);
        if let Some(cause) = close {
            self.die(cause);
            return;
        }
        if let Some(cause) = out {
            self.rail_out(rail, cause);
        }
        for idx in evacuate {
            self.evacuate(rail, idx);
        }
        for idx in repair {
            self.repair(rail, idx);
        }
    }

    /// Leaves rail `rail` out (once): every QP of it goes to the error state (its requests
    /// come back flushed) and the parts of each drained QP move to the other rails.
    fn rail_out(self: &Arc<Self>, rail: usize, cause: Error) {
        let lane = &self.lanes[rail];
        if !lane.up.swap(false, Ordering::AcqRel) {
            return;
        }
        *lane.out_why.lock().unwrap() = Some(cause.message.clone());
        tracing::warn!(
            peer = %self.control.peer(), device = %lane.nic.device,
            "RDMA rail left out: {}; its parts move to the other rails", cause.message
        );
        for slot in &lane.slots {
            let mut s = slot.lock().unwrap();
            s.book.kill(cause.clone());
            if let Some(q) = &s.qp {
                let _ = q.modify(&QpTransition::Err);
            }
        }
        for idx in 0..lane.slots.len() {
            self.evacuate(rail, idx);
        }
        self.start_probe();
    }

    /// Moves the parts of QP `idx` of an out rail to the rails that are up, once it drained
    /// (its QP is destroyed then: the device touches none of their memory any more).
    pub(super) fn evacuate(&self, rail: usize, idx: usize) {
        let lane = &self.lanes[rail];
        let (again, ended) = {
            let mut s = lane.slots[idx].lock().unwrap();
            if self.closed.load(Ordering::Acquire) || !s.book.drained() {
                return;
            }
            drop(s.qp.take());
            s.book.evacuate()
        };
        self.finish(ended);
        if !again.is_empty() {
            tracing::info!(peer = %self.control.peer(), device = %lane.nic.device, parts = again.len(), "RDMA parts re-posted on the other rails");
            self.place(again);
        }
    }

    /// Replaces the failed QP `idx` of rail `rail` by a fresh pair (the peer retires its old
    /// one) on a thread of its own, then posts what waited; if that fails, the link closes.
    fn repair(self: &Arc<Self>, rail: usize, idx: usize) {
        let lane = &self.lanes[rail];
        if self.closed.load(Ordering::Acquire) || lane.repairing[idx].swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.clone();
        let spawned = crate::place::spawn(format!("hixl-rdma-fix{idx}"), move || {
            if let Err(e) = link.replace_qp(rail, idx) {
                link.die(Error::not_connected(format!(
                    "cannot replace a failed QP to {}: {}",
                    link.control.peer(),
                    e.message
                )));
            }
            link.lanes[rail].repairing[idx].store(false, Ordering::Release);
        });
        match spawned {
            Ok(h) => self.keep_thread(h),
            Err(e) => {
                lane.repairing[idx].store(false, Ordering::Release);
                self.close(Error::failed(format!("cannot start a thread to replace a failed QP: {e}")));
            }
        }
    }

    fn replace_qp(&self, rail: usize, idx: usize) -> Result<()> {
        let lane = &self.lanes[rail];
        let (old, old_target) = {
            let s = lane.slots[idx].lock().unwrap();
            (s.qp.as_ref().map(|q| q.id()), s.target_qpn)
        };
        let peer_rail = lane.peer_rail.load(Ordering::Relaxed);
        let mut fresh = open_qps(&lane.nic, 1, 0)?;
        let retire = vec![QpRef { rail: peer_rail, qpn: old_target }];
        let open = RdmaOpen { retire, qps: vec![fresh[0].addr] };
        let answer = match exchange(self.control.as_ref(), &open, self.timeout) {
            Ok(a) if a.qps.len() == 1 && a.qps[0].rail == peer_rail => a,
            Ok(a) => {
                drop(fresh);
                return Err(Error::not_connected(format!(
                    "the peer answered {} QPs (rails {:?}) for one on its rail {peer_rail}",
                    a.qps.len(),
                    a.qps.iter().map(|q| q.rail).collect::<Vec<_>>()
                )));
            }
            Err(e) => {
                drop(fresh);
                return Err(e);
            }
        };
        let o = fresh.pop().expect("one QP");
        if let Err(e) = connect_qps(&self.rails.nics, std::slice::from_ref(&o), &answer.qps, true) {
            drop(o);
            return Err(e);
        }
        let mut s = lane.slots[idx].lock().unwrap();
        if self.closed.load(Ordering::Acquire)
            || s.qp.as_ref().map(|q| q.id()) != old
            || !lane.up.load(Ordering::Acquire)
        {
            // Closed, or the rail went out meanwhile (its parts moved on): not needed.
            drop(s);
            drop(o);
            return Ok(());
        }
        drop(s.qp.take()); // the failed QP, destroyed before its replacement takes its place
        let qpn = o.qp.qpn();
        tracing::info!(peer = %self.control.peer(), device = %lane.nic.device, old = s.qpn, new = qpn, "RDMA QP replaced after an error");
        s.qp = Some(o.qp);
        s.qpn = qpn;
        s.target_qpn = answer.qps[0].qpn;
        s.book.revive(format!("QP {qpn} of {} (to {})", lane.nic.device, self.control.peer()));
        let done = self.post_now(&lane.nic, &mut s);
        drop(s);
        self.finish(done);
        Ok(())
    }
}
