//! A soft RC queue pair: its state machine, its send queue (depth and unsignaled accounting),
//! and its requester: one thread that carries out the posted requests in order against the
//! peer's soft NIC and generates their completions. Consecutive READs go out together, up to
//! the QP's `max_rd_atomic`, each telling the responder how many of this QP's READs are then
//! outstanding (a NIC's responder knows it from the PSNs); a responder QP sent more than its
//! `max_dest_rd_atomic` refuses the READ (REM_INV_REQ_ERR) and goes to ERR, as a NIC does.

use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex, RwLockReadGuard};
use std::time::Duration;

use super::responder::{self, Hello, Request, Status};
use super::{Device, SoftCq, SoftMr, MAX_MSG};
use crate::error::{Error, Result};
use crate::sys::sockio;
use crate::transport::backends::rdma::verbs::{
    access, wc, PostError, QpCaps, QpTransition, SendWr, Wc, WrOp,
};
use crate::transport::io::{self, iov};
use crate::wire::rdma::QpAddr;

/// `enum ibv_qp_state` of an RC QP (SQD and SQE are not modelled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Reset,
    Init,
    Rtr,
    Rts,
    Err,
}

struct Inner {
    state: State,
    access: u32,
    remote: Option<QpAddr>,
    /// The PSN the peer starts with (checked when its connection arrives).
    rq_psn: u32,
    sq_psn: u32,
    /// How long one try waits without progress, and how many tries there are.
    timeout: Duration,
    retries: u32,
    /// Posted, not started (an inline WRITE with the bytes copied when it was posted).
    sq: VecDeque<(SendWr, Option<Vec<u8>>)>,
    /// Requests being carried out (several READs at once, one WRITE).
    busy: u32,
    /// `max_rd_atomic` (RTS): READs this QP has outstanding at once.
    rd_out: u8,
    /// `max_dest_rd_atomic` (RTR): READs of its peer this QP answers at once.
    rd_in: u8,
    /// Executed unsignaled requests whose send-queue slots a later signaled completion frees.
    unreclaimed: u32,
    /// Bumped by RESET: the completion of a request from before it is dropped.
    epoch: u64,
    destroyed: bool,
    /// The requester's connection to the peer's NIC.
    conn: Option<Arc<UnixStream>>,
    /// Connections of peers whose requests this QP answers.
    answering: Vec<Arc<UnixStream>>,
}

/// One soft RC QP.
pub(super) struct SoftQp {
    pub(super) qpn: u32,
    pub(super) pd: u64,
    pub(super) dev: Arc<Device>,
    cq: Arc<SoftCq>,
    caps: QpCaps,
    /// The device's `max_qp_init_rd_atom` and `max_qp_rd_atom`: the most a QP may be given.
    rd_max: (u8, u8),
    st: Mutex<Inner>,
    cv: Condvar,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn shut(c: &Option<Arc<UnixStream>>) {
    if let Some(c) = c {
        io::shutdown(c.as_raw_fd());
    }
}

impl SoftQp {
    pub(super) fn new(
        qpn: u32,
        pd: u64,
        dev: Arc<Device>,
        cq: Arc<SoftCq>,
        caps: QpCaps,
        rd_max: (u8, u8),
    ) -> Result<Arc<SoftQp>> {
        Ok(Arc::new(SoftQp {
            qpn,
            pd,
            dev,
            cq,
            caps,
            rd_max,
            st: Mutex::new(Inner {
                state: State::Reset,
                access: 0,
                remote: None,
                rq_psn: 0,
                sq_psn: 0,
                timeout: Duration::from_millis(500),
                retries: 7,
                sq: VecDeque::new(),
                busy: 0,
                rd_out: 1,
                rd_in: 1,
                unreclaimed: 0,
                epoch: 0,
                destroyed: false,
                conn: None,
                answering: Vec::new(),
            }),
            cv: Condvar::new(),
            thread: Mutex::new(None),
        }))
    }

    /// One `ibv_modify_qp`: the transitions an RC QP allows; anything else is EINVAL.
    pub(super) fn modify(self: &Arc<Self>, t: &QpTransition) -> Result<()> {
        let mut s = self.st.lock().unwrap();
        let bad = |from: State| {
            Error::param(format!("soft verbs: QP {} cannot go from {from:?} by {t:?} (EINVAL)", self.qpn))
        };
        match *t {
            QpTransition::Init { port, access: acc } => {
                if !matches!(s.state, State::Reset | State::Init) || port != 1 {
                    return Err(bad(s.state));
                }
                s.access = acc;
                s.state = State::Init;
            }
            QpTransition::Rtr { remote, mtu, port, gid_index, rd_atomic, .. } => {
                if s.state != State::Init
                    || port != 1
                    || gid_index != 0
                    || !(1..=5).contains(&mtu)
                    || rd_atomic > self.rd_max.1
                {
                    return Err(bad(s.state));
                }
                s.rd_in = rd_atomic.max(1);
                s.remote = Some(remote);
                s.rq_psn = remote.psn;
                s.state = State::Rtr;
            }
            QpTransition::Rts { psn, timeout, retry_cnt, rd_atomic } => {
                if s.state != State::Rtr || rd_atomic > self.rd_max.0 {
                    return Err(bad(s.state));
                }
                s.rd_out = rd_atomic.max(1);
                s.sq_psn = psn;
                // 4.096 us * 2^timeout per try, as the IB spec's local ACK timeout.
                s.timeout = Duration::from_nanos(4096u64 << timeout.min(31));
                s.retries = retry_cnt.min(7) as u32;
                s.state = State::Rts;
                let mut th = self.thread.lock().unwrap();
                if th.is_none() {
                    let q = self.clone();
                    let h = crate::place::spawn(format!("hixl-softqp{}", self.qpn), move || q.requester())
                        .map_err(|e| Error::failed(format!("cannot start a soft QP thread: {e}")))?;
                    *th = Some(h);
                }
            }
            QpTransition::Err => {
                s.state = State::Err;
                shut(&s.conn);
                for c in s.answering.drain(..) {
                    io::shutdown(c.as_raw_fd());
                }
            }
            QpTransition::Reset => {
                s.state = State::Reset;
                s.sq.clear();
                s.unreclaimed = 0;
                s.epoch += 1;
                shut(&s.conn);
                s.conn = None;
                s.remote = None;
                for c in s.answering.drain(..) {
                    io::shutdown(c.as_raw_fd());
                }
            }
        }
        self.cv.notify_all();
        Ok(())
    }

    /// `ibv_post_send`: EINVAL before RTS, for too many SGEs, or for an inline request that is
    /// not a WRITE or is longer than the QP's `max_inline_data`, ENOMEM once the send queue
    /// (posted, running, and executed unsignaled requests not yet reclaimed) is full. In ERR the
    /// requests are accepted and flushed. An inline request's bytes are copied here, as a NIC
    /// copies them at post time (no lkey is checked for them).
    ///
    /// # Safety
    /// As [`crate::transport::backends::rdma::verbs::Verbs::post_send`]: an inline request's
    /// SGEs must be readable memory now.
    pub(super) unsafe fn post(&self, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let mut s = self.st.lock().unwrap();
        if !matches!(s.state, State::Rts | State::Err) {
            return Err(PostError { bad_wr: 0, errno: libc::EINVAL });
        }
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sges.len() > self.caps.max_send_sge as usize
                || (wr.inline && (wr.op != WrOp::Write || wr.bytes() > self.caps.max_inline_data as u64))
            {
                return Err(PostError { bad_wr: i, errno: libc::EINVAL });
            }
            let used = s.sq.len() as u32 + s.busy + s.unreclaimed;
            if used >= self.caps.max_send_wr {
                return Err(PostError { bad_wr: i, errno: libc::ENOMEM });
            }
            let data = wr.inline.then(|| {
                let mut d = Vec::with_capacity(wr.bytes() as usize);
                for sge in &wr.sges {
                    // SAFETY: the caller's contract: an inline request's SGEs are readable now
                    // (`QueuePair::post_send` checked each lies in a registered host region
                    // and holds it registered during this call).
                    d.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(sge.addr as *const u8, sge.length as usize)
                    });
                }
                d
            });
            s.sq.push_back((wr.clone(), data));
        }
        self.cv.notify_all();
        Ok(())
    }

    pub(super) fn destroy(&self) {
        {
            let mut s = self.st.lock().unwrap();
            s.destroyed = true;
            shut(&s.conn);
            for c in s.answering.drain(..) {
                io::shutdown(c.as_raw_fd());
            }
        }
        self.cv.notify_all();
        let h = self.thread.lock().unwrap().take();
        if let Some(h) = h {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Whether a connection from `hello` may start answering: the QP is RTR or RTS, connected to
    /// exactly that peer QP, which starts at the PSN it was given. On success the connection is
    /// recorded (modify to ERR or RESET shuts it).
    pub(super) fn accept(&self, h: &Hello, conn: &Arc<UnixStream>) -> bool {
        let mut s = self.st.lock().unwrap();
        let ok = matches!(s.state, State::Rtr | State::Rts)
            && !s.destroyed
            && s.remote.is_some_and(|r| r.gid == h.src_gid && r.qpn == h.src_qpn && r.psn == h.psn);
        if ok {
            s.answering.push(conn.clone());
        }
        ok
    }

    /// What a request arriving at this (responder) QP may do: None when it is no longer RTR/RTS
    /// (the request is dropped, so the requester times out); else its remote access bits and
    /// its `max_dest_rd_atomic`.
    pub(super) fn responder_access(&self) -> Option<(u32, u8)> {
        let s = self.st.lock().unwrap();
        matches!(s.state, State::Rtr | State::Rts).then_some((s.access, s.rd_in))
    }

    /// A responder-side error (class C: remote access, invalid request) moves the QP to ERR.
    pub(super) fn fail_as_responder(&self) {
        let mut s = self.st.lock().unwrap();
        s.state = State::Err;
        shut(&s.conn);
        self.cv.notify_all();
    }

    fn requester(self: Arc<Self>) {
        loop {
            let (wrs, state, epoch) = {
                let mut s = self.st.lock().unwrap();
                loop {
                    if s.destroyed {
                        return;
                    }
                    if !s.sq.is_empty() && matches!(s.state, State::Rts | State::Err) {
                        break;
                    }
                    s = self.cv.wait(s).unwrap();
                }
                let mut wrs = vec![s.sq.pop_front().expect("not empty")];
                // Consecutive READs go out together, at most max_rd_atomic of them.
                while wrs[0].0.op == WrOp::Read
                    && s.state == State::Rts
                    && wrs.len() < s.rd_out as usize
                    && s.sq.front().is_some_and(|w| w.0.op == WrOp::Read)
                {
                    wrs.push(s.sq.pop_front().expect("not empty"));
                }
                s.busy = wrs.len() as u32;
                (wrs, s.state, s.epoch)
            };
            let statuses = if state == State::Err {
                vec![wc::WR_FLUSH_ERR; wrs.len()]
            } else if wrs[0].0.op == WrOp::Read {
                self.execute_reads(&wrs.iter().map(|w| w.0.clone()).collect::<Vec<_>>())
            } else {
                vec![self.execute(&wrs[0].0, wrs[0].1.as_deref())]
            };
            let mut s = self.st.lock().unwrap();
            s.busy = 0;
            if s.epoch != epoch {
                continue; // RESET discarded them: no completion
            }
            for ((wr, _), status) in wrs.iter().zip(statuses) {
                self.complete(&mut s, wr, status, state);
            }
        }
    }

    /// Accounts for one carried-out request and generates its completion.
    fn complete(&self, s: &mut Inner, wr: &SendWr, status: u32, state: State) {
        let status = if status != wc::SUCCESS && s.state == State::Err && state != State::Err {
            // Moved to ERR while it ran (its connection was shut): flushed, not failed.
            wc::WR_FLUSH_ERR
        } else {
            status
        };
        if status != wc::SUCCESS {
            s.unreclaimed = 0;
            if s.state != State::Err {
                s.state = State::Err;
            }
            shut(&s.conn);
            s.conn = None;
        } else if wr.signaled {
            s.unreclaimed = 0;
        } else {
            s.unreclaimed += 1;
        }
        if status != wc::SUCCESS || wr.signaled {
            self.cq.push(Wc { wr_id: wr.wr_id, status, vendor_err: 0, qp_num: self.qpn });
        }
    }

    /// Local checks of the SGEs of `wr`: every lkey names a region of this QP's PD that covers
    /// the SGE and, for the destination of a READ, allows local writes. Adds the regions to
    /// `out`, each once (the caller read-locks each of them once: a second read lock of one
    /// region could wait behind a deregistration waiting for the first); false when a check
    /// fails.
    fn local_regions(&self, wr: &SendWr, out: &mut Vec<Arc<SoftMr>>) -> bool {
        for sge in &wr.sges {
            let Some(mr) = self.dev.mr(sge.lkey) else { return false };
            if mr.pd != self.pd || !mr.covers(sge.addr, sge.length as u64) {
                return false;
            }
            if wr.op == WrOp::Read && mr.access & access::LOCAL_WRITE == 0 {
                return false;
            }
            if !out.iter().any(|m| m.key == mr.key) {
                out.push(mr);
            }
        }
        true
    }

    /// One WRITE: its header and bytes (`inline`: those copied when it was posted; else read
    /// from its SGEs now), then the responder's answer.
    fn execute(&self, wr: &SendWr, inline: Option<&[u8]>) -> u32 {
        let mut mrs = Vec::with_capacity(wr.sges.len());
        if inline.is_none() && !self.local_regions(wr, &mut mrs) {
            return wc::LOC_PROT_ERR;
        }
        let guards: Vec<RwLockReadGuard<'_, bool>> = mrs.iter().map(|m| m.busy.read().unwrap()).collect();
        if guards.iter().any(|g| !**g) {
            return wc::LOC_PROT_ERR; // deregistered meanwhile
        }
        let len = wr.bytes();
        if len > MAX_MSG as u64 {
            return wc::LOC_LEN_ERR;
        }
        let Some(conn) = self.connection() else { return wc::RETRY_EXC_ERR };
        let fd = conn.as_raw_fd();
        let head = Request { op: responder::OP_WRITE, rkey: wr.rkey, addr: wr.remote_addr, len, depth: 0 };
        let head = head.encode();
        let mut iovs = vec![iov(head.as_ptr() as u64, head.len() as u64)];
        match inline {
            Some(d) => iovs.push(iov(d.as_ptr() as u64, d.len() as u64)),
            None => iovs.extend(wr.sges.iter().map(|s| iov(host(&mrs, s), s.length as u64))),
        }
        // SAFETY: the header and the inline copy live on this frame; every other SGE was
        // checked to lie in a registered region, held registered by `guards` for the whole
        // operation.
        if let Err(e) = unsafe { sockio::send_all(fd, &mut iovs) } {
            return self.io_failed(&e);
        }
        let status = self.answer(fd);
        drop(guards);
        status
    }

    /// The responder's answer to one request: SUCCESS, or the status its NAK maps to.
    fn answer(&self, fd: i32) -> u32 {
        let mut answer = [0u8; 8];
        if let Err(e) = io::recv_exact(fd, &mut answer) {
            return self.io_failed(&e);
        }
        match Status::from_byte(answer[0]) {
            Status::Ok => wc::SUCCESS,
            Status::AccessError => wc::REM_ACCESS_ERR,
            Status::InvalidRequest => wc::REM_INV_REQ_ERR,
            Status::OperationError => wc::REM_OP_ERR,
        }
    }

    /// READs outstanding together (at most `max_rd_atomic`): every header goes out first, the
    /// k-th saying k READs of this QP are outstanding, then the answers come in order. After
    /// the first that fails the rest are flushed.
    fn execute_reads(&self, wrs: &[SendWr]) -> Vec<u32> {
        let mut out = vec![wc::WR_FLUSH_ERR; wrs.len()];
        let mut mrs = Vec::new();
        // The READs that pass the local checks, up to the first that does not.
        let mut n = 0;
        while n < wrs.len() && self.local_regions(&wrs[n], &mut mrs) && wrs[n].bytes() <= MAX_MSG as u64 {
            n += 1;
        }
        if n < wrs.len() {
            let bad = &wrs[n];
            out[n] = if bad.bytes() > MAX_MSG as u64 { wc::LOC_LEN_ERR } else { wc::LOC_PROT_ERR };
        }
        if n == 0 {
            return out;
        }
        let guards: Vec<RwLockReadGuard<'_, bool>> = mrs.iter().map(|m| m.busy.read().unwrap()).collect();
        if guards.iter().any(|g| !**g) {
            out[0] = wc::LOC_PROT_ERR; // deregistered meanwhile
            out[1..].fill(wc::WR_FLUSH_ERR);
            return out;
        }
        let Some(conn) = self.connection() else {
            out[0] = wc::RETRY_EXC_ERR;
            out[1..].fill(wc::WR_FLUSH_ERR);
            return out;
        };
        let fd = conn.as_raw_fd();
        let heads: Vec<u8> = wrs[..n]
            .iter()
            .enumerate()
            .flat_map(|(k, wr)| {
                let depth = k as u32 + 1;
                Request {
                    op: responder::OP_READ,
                    rkey: wr.rkey,
                    addr: wr.remote_addr,
                    len: wr.bytes(),
                    depth,
                }
                .encode()
            })
            .collect();
        if let Err(e) = sockio::send_all_bytes(fd, &heads) {
            out[0] = self.io_failed(&e);
            out[1..].fill(wc::WR_FLUSH_ERR);
            return out;
        }
        for (k, wr) in wrs[..n].iter().enumerate() {
            let mut status = self.answer(fd);
            if status == wc::SUCCESS {
                let mut v: Vec<libc::iovec> =
                    wr.sges.iter().map(|s| iov(host(&mrs, s), s.length as u64)).collect();
                // SAFETY: every SGE was checked to lie in a registered region that allows local
                // writes, held registered by `guards` for the whole operation.
                if let Err(e) = unsafe { io::recv_all(fd, &mut v) } {
                    status = self.io_failed(&e);
                }
            }
            out[k] = status;
            if status != wc::SUCCESS {
                out[k + 1..].fill(wc::WR_FLUSH_ERR);
                break;
            }
        }
        drop(guards);
        out
    }

    fn io_failed(&self, e: &std::io::Error) -> u32 {
        if e.raw_os_error() == Some(libc::EFAULT) {
            wc::LOC_PROT_ERR
        } else {
            // No answer (the peer's process is gone, its QP refused us, or it stopped
            // answering for every retry): what a NIC reports after its retries.
            wc::RETRY_EXC_ERR
        }
    }

    /// The requester's connection to the peer's NIC, made on first use: the peer checks that
    /// its QP expects exactly this QP and PSN. Each blocking call on it waits at most the QP's
    /// timeout times its tries.
    fn connection(&self) -> Option<Arc<UnixStream>> {
        let (remote, psn, wait) = {
            let s = self.st.lock().unwrap();
            if let Some(c) = &s.conn {
                return Some(c.clone());
            }
            (s.remote?, s.sq_psn, s.timeout * (s.retries + 1))
        };
        let c = responder::connect(&remote.gid, wait).ok()?;
        let hello = Hello { dst_qpn: remote.qpn, src_qpn: self.qpn, psn, src_gid: self.dev.gid };
        sockio::send_all_bytes(c.as_raw_fd(), &hello.encode()).ok()?;
        let c = Arc::new(c);
        let mut s = self.st.lock().unwrap();
        if s.state != State::Rts {
            io::shutdown(c.as_raw_fd());
            return None;
        }
        s.conn = Some(c.clone());
        Some(c)
    }
}

/// Where an SGE's bytes lie in this process: its region (one of `mrs`, checked by
/// `local_regions`) translates the address (a dma-buf stand-in's is an iova).
fn host(mrs: &[Arc<SoftMr>], s: &crate::transport::backends::rdma::verbs::Sge) -> u64 {
    mrs.iter().find(|m| m.key == s.lkey).map_or(s.addr, |m| m.host_of(s.addr))
}
