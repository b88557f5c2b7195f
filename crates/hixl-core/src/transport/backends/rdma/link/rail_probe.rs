//! A rail left out comes back: while one is out, a thread of the link probes it, with a
//! growing pause between tries (`PROBE_FIRST` to `PROBE_MOST`). A try needs the device's port
//! active and every QP of the rail drained and gone (its parts moved to the other rails), then
//! makes a fresh QP for each (the peer retires its old ones, through the same BackendOpen as a
//! replaced QP) and sends one zero-length RDMA WRITE on each: it carries no rkey and moves no
//! byte, so it proves only that the path answers. When every one completes, the fresh QPs take
//! the old ones' places, the rail is up again and parts are placed on it as before; the log
//! says so (INFO) and `stats()` counts it (`returns` of the rail). A try that fails gives its
//! QPs back (the next try retires the peer's) and the rail stays out.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::RdmaLink;
use crate::error::{Error, Result};
use crate::transport::backends::rdma::verbs::{wc, QpTransition, SendWr, WrOp};
use crate::transport::backends::rdma::{connect_qps, exchange, open_qps, Opened};
use crate::wire::rdma::{QpRef, RdmaOpen};

/// The QP index (bits 32..40 of a wr_id) of a probe: no QP of a link has it.
pub(super) const PROBE_IDX: usize = 0xFF;
/// The pause before the first try after a rail went out, and the longest between tries.
const PROBE_FIRST: Duration = Duration::from_millis(100);
const PROBE_MOST: Duration = Duration::from_secs(2);

impl RdmaLink {
    /// Starts the link's prober unless it runs; it ends once every rail is up or the link
    /// closed.
    pub(super) fn start_probe(self: &Arc<Self>) {
        if self.closed.load(Ordering::Acquire) || self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        let link = self.clone();
        let spawned = crate::place::spawn("hixl-rdma-probe".into(), move || {
            link.probe_loop();
            link.probing.store(false, Ordering::Release);
            // A rail that went out after the loop's last look: probe again.
            if link.lanes.iter().any(|l| !l.up.load(Ordering::Acquire)) {
                link.start_probe();
            }
        });
        match spawned {
            Ok(h) => self.keep_thread(h),
            Err(e) => {
                self.probing.store(false, Ordering::Release);
                tracing::warn!(peer = %self.control.peer(), "cannot start a thread to probe RDMA rails that are out: {e}");
            }
        }
    }

    fn probe_loop(&self) {
        let mut pause = PROBE_FIRST;
        loop {
            let until = Instant::now() + pause;
            while Instant::now() < until {
                if self.closed.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let out: Vec<usize> =
                (0..self.lanes.len()).filter(|r| !self.lanes[*r].up.load(Ordering::Acquire)).collect();
            if out.is_empty() || self.closed.load(Ordering::Acquire) {
                return;
            }
            for rail in out {
                match self.probe_rail(rail) {
                    Ok(()) => {}
                    Err(e) => tracing::debug!(
                        peer = %self.control.peer(), device = %self.lanes[rail].nic.device,
                        "RDMA rail still out: {}", e.message
                    ),
                }
            }
            pause = (pause * 2).min(PROBE_MOST);
        }
    }

    /// One try at bringing rail `rail` back (see the module doc).
    fn probe_rail(&self, rail: usize) -> Result<()> {
        let lane = &self.lanes[rail];
        if !lane.nic.port_active() {
            return Err(Error::not_connected(format!("the port of {} is not active", lane.nic.device)));
        }
        if lane.slots.iter().any(|s| s.lock().unwrap().qp.is_some()) {
            return Err(Error::not_connected("its QPs have not all drained yet"));
        }
        let peer_rail = lane.peer_rail.load(Ordering::Relaxed);
        let retire: Vec<QpRef> =
            lane.slots.iter().map(|s| QpRef { rail: peer_rail, qpn: s.lock().unwrap().target_qpn }).collect();
        let fresh = open_qps(&lane.nic, lane.slots.len(), 0)?;
        let open = RdmaOpen { retire, qps: fresh.iter().map(|o| o.addr).collect() };
        let answer = exchange(self.control.as_ref(), &open, self.timeout)?;
        if answer.qps.len() != fresh.len() || answer.qps.iter().any(|q| q.rail != peer_rail) {
            return Err(Error::not_connected(format!(
                "the peer answered {} QPs for {} on its rail {peer_rail}",
                answer.qps.len(),
                fresh.len()
            )));
        }
        // The next try retires these, whatever happens to this one.
        for (s, t) in lane.slots.iter().zip(&answer.qps) {
            s.lock().unwrap().target_qpn = t.qpn;
        }
        connect_qps(&self.rails.nics, &fresh, &answer.qps, true)?;
        for o in &fresh {
            self.probe_qp(rail, o)?;
        }
        for ((slot, o), t) in lane.slots.iter().zip(fresh).zip(&answer.qps) {
            let mut s = slot.lock().unwrap();
            if self.closed.load(Ordering::Acquire) {
                return Ok(()); // `shut` destroys what it found; the rest go with `fresh`
            }
            let qpn = o.qp.qpn();
            s.qp = Some(o.qp);
            s.qpn = qpn;
            s.target_qpn = t.qpn;
            s.book.revive(format!("QP {qpn} of {} (to {})", lane.nic.device, self.control.peer()));
        }
        let why = lane.out_why.lock().unwrap().take().unwrap_or_default();
        lane.returns.fetch_add(1, Ordering::Relaxed);
        lane.up.store(true, Ordering::Release);
        tracing::info!(
            peer = %self.control.peer(), device = %lane.nic.device,
            "RDMA rail back in the rotation: a fresh QP answered (it was out: {why})"
        );
        Ok(())
    }

    /// One zero-length RDMA WRITE on `o`, and its completion, within the link's timeout.
    fn probe_qp(&self, rail: usize, o: &Opened) -> Result<()> {
        let lane = &self.lanes[rail];
        let seq = lane.probe_seq.fetch_add(1, Ordering::Relaxed) as u32;
        let tag = (self.id as u64) << 8 | PROBE_IDX as u64;
        let wr = SendWr {
            wr_id: tag << 32 | seq as u64,
            op: WrOp::Write,
            sges: Vec::new(),
            signaled: true,
            remote_addr: 0,
            rkey: 0,
            inline: false,
        };
        // Safe (`QueuePair::post_send`): a request with no SGE moves no local byte.
        o.qp.post_send(std::slice::from_ref(&wr)).map_err(|pe| {
            Error::not_connected(format!("ibv_post_send refused the probe (errno {})", pe.errno))
        })?;
        // The engine's poller hands the completion over (`on_completions`). This thread never
        // polls itself: a close on the poller's thread joins it.
        let answered = || lane.probe_done.load(Ordering::Acquire) >> 32 == seq as u64;
        let until = Instant::now() + self.timeout;
        while !answered() && Instant::now() < until && !self.closed.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !answered() {
            let _ = o.qp.modify(&QpTransition::Err);
            return Err(Error::not_connected("the probe got no completion in time"));
        }
        let status = (lane.probe_done.load(Ordering::Acquire) & 0xFFFF_FFFF) as u32;
        if status != wc::SUCCESS {
            return Err(Error::not_connected(format!("the probe failed: {}", wc::name(status))));
        }
        Ok(())
    }
}
