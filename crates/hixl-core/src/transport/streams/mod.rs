//! The TCP link (initiator side): a pool of N streams to one peer. Each stream's writer and
//! reader are sources of the engine's reactor (see `reactor`): the writer drains the link's
//! request queue in batches and the reader never waits on writes (no bidirectional deadlock);
//! neither blocks, so a fixed set of I/O workers serves every peer. Bytes go straight between
//! the socket and registered memory with sendmsg/recvmsg; nothing is staged.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::auth::{self, FrameMac, MAC_LEN};
use crate::complete::Completer;
use crate::error::{Error, Result};
use crate::queue::{Part, Request, TransferStatus, WaitHelp, WorkQueue};
use crate::registry::{new_holder_id, Abort, RemoteTable};
use crate::stats::PeerStats;
use crate::transport::control::channel::{ControlChannel, OnClose};
use crate::transport::control::liveness::Liveness;
use crate::transport::io;
use crate::transport::io::nbio::{self, FrameReader, IoJob, Outbox};
use crate::transport::reactor::{self, Interest, Reactor};
use crate::transport::{DataPath, PeerInfo};
use handshake::connect_one;

mod control;
pub mod handshake;
mod recv;
mod send;

pub use handshake::ConnectParams;

/// The `tcp` backend's name, as `hixl.backends` and `stats()` spell it: these streams are
/// its data path (`transport::backends::tcp` declares it), and the control channel labels
/// itself with it too.
pub(crate) const NAME: &str = "tcp";

/// Most parts a writer takes from the queue per batch. Fixed, like the constants below: they
/// bound how much one writer takes at a time so that the other streams share the load, and
/// they are not a user's concern; `hixl.tcp.coalesce_*` and `hixl.split_bytes` are the knobs
/// for batching small requests and spreading large ones.
const BATCH_PARTS: usize = 64;
/// A writer stops taking parts once it holds this many bytes, leaving the rest to the
/// other streams' writers.
const BATCH_BYTES: u64 = 256 * 1024;
/// Requests up to this size are sent by the calling thread when it finds the writer idle
/// (no hand-off to an I/O worker); larger ones are handed off, so the call returns at once.
const INLINE_BYTES: u64 = 256 * 1024;
/// How long a thread reading its own answer waits on the socket before it looks at its
/// request again (a request can end without a byte arriving: closed link, deadline).
const WAIT_SLICE: Duration = Duration::from_millis(20);
/// Bytes a writer sends per run before it lets the other sources of its worker have a turn.
const WRITE_BUDGET: u64 = 16 << 20;
/// Bytes a reader takes per run before it lets the other sources have a turn.
const READ_BUDGET: u64 = 16 << 20;

pub(super) struct Pending {
    tag: u64,
    part: Part,
}

/// The sending side of a stream: seals frames in the order they are queued.
pub(super) struct Tx {
    pub(super) mac: FrameMac,
    pub(super) out: Outbox,
}

/// A READ response's bytes under way into local memory, then their data MAC.
pub(super) struct RxBulk {
    part: Part,
    job: IoJob,
    hasher: Option<blake3::Hasher>,
    tag: [u8; MAC_LEN],
    tag_got: usize,
}

/// The receiving side of a stream.
pub(super) struct Rx {
    pub(super) mac: FrameMac,
    pub(super) frames: FrameReader,
    pub(super) bulk: Option<RxBulk>,
}

pub(crate) struct Stream {
    /// Index of this stream, and of its lane in the link's queue.
    pub(super) lane: usize,
    /// The stream's one descriptor: the reader and the writer are registered on it (the
    /// writer in its worker's second epoll set, see `Reactor::add_second`).
    pub(super) sock: TcpStream,
    /// Held while frames are sealed and sent (never across a wait).
    pub(super) tx: Mutex<Tx>,
    /// Held by the reader while it runs.
    pub(super) rx: Mutex<Rx>,
    pub(super) pending: Mutex<VecDeque<Pending>>,
    pub(super) next_tag: AtomicU64,
    /// The reactor tokens of the writer and the reader.
    pub(super) writer_token: AtomicU64,
    reader_token: AtomicU64,
}

/// Heartbeat state of a link (see `streams::control`).
pub(super) struct Beat {
    pub(super) every: Duration,
    pub(super) live: Liveness,
    pub(super) probes_sent: u64,
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
    pub(super) reactor: Arc<Reactor>,
    pub(super) beat: Mutex<Beat>,
    pub(super) coalesce: Duration,
    pub(super) coalesce_max_ops: usize,
    /// The highest tag of a RegionsQuery answered so far (`refresh_table` waits for its own),
    /// rung whenever a table is installed; and the tag of the next query.
    pub(super) tables: (Mutex<u64>, std::sync::Condvar),
    pub(super) next_query: AtomicU64,
    /// Answers to BackendOpen by tag (`open_backend` waits on `tables`' condvar for its own).
    pub(super) opened: Mutex<Vec<(u64, Result<Vec<u8>>)>>,
    /// What the streams carry: the control channel, or the `tcp` backend's data path (which
    /// holds its control channel).
    pub(super) role: Role,
    /// For a control channel: what runs once when it closes (the data paths that live and die
    /// with it), given the reason.
    pub(super) on_close: Mutex<Vec<OnClose>>,
}

/// What a link's streams carry.
pub(crate) enum Role {
    /// The link's control channel: handshake, region tables, notifications, heartbeats.
    Control,
    /// The `tcp` backend's data path. Notifications after the data go over this control
    /// channel, with which the path lives and dies.
    Data(Arc<dyn ControlChannel>),
}

impl TcpLink {
    /// Connects a control channel to `peer`: `p.streams` streams, the handshake on each, and
    /// the stream sources started on the engine's reactor.
    pub fn connect(peer: &str, addr: SocketAddr, p: &ConnectParams) -> Result<Arc<TcpLink>> {
        Self::open(peer, addr, p, Arc::new(PeerStats::default()), Role::Control)
    }

    /// Connects the `tcp` backend's data path to the peer at the other end of `control`: it
    /// counts where the control channel does, sends its notifications over it, and closes
    /// with it (both ways).
    pub(crate) fn connect_data(
        control: &Arc<dyn ControlChannel>,
        addr: SocketAddr,
        p: &ConnectParams,
    ) -> Result<Arc<TcpLink>> {
        let data = Self::open(control.peer(), addr, p, control.stats(), Role::Data(control.clone()))?;
        let (ours, theirs) = (&data.info.engine_id, &control.handshake().engine_id);
        if ours != theirs {
            let e = Error::not_connected(format!(
                "{}: the data streams reached {ours}, the control channel {theirs}",
                data.peer
            ));
            data.shut(e.clone());
            return Err(e);
        }
        let weak = Arc::downgrade(&data);
        control.on_close(Box::new(move |why| {
            if let Some(d) = weak.upgrade() {
                // What the peer already answered settles before the rest fails.
                d.read_received_all();
                d.shut(why);
            }
        }));
        Ok(data)
    }

    fn open(
        peer: &str,
        addr: SocketAddr,
        p: &ConnectParams,
        stats: Arc<PeerStats>,
        role: Role,
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
            hellos.push(handshake::send_hello(
                &s,
                p,
                matches!(role, Role::Data(_)),
                nonce,
                i,
                deadline,
                peer,
            )?);
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
        let info = info.ok_or_else(|| Error::param("hixl.tcp.streams must be at least 1"))?;
        let mut streams = Vec::with_capacity(socks.len());
        for (lane, (sock, (tx, rx))) in socks.into_iter().zip(macs).enumerate() {
            nbio::prepare(&sock).map_err(|e| Error::not_connected(format!("stream to {peer}: {e}")))?;
            streams.push(Arc::new(Stream {
                lane,
                sock,
                tx: Mutex::new(Tx { mac: tx, out: Outbox::default() }),
                rx: Mutex::new(Rx { mac: rx, frames: FrameReader::after_handshake(false), bulk: None }),
                pending: Mutex::new(VecDeque::new()),
                next_tag: AtomicU64::new(1),
                writer_token: AtomicU64::new(0),
                reader_token: AtomicU64::new(0),
            }));
        }
        let every = p.heartbeat;
        let link = Arc::new(TcpLink {
            holder_id: new_holder_id(),
            peer: peer.to_string(),
            table: RwLock::new(info.regions.clone()),
            table_version: AtomicU64::new(info.table_version),
            info,
            queue: WorkQueue::with_lanes(p.queue_depth, streams.len()),
            next_lane: AtomicUsize::new(0),
            streams,
            alive: AtomicBool::new(true),
            reason: Mutex::new(None),
            done: Completer::new(NAME, peer, stats),
            reactor: p.reactor.clone(),
            beat: Mutex::new(Beat { every, live: Liveness::new(Instant::now(), every), probes_sent: 0 }),
            coalesce: p.coalesce,
            coalesce_max_ops: p.coalesce_max_ops,
            tables: (Mutex::new(0), std::sync::Condvar::new()),
            next_query: AtomicU64::new(1),
            opened: Mutex::new(Vec::new()),
            role,
            on_close: Mutex::new(Vec::new()),
        });
        for s in &link.streams {
            let w = Arc::new(send::Writer { link: link.clone(), stream: s.clone() });
            let r = Arc::new(recv::Reader { link: link.clone(), stream: s.clone() });
            // Both directions of a stream on one worker; the link's streams on different ones.
            let shard = link.reactor.next_shard();
            let added = link
                .reactor
                .add_second(s.sock.as_raw_fd(), w, Interest::Idle, shard)
                .and_then(|wt| Ok((wt, link.reactor.add(s.sock.as_raw_fd(), r, Interest::Read, shard)?)));
            match added {
                Ok((wt, rt)) => {
                    s.writer_token.store(wt, Ordering::Release);
                    s.reader_token.store(rt, Ordering::Release);
                }
                Err(e) => {
                    DataPath::close(&*link, e.clone());
                    return Err(e);
                }
            }
        }
        // A data path's liveness is its control channel's: they close together, and one
        // heartbeat per peer keeps an idle engine with many peers idle.
        if !every.is_zero() && matches!(link.role, Role::Control) {
            let tick: Arc<dyn crate::transport::reactor::Tick> = link.clone();
            link.reactor.every(every, Arc::downgrade(&tick));
        }
        Ok(link)
    }

    /// The control channel of a data path (None: this link is one).
    pub(super) fn control(&self) -> Option<&Arc<dyn ControlChannel>> {
        match &self.role {
            Role::Data(c) => Some(c),
            Role::Control => None,
        }
    }

    /// Whether the link is open.
    pub(super) fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Records the end of one part: a data path's parts end on its control channel (which
    /// sends the notification after the data when it is due); a control channel's own parts
    /// are notifications, whose end settles their requests.
    fn finish_part(&self, part: Part, res: Result<()>) {
        match &self.role {
            Role::Data(control) => control.finish_after(&self.done, part, res),
            Role::Control => ControlChannel::finish_after(self, &self.done, part, res),
        }
    }

    /// Closes this link: marks it dead (the first call only, which returns true), resets its
    /// sockets, takes its streams off the reactor and fails whatever is queued or in flight.
    /// Bounded: no source blocks, so the locks taken here are held only briefly. Never called
    /// with a stream's `tx` or `rx` lock held.
    fn shut(&self, why: Error) -> bool {
        // The reason is set under its lock before the link reads as closed: a caller that sees
        // it closed always finds why (FAILED after finalize, not a generic NOT_CONNECTED).
        let first = {
            let mut reason = self.reason.lock().unwrap();
            let first = self.alive.swap(false, Ordering::AcqRel);
            if first {
                tracing::info!(peer = %self.peer, reason = %why.message, "closing link");
                *reason = Some(why);
            }
            first
        };
        if first {
            self.queue.close();
            for s in &self.streams {
                io::abort(s.sock.as_raw_fd());
                for t in [&s.writer_token, &s.reader_token] {
                    let t = t.load(Ordering::Acquire);
                    if t != 0 {
                        self.reactor.remove(t);
                    }
                }
            }
        }
        self.fail_queued_if_closed();
        let err = self.close_reason();
        if first {
            // Taken out of the lock first: a hook may close what calls back into this link.
            let hooks = std::mem::take(&mut *self.on_close.lock().unwrap());
            for h in hooks {
                h(err.clone());
            }
        }
        for s in &self.streams {
            // Bytes still queued point into memory of requests failed below: dropped first.
            s.tx.lock().unwrap().out.clear();
            let bulk = s.rx.lock().unwrap().bulk.take();
            if let Some(b) = bulk {
                self.finish_part(b.part, Err(err.clone()));
            }
            self.fail_pending(s);
        }
        first
    }

    /// Runs `hook` once with the reason when this link closes (at once when it is closed
    /// already).
    pub(super) fn on_close_hook(&self, hook: OnClose) {
        let mut hooks = self.on_close.lock().unwrap();
        if self.alive.load(Ordering::Acquire) {
            hooks.push(hook);
            return;
        }
        drop(hooks);
        hook(self.close_reason());
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
        NAME
    }

    fn parallelism(&self) -> usize {
        self.streams.len()
    }

    fn submit(&self, parts: Vec<Part>) -> Result<()> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(self.close_reason());
        }
        self.queue.reserve(parts.len())?;
        let n = self.streams.len();
        if parts.len() > 1 {
            // The shares of a split request: one per stream, so that all streams carry one.
            let start = self.next_lane.fetch_add(1, Ordering::Relaxed);
            let lanes: Vec<(usize, u64)> =
                (0..parts.len()).map(|i| ((start + i) % n, parts[i].body.bytes())).collect();
            for (i, p) in parts.into_iter().enumerate() {
                self.queue.push_reserved_lane((start + i) % n, p);
            }
            for (lane, bytes) in lanes.into_iter().take(n) {
                self.kick(Some(lane), bytes);
            }
        } else {
            let bytes = parts.iter().map(|p| p.body.bytes()).sum();
            for p in parts {
                self.queue.push_reserved(p);
            }
            self.kick(None, bytes);
        }
        self.fail_queued_if_closed();
        Ok(())
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.control().is_none_or(|c| c.is_alive())
    }

    fn dead_reason(&self) -> Option<String> {
        let own = self.reason.lock().unwrap().as_ref().map(|e| e.message.clone());
        own.or_else(|| self.control().and_then(|c| c.dead_reason()))
    }

    fn close(&self, why: Error) {
        // A data path and its control channel live and die together: closing the control
        // channel closes the data path through its hook (`connect_data`).
        if self.shut(why) {
            if let Some(c) = self.control() {
                c.close(self.close_reason());
            }
        }
    }

    fn stats(&self) -> Arc<PeerStats> {
        self.done.stats().clone()
    }

    fn queue_slots(&self) -> (usize, usize) {
        (self.queue.in_use(), self.queue.capacity())
    }

    fn wait_help(self: Arc<Self>) -> Option<std::sync::Weak<dyn WaitHelp>> {
        let me: Arc<dyn WaitHelp> = self;
        Some(Arc::downgrade(&me))
    }
}

/// A small request whose writer ran on the submitting thread has its answer read there as
/// well: the waiting thread sleeps on the stream's socket and runs its reader, so no I/O worker
/// wakes up and nothing is handed over (one wake-up per request on this side instead of two).
/// Anything else, or a stream whose reader another thread runs, waits as usual.
impl WaitHelp for TcpLink {
    fn help(&self, req: &Request, until: Instant) {
        if req.bytes > INLINE_BYTES || !self.coalesce.is_zero() || reactor::on_reactor_thread() {
            return;
        }
        let carries = |s: &&Arc<Stream>| {
            s.pending.lock().unwrap().iter().any(|p| std::ptr::eq(Arc::as_ptr(&p.part.req), req))
        };
        let Some(s) = self.streams.iter().find(carries) else { return };
        let token = s.reader_token.load(Ordering::Acquire);
        // As `Request::wait` does: spin briefly (the answer often arrives within it; longer in
        // low-latency mode, `hixl.tcp.busy_poll_us`), then sleep.
        let spin_until = Instant::now() + crate::queue::SPIN.max(self.reactor.busy_poll());
        self.reactor.drive_here(token, |_| {
            let now = Instant::now();
            let left = until.saturating_duration_since(now);
            if req.status() != TransferStatus::Waiting || left.is_zero() {
                return None;
            }
            Some(if now < spin_until { Duration::ZERO } else { left.min(WAIT_SLICE) })
        });
    }
}

impl Abort for TcpLink {
    fn abort(&self, why: &str) {
        DataPath::close(self, Error::failed(why.to_string()));
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}
