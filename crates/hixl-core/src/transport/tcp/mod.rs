//! The TCP link (initiator side): a pool of N streams to one peer. Each stream has a writer
//! thread that drains the link's request queue in batches and a reader thread that never waits
//! on its own writes (no bidirectional deadlock). Bytes go straight between the socket and
//! registered memory with sendmsg/readv; nothing is staged.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::auth::{self, FrameMac, Secret, MAC_LEN};
use crate::complete::{Completer, Next};
use crate::error::{Error, Result};
use crate::queue::{Part, PartBody, Strided, TransferOp, TransferStatus, WorkQueue};
use crate::registry::{new_holder_id, Abort, RemoteTable};
use crate::stats::PeerStats;
use crate::transport::handshake::{self, connect_one};
use crate::transport::io::{self, iov};
use crate::transport::{DataPath, PeerInfo, Workers};
use crate::wire::{self, Frame, Seg, StridedSeg};

mod recv;

/// Most parts a writer takes from the queue per wake-up. Fixed, like the three below: they
/// bound how much one writer takes at a time so that the other streams share the load, and
/// they are not a user's concern; `hixl.tcp.coalesce_*` and `hixl.split_bytes` are the knobs
/// for batching small requests and spreading large ones.
const BATCH_PARTS: usize = 64;
/// A writer stops taking parts once it holds this many bytes, leaving the rest to the
/// other streams' writers.
const BATCH_BYTES: u64 = 256 * 1024;
/// Requests up to this size may be sent by the calling thread (see `try_send_inline`).
const INLINE_BYTES: u64 = 256 * 1024;
/// How long a stream writer polls for the next request before it sleeps (see
/// `WorkQueue::with_spin`).
const WRITER_SPIN: Duration = Duration::from_micros(100);

/// Connection parameters.
#[derive(Clone, Debug)]
pub struct ConnectParams {
    /// This engine's id, sent in Hello.
    pub local_id: String,
    /// Streams in the pool.
    pub streams: usize,
    /// Request queue capacity (in parts).
    pub queue_depth: usize,
    /// Deadline for connecting and the handshake.
    pub timeout: Duration,
    /// This machine's identity, sent in Hello.
    pub host: String,
    /// How long a writer waits for more small requests before sending (zero: no wait).
    pub coalesce: Duration,
    /// Most requests in one coalesced batch.
    pub coalesce_max_ops: usize,
    /// The cluster secret, if this engine has one (then every peer must prove it too).
    pub secret: Option<Secret>,
    /// Heartbeat interval on idle links (zero: off).
    pub heartbeat: Duration,
    /// MAC every transfer's bytes too (sealed streams only).
    pub data_mac: bool,
    /// These streams carry a data path, not a control channel (see `wire::FLAG_DATA_PATH`).
    pub data_path: bool,
}

pub(super) struct Pending {
    tag: u64,
    part: Part,
}

pub(super) struct Stream {
    /// Index of this stream, and of its lane in the link's queue.
    pub(super) lane: usize,
    pub(super) sock: TcpStream,
    /// Held while frames are written, so that frames of two senders never interleave; seals
    /// each frame (on an authenticated stream).
    pub(super) send_lock: Mutex<FrameMac>,
    /// Opens incoming frames; taken by the stream's reader thread.
    pub(super) rx: Mutex<Option<FrameMac>>,
    pub(super) pending: Mutex<VecDeque<Pending>>,
    pub(super) next_tag: AtomicU64,
    /// A region-table version the reader still has to confirm (0: none).
    pub(super) ack_due: AtomicU64,
}

/// A TCP link to one peer.
pub struct TcpLink {
    /// This link as a holder of region pins.
    holder_id: u64,
    pub(super) peer: String,
    pub(super) info: PeerInfo,
    /// The peer's region table; direct-access backends hold a read guard while they copy.
    pub(super) table: RwLock<RemoteTable>,
    /// Version of `table` (tables older than it are ignored).
    pub(super) table_version: AtomicU64,
    pub(super) queue: WorkQueue<Part>,
    /// Where the next split request's first share goes (rotates, to spread the load).
    pub(super) next_lane: AtomicUsize,
    pub(super) streams: Vec<Arc<Stream>>,
    pub(super) alive: AtomicBool,
    pub(super) reason: Mutex<Option<Error>>,
    /// Settles this link's requests (and counts them).
    pub(super) done: Completer,
    pub(super) threads: Workers,
    pub(super) coalesce: Duration,
    pub(super) coalesce_max_ops: usize,
    /// The highest tag of a RegionsQuery answered so far (`refresh_table` waits for its own),
    /// rung whenever a table is installed; and the tag of the next query.
    /// for it to move.
    pub(super) tables: (Mutex<u64>, std::sync::Condvar),
    pub(super) next_query: AtomicU64,
    /// Answers to BackendOpen by tag (`open_backend` waits on `tables`' condvar for its own).
    pub(super) opened: Mutex<Vec<(u64, Result<Vec<u8>>)>>,
    /// For a data path: the link's control channel, which sends the notifications after the
    /// data and lives and dies with it (unset: this link is a control channel).
    pub(super) control: std::sync::OnceLock<Arc<TcpLink>>,
    /// For a control channel: its data path's link, closed with it (a dead control channel
    /// must not leave data streams whose queued bytes could still land later).
    pub(super) data: std::sync::OnceLock<std::sync::Weak<TcpLink>>,
    /// Wakes the control thread early: when the link closes, or a confirmation waits (it
    /// sleeps a whole heartbeat interval otherwise).
    pub(super) closing: (Mutex<bool>, std::sync::Condvar),
}

impl TcpLink {
    /// Connects `p.streams` streams to `peer`, performs the handshake on each and starts the
    /// stream threads.
    pub fn connect(peer: &str, addr: SocketAddr, p: &ConnectParams) -> Result<Arc<TcpLink>> {
        Self::connect_counting(peer, addr, p, Arc::new(PeerStats::default()))
    }

    /// Like `connect`, counting into `stats` (a data path counts where its control channel does).
    pub fn connect_counting(
        peer: &str,
        addr: SocketAddr,
        p: &ConnectParams,
        stats: Arc<PeerStats>,
    ) -> Result<Arc<TcpLink>> {
        let deadline = Instant::now() + p.timeout;
        let mut nonce = [0u8; 8];
        auth::random_bytes(&mut nonce)?;
        let nonce = u64::from_le_bytes(nonce);
        // Connect every stream and send every Hello first, then read the Welcomes: the
        // target answers the streams in parallel, so connecting costs about one round trip.
        let mut socks = Vec::with_capacity(p.streams);
        let mut hellos = Vec::with_capacity(p.streams);
        for i in 0..p.streams {
            let s = connect_one(addr, deadline, peer)?;
            hellos.push(handshake::send_hello(&s, p, nonce, i, deadline, peer)?);
            socks.push(s);
        }
        let mut info: Option<PeerInfo> = None;
        let mut macs = Vec::with_capacity(p.streams);
        for (s, hello) in socks.iter().zip(&hellos) {
            let (pi, tx, rx) = handshake::recv_welcome(s, peer, p, hello, deadline)?;
            macs.push((tx, rx));
            if let Some(first) = &info {
                if first.engine_id != pi.engine_id {
                    return Err(Error::not_connected(format!(
                        "{peer} answered as {} and then as {}",
                        first.engine_id, pi.engine_id
                    )));
                }
            } else {
                info = Some(pi);
            }
        }
        let info = info.ok_or_else(|| Error::param("hixl.streams must be at least 1"))?;
        let link = Arc::new(TcpLink {
            holder_id: new_holder_id(),
            peer: peer.to_string(),
            table: RwLock::new(info.regions.clone()),
            table_version: AtomicU64::new(info.table_version),
            info,
            queue: WorkQueue::with_lanes(p.queue_depth, socks.len()).with_spin(WRITER_SPIN),
            next_lane: AtomicUsize::new(0),
            streams: socks
                .into_iter()
                .zip(macs)
                .enumerate()
                .map(|(lane, (sock, (tx, rx)))| {
                    Arc::new(Stream {
                        lane,
                        sock,
                        send_lock: Mutex::new(tx),
                        rx: Mutex::new(Some(rx)),
                        pending: Mutex::new(VecDeque::new()),
                        ack_due: AtomicU64::new(0),
                        next_tag: AtomicU64::new(1),
                    })
                })
                .collect(),
            alive: AtomicBool::new(true),
            reason: Mutex::new(None),
            done: Completer::new("tcp", peer, stats),
            threads: Workers::default(),
            coalesce: p.coalesce,
            coalesce_max_ops: p.coalesce_max_ops,
            closing: (Mutex::new(false), std::sync::Condvar::new()),
            tables: (Mutex::new(0), std::sync::Condvar::new()),
            next_query: AtomicU64::new(1),
            opened: Mutex::new(Vec::new()),
            control: std::sync::OnceLock::new(),
            data: std::sync::OnceLock::new(),
        });
        {
            let (l, every) = (link.clone(), p.heartbeat);
            if let Err(e) = link.threads.spawn("hixl-control".into(), move || l.control(every)) {
                link.close(e.clone());
                return Err(e);
            }
        }
        for (i, s) in link.streams.iter().enumerate() {
            for role in ["w", "r"] {
                let (l, s) = (link.clone(), s.clone());
                let f = move || if role == "w" { l.writer(&s) } else { l.reader(&s) };
                if let Err(e) = link.threads.spawn(format!("hixl-tcp{role}{i}"), f) {
                    link.close(e.clone());
                    return Err(e);
                }
            }
        }
        Ok(link)
    }

    fn writer(self: &Arc<Self>, s: &Stream) {
        let mut batch = Vec::with_capacity(BATCH_PARTS);
        let bytes = |p: &Part| p.body.bytes();
        let lane = Some(s.lane);
        while self.queue.pop_weighted(
            lane,
            &mut batch,
            BATCH_PARTS,
            BATCH_BYTES,
            bytes,
            Duration::from_secs(1),
        ) {
            self.coalesce_more(lane, &mut batch, bytes);
            // A request that already timed out is not sent any further.
            for p in std::mem::take(&mut batch) {
                if p.req.status() == TransferStatus::Waiting {
                    batch.push(p);
                } else {
                    let err =
                        p.req.error().unwrap_or_else(|| Error::timeout("request ended before it was sent"));
                    self.finish_part(p, Err(err));
                }
            }
            if batch.is_empty() {
                continue;
            }
            if let Err(e) = self.send_batch(s, &mut batch) {
                self.close(Error::not_connected(format!(
                    "stream to {} failed while sending: {e}",
                    self.peer
                )));
            }
        }
        self.fail_pending(s);
    }

    /// With `hixl.coalesce_us`, waits that long after the first small request for more, so
    /// that they go out as one send; each still completes on its own.
    fn coalesce_more(&self, lane: Option<usize>, batch: &mut Vec<Part>, bytes: impl Fn(&Part) -> u64 + Copy) {
        if self.coalesce.is_zero() || batch.is_empty() {
            return;
        }
        let until = Instant::now() + self.coalesce;
        let max = self.coalesce_max_ops.max(1);
        while batch.len() < max
            && batch.iter().map(bytes).sum::<u64>() < BATCH_BYTES
            && Instant::now() < until
        {
            let before = batch.len();
            self.queue.pop_weighted(lane, batch, max, BATCH_BYTES, bytes, Duration::ZERO);
            if batch.len() == before {
                std::thread::yield_now();
            }
        }
    }

    fn send_batch(&self, s: &Stream, batch: &mut Vec<Part>) -> std::io::Result<()> {
        let mut mac = s.send_lock.lock().unwrap();
        self.send_locked(s, &mut mac, batch)
    }

    /// Small requests skip the queue when a stream is idle: the caller writes the frame itself,
    /// which saves a thread wake-up on the latency path. Returns the part back otherwise.
    fn try_send_inline(&self, part: Part) -> Option<Part> {
        let small = part.body.bytes() <= INLINE_BYTES;
        if !small || !self.queue.is_empty() || !self.coalesce.is_zero() {
            return Some(part);
        }
        for s in &self.streams {
            if let Ok(mut mac) = s.send_lock.try_lock() {
                let mut batch = vec![part];
                if let Err(e) = self.send_locked(s, &mut mac, &mut batch) {
                    drop(mac);
                    self.close(Error::not_connected(format!(
                        "stream to {} failed while sending: {e}",
                        self.peer
                    )));
                }
                return None;
            }
        }
        Some(part)
    }

    /// Sends a batch of parts on a stream whose send lock (`mac`) the caller holds: each part's
    /// frame, sealed, then its bytes (for writes), then their data MAC (with `hixl.data_mac`).
    fn send_locked(&self, s: &Stream, mac: &mut FrameMac, batch: &mut Vec<Part>) -> std::io::Result<()> {
        let mut heads = Vec::with_capacity(batch.len());
        // One slot per part, allocated up front so that iovecs may point into it.
        let mut data_macs: Vec<[u8; MAC_LEN]> = vec![[0u8; MAC_LEN]; batch.len()];
        for part in batch.iter() {
            let tag = s.next_tag.fetch_add(1, Ordering::Relaxed);
            let frame = match (&part.body, part.req.op) {
                (PartBody::Data(segs), op) => {
                    let remote = segs.iter().map(|p| Seg { addr: p.remote, len: p.len }).collect();
                    match op {
                        TransferOp::Write => Frame::Write { segs: remote },
                        TransferOp::Read => Frame::Read { segs: remote },
                    }
                }
                (PartBody::Strided(st), op) => {
                    let seg =
                        StridedSeg { addr: st.remote, count: st.count, size: st.size, stride: st.rstride };
                    match op {
                        TransferOp::Write => Frame::WriteStrided { seg },
                        TransferOp::Read => Frame::ReadStrided { seg },
                    }
                }
                (PartBody::Notify(n), _) => Frame::Notify { name: n.name.clone(), msg: n.msg.clone() },
            };
            let mut head = wire::encode(&frame, tag, 0);
            let seq = mac.seal(&mut head);
            heads.push((tag, head, mac.data_hasher(seq)));
        }
        // Headers and plain segments go as one vectored send; a strided write's elements are
        // expanded IOV_MAX at a time where its header ends (never all at once).
        let mut iovs = Vec::with_capacity(batch.len() * 2);
        let mut strided_after: Vec<(usize, Strided)> = Vec::new();
        for (i, (part, (_, head, hasher))) in batch.iter().zip(&mut heads).enumerate() {
            iovs.push(io::iov_of(head));
            let write = part.req.op == TransferOp::Write;
            match &part.body {
                PartBody::Data(segs) if write => iovs.extend(segs.iter().map(|p| iov(p.local, p.len))),
                PartBody::Strided(st) if write => strided_after.push((iovs.len(), *st)),
                _ => {}
            }
            if let Some(h) = hasher.as_mut().filter(|_| write && !matches!(part.body, PartBody::Notify(_))) {
                // SAFETY: local segments lie in regions pinned by their requests.
                unsafe { part.body.hash_local(h) };
                data_macs[i] = auth::data_mac(h);
                iovs.push(io::iov_of(&data_macs[i]));
            }
        }
        {
            let mut pend = s.pending.lock().unwrap();
            for (part, (tag, _, _)) in batch.drain(..).zip(&heads) {
                pend.push_back(Pending { tag: *tag, part });
            }
        }
        let fd = s.sock.as_raw_fd();
        let mut sent = 0;
        for (pos, st) in strided_after {
            // SAFETY: headers live in `heads` until we return; local segments lie in regions
            // pinned by their requests until the parts complete.
            unsafe { io::send_all(fd, &mut iovs[sent..pos])? };
            sent = pos;
            st.for_each_chunk(io::IOV_MAX, |c| {
                let mut v: Vec<_> = c.iter().map(|p| iov(p.local, p.len)).collect();
                // SAFETY: as above: pinned local memory.
                unsafe { io::send_all(fd, &mut v) }
            })?;
        }
        // SAFETY: as above.
        unsafe { io::send_all(fd, &mut iovs[sent..]) }
    }

    /// Records the end of one part; the last part settles the request or queues its notify.
    fn finish_part(&self, part: Part, res: Result<()>) {
        if let Some(control) = self.control.get() {
            return control.finish_elsewhere(&self.done, part, res);
        }
        match self.done.finish(part, res) {
            Next::Pending => {}
            // Its slot was reserved at submit; the notification will not use it.
            Next::Settled { notify_dropped: true } => self.queue.unreserve(1),
            Next::Settled { notify_dropped: false } => {}
            Next::Notify(n) => {
                // Into the slot reserved for it at submit, on any stream.
                self.queue.push_reserved(n);
                self.fail_queued_if_closed();
            }
        }
    }

    /// Reports a part that another backend carried over this link's control channel: when the
    /// completer says the notification after the data is due, it goes out here.
    pub(crate) fn finish_elsewhere(&self, done: &Completer, part: Part, res: Result<()>) {
        if let Next::Notify(n) = done.finish(part, res) {
            let req = n.req.clone();
            if let Err(e) = self.submit(vec![n], 0) {
                done.abandon(&req, e);
            }
        }
    }

    /// Closes this link without waiting for its threads: marks it dead (the first call only,
    /// which returns true), resets its sockets and fails whatever is queued or in flight.
    fn shut(&self, why: Error) -> bool {
        let first = self.alive.swap(false, Ordering::AcqRel);
        if first {
            tracing::info!(peer = %self.peer, reason = %why.message, "closing link");
            *self.reason.lock().unwrap() = Some(why);
            self.queue.close();
            self.ring_control();
            for s in &self.streams {
                io::abort(s.sock.as_raw_fd());
            }
        }
        self.fail_queued_if_closed();
        for s in &self.streams {
            self.fail_pending(s);
        }
        first
    }

    /// Makes this link the data path of `control`'s link: notifications after the data go
    /// over `control`, and closing either side closes the pair.
    pub(crate) fn attach_to(self: &Arc<Self>, control: Arc<TcpLink>) -> Result<()> {
        let (ours, theirs) = (&self.info.engine_id, &control.info.engine_id);
        if ours != theirs {
            return Err(Error::not_connected(format!(
                "{}: the data streams reached {ours}, the control channel {theirs}",
                self.peer
            )));
        }
        let _ = control.data.set(Arc::downgrade(self));
        let _ = self.control.set(control);
        Ok(())
    }

    /// Names the backend in logs when another backend carries the data over this link's
    /// control channel.
    pub fn set_label(&self, backend: &'static str) {
        self.done.set_backend(backend);
    }

    fn fail_queued_if_closed(&self) {
        if self.queue.is_closed() {
            let err = self.close_reason();
            while let Some(p) = self.queue.pop() {
                self.finish_part(p, Err(err.clone()));
            }
        }
    }
}

impl DataPath for TcpLink {
    fn backend(&self) -> &'static str {
        "tcp"
    }

    fn parallelism(&self) -> usize {
        self.streams.len()
    }

    fn submit(&self, parts: Vec<Part>, mut extra_slots: usize) -> Result<()> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(self.close_reason());
        }
        if let Some(control) = self.control.get() {
            // Notifications go over the control channel, after the data (see `finish_part`).
            if parts.iter().all(|p| matches!(p.body, PartBody::Notify(_))) {
                return control.submit(parts, extra_slots);
            }
            extra_slots = 0;
        }
        self.queue.reserve(parts.len() + extra_slots)?;
        let mut parts = parts.into_iter();
        if parts.len() == 1 {
            let part = parts.next().unwrap();
            match self.try_send_inline(part) {
                None => {
                    self.queue.unreserve(1);
                    return Ok(());
                }
                Some(p) => self.queue.push_reserved(p),
            }
        }
        if parts.len() > 1 {
            // The shares of a split request: one per stream, so that all streams carry one.
            let start = self.next_lane.fetch_add(1, Ordering::Relaxed);
            for (i, p) in parts.enumerate() {
                self.queue.push_reserved_lane((start + i) % self.streams.len(), p);
            }
        } else {
            for p in parts {
                self.queue.push_reserved(p);
            }
        }
        self.fail_queued_if_closed();
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.control.get().is_none_or(|c| c.is_alive())
    }

    fn dead_reason(&self) -> Option<String> {
        let own = self.reason.lock().unwrap().as_ref().map(|e| e.message.clone());
        own.or_else(|| self.control.get().and_then(|c| c.dead_reason()))
    }

    fn close(&self, why: Error) {
        let first = self.shut(why);
        // A data path and its control channel live and die together. The other side is shut
        // without waiting for its threads from here: when the caller is a thread of either
        // side, joining the other side could wait for a thread that waits for us.
        let partner =
            self.control.get().cloned().or_else(|| self.data.get().and_then(std::sync::Weak::upgrade));
        if first {
            if let Some(p) = &partner {
                p.shut(self.close_reason());
            }
        }
        let inside = self.threads.is_own() || partner.as_ref().is_some_and(|p| p.threads.is_own());
        if !inside {
            self.threads.join_unless_own();
            if let Some(p) = &partner {
                p.threads.join_unless_own();
            }
        }
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.done.stats().clone()
    }

    fn queue_slots(&self) -> (usize, usize) {
        (self.queue.in_use(), self.queue.capacity())
    }
}

impl Abort for TcpLink {
    fn abort(&self, why: &str) {
        self.close(Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
