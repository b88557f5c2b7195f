//! The target side: a listener that admits streams, and the publisher that sends region-table
//! updates. Each admitted stream's handshake runs on a thread of its own (`admit`); then the
//! engine's I/O workers serve it (`served_stream`), checking every remote range against this
//! engine's registry. No application code runs here.
//!
//! Before a stream's handshake ends it costs at most its Hello buffer and one thread, under one
//! deadline; such streams are capped in total and per source address (the oldest is closed to
//! admit a new one), and a source address that fails authentication repeatedly is shut out for
//! a while. API threads never send on a peer's socket: region updates are queued and sent by the
//! stream's writer (see `publish`).

pub mod admit;
mod publish;
pub(crate) mod sender;
pub(crate) mod served_stream;
pub(crate) mod source_caps;

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::auth::{FrameMac, Secret};
use crate::error::{Error, Result};
use crate::notify::NotifyStore;
use crate::registry::{new_holder_id, Abort, Registry};
use crate::transport::backend::Backend;
use crate::transport::io::nbio;
use crate::transport::io::{self, addr_text};
use crate::transport::reactor::{Interest, Reactor, Source};
use crate::transport::same_host::proof::LocalListener;
use crate::transport::target_side::admit::serve;
use crate::transport::target_side::source_caps::{source_key, Cap, Counted, SourceCaps};
use served_stream::{SendState, ServedRx};

/// Failed authentications from one source address within `AUTH_WINDOW` after which every new
/// handshake from it waits `AUTH_TARPIT` before it gets a challenge (and failures are no longer
/// logged one by one). Honest peers behind the same address are slowed, never refused.
pub const AUTH_FAILURES_ALLOWED: u32 = 8;
/// The window of `AUTH_FAILURES_ALLOWED`.
pub const AUTH_WINDOW: Duration = Duration::from_secs(10);
/// The wait of a throttled source's handshakes.
pub const AUTH_TARPIT: Duration = Duration::from_secs(1);

/// What served streams need from the engine.
pub struct ServerCtx {
    /// This engine's id.
    pub engine_id: String,
    /// The registry to check ranges against.
    pub registry: Arc<Registry>,
    /// Where incoming notifications go.
    pub notifies: Arc<NotifyStore>,
    /// One deadline for a new stream's whole handshake.
    pub handshake_timeout: Duration,
    /// A peer that has not taken a region update this long is disconnected.
    pub slow_peer_timeout: Duration,
    /// This machine's identity (a hint for initiators; never trusted by them).
    pub host: String,
    /// The cluster secret every stream must prove it knows before Welcome, if any.
    pub secret: Option<Secret>,
    /// Most streams whose handshake has not ended.
    pub max_pending: usize,
    /// Most of those from one source address.
    pub max_pending_per_source: usize,
    /// Most established streams (handshake ended) in all (`hixl.max_streams`; 0: half the
    /// descriptor limit).
    pub max_streams: usize,
    /// Most of those from one source address (`hixl.max_streams_per_source`; 0: a quarter of
    /// the descriptor limit).
    pub max_streams_per_source: usize,
    /// The backends this engine offers (their capabilities go in Welcome), in its order.
    pub backends: Vec<Arc<dyn Backend>>,
    /// The engine's I/O workers, which serve the streams after their handshake.
    pub reactor: Arc<Reactor>,
    /// The hook that serves frames into or out of device memory (staging through pinned
    /// buffers, within the engine's staging budget).
    pub(crate) staging: Arc<dyn crate::transport::TargetStaging>,
}

/// One accepted stream.
pub(crate) struct Served {
    /// This stream as a holder of region pins.
    holder_id: u64,
    /// Its key in `Server::served` (and the notification store's sender id).
    pub(crate) id: u64,
    /// The stream's one descriptor: the reader and the writer are registered on it (the
    /// writer in its worker's second epoll set, see `Reactor::add_second`).
    pub(crate) sock: TcpStream,
    /// The receiving side, held by the reader while it runs.
    pub(crate) rx: Mutex<ServedRx>,
    /// The reader stopped taking frames until the writer sends what is queued.
    pub(crate) paused: AtomicBool,
    /// The reactor tokens of the reader and the writer (0: not registered yet).
    pub(crate) reader_token: AtomicU64,
    pub(crate) writer_token: AtomicU64,
    /// Set once the stream's end was handled.
    finished: AtomicBool,
    /// The source address it counts against in `Server::streams`, once its handshake ended.
    counted: Mutex<Option<IpAddr>>,
    /// The initiator's address and ours, as text (the four-tuple of the same-host proof).
    pub(crate) peer_addr: String,
    pub(crate) local_addr: String,
    /// The engine id the peer is known by, set by its Hello (see `sender`).
    pub(crate) sender: OnceLock<String>,
    /// Held while a frame is written; see [`SendState`].
    pub(crate) send: Mutex<SendState>,
    /// Set once Welcome went out: region updates may follow it.
    pub(crate) welcomed: AtomicBool,
    /// Proven same-host (see `same_host::proof`): region updates need its confirmation.
    pub(crate) acks_updates: AtomicBool,
    /// First stream of its link (region updates go there).
    pub(crate) link_head: AtomicBool,
    /// A data-path stream (Hello flag bit 1): it gets no region table at all.
    pub(crate) data_path: AtomicBool,
    /// What backends set up for this link's initiator (`Backend::accept`: RDMA queue pairs),
    /// dropped when the stream ends.
    pub(crate) accepted: Mutex<crate::transport::backend::Accepted>,
    /// Highest region-table version the peer confirmed.
    pub(crate) acked: AtomicU64,
    /// Set when the serve thread is done with this stream.
    pub(crate) ended: AtomicBool,
    /// Newest region-table version this stream's peer must be sent.
    pub(crate) due: AtomicU64,
    /// Newest version sent to it.
    pub(crate) sent: AtomicU64,
    /// Since when an update has been due and not sent.
    pub(crate) due_since: Mutex<Option<Instant>>,
    /// Bytes of region-table updates queued for this stream (counted for `stats`).
    pub(crate) update_bytes: AtomicU64,
}

impl Abort for Served {
    fn abort(&self, _why: &str) {
        io::shutdown(self.sock.as_raw_fd());
    }

    fn holder_id(&self) -> u64 {
        self.holder_id
    }
}

/// A running listener.
pub struct Server {
    listener: TcpListener,
    pub(crate) ctx: Arc<ServerCtx>,
    local: Mutex<Option<Arc<LocalListener>>>,
    pub(super) stopping: AtomicBool,
    pub(crate) served: Mutex<HashMap<u64, Arc<Served>>>,
    /// This server, for arming its retry timer from `&self` methods.
    pub(super) me: Weak<Server>,
    /// Whether the update-retry timer runs: only while some peer owes an update, so that an
    /// idle engine's timer thread does not wake for it.
    pub(super) retrying: AtomicBool,
    /// Streams whose handshake has not ended, oldest first, with their source address.
    pending: Mutex<VecDeque<(u64, IpAddr)>>,
    /// Streams whose handshake ended, counted against `hixl.max_streams(_per_source)`.
    streams: SourceCaps,
    auth_failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
    next: AtomicU64,
    pub(crate) live: Mutex<usize>,
    gone: Condvar,
    /// The listener's reactor token (0: not registered).
    accept_token: AtomicU64,
    pub(crate) acks: Condvar,
}

/// Listening engines of this process, by the name of their same-host socket.
static LISTENING: Mutex<Option<HashMap<String, Weak<Server>>>> = Mutex::new(None);

/// Makes a listening engine findable by engines of this process (see [`find`]).
pub(crate) fn announce(name: &str, server: &Arc<Server>) {
    LISTENING
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(name.to_string(), Arc::downgrade(server));
}

/// Forgets a listening engine (it stops).
pub(crate) fn withdraw(name: &str) {
    if let Some(m) = LISTENING.lock().unwrap().as_mut() {
        m.remove(name);
    }
}

/// The engine of this process listening under `name` that holds the other end of a stream
/// whose ends are `ours` and `theirs`; Err says why not.
pub(crate) fn find(name: &str, ours: &str, theirs: &str) -> std::result::Result<Arc<Server>, String> {
    let server = LISTENING
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|m| m.get(name))
        .and_then(Weak::upgrade)
        .ok_or("the peer is not an engine of this process")?;
    if !server.holds_stream(ours, theirs) {
        return Err("an engine of this process has that name but not this stream".into());
    }
    Ok(server)
}

impl Server {
    /// Starts serving `listener` on the engine's reactor (and the same-host proof socket on a
    /// thread of its own).
    pub fn start(listener: TcpListener, ctx: Arc<ServerCtx>) -> Result<Arc<Server>> {
        let srv = Arc::new_cyclic(|me| Server {
            me: me.clone(),
            retrying: AtomicBool::new(false),
            listener,
            local: Mutex::new(None),
            stopping: AtomicBool::new(false),
            served: Mutex::new(HashMap::new()),
            pending: Mutex::new(VecDeque::new()),
            streams: SourceCaps::new(
                Counted {
                    what: "established streams",
                    holder: "this listener",
                    total_key: "hixl.max_streams",
                    per_source_key: "hixl.max_streams_per_source",
                },
                // 0: a share of the descriptor limit (each stream holds one descriptor).
                Cap::from_option(ctx.max_streams, 2),
                Cap::from_option(ctx.max_streams_per_source, 4),
            ),
            ctx,
            auth_failures: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            live: Mutex::new(0),
            gone: Condvar::new(),
            accept_token: AtomicU64::new(0),
            acks: Condvar::new(),
        });
        let weak = Arc::downgrade(&srv);
        let local = LocalListener::start(Box::new(move |initiator: &str, target: &str| {
            weak.upgrade()?.confirm_local(initiator, target)
        }))?;
        announce(local.name(), &srv);
        *srv.local.lock().unwrap() = Some(local);
        srv.listener.set_nonblocking(true).map_err(|e| Error::failed(format!("listener: {e}")))?;
        let reactor = srv.ctx.reactor.clone();
        let acceptor = Arc::new(Acceptor(srv.clone()));
        let token = reactor.add(srv.listener.as_raw_fd(), acceptor, Interest::Read, reactor.next_shard())?;
        srv.accept_token.store(token, Ordering::Release);
        Ok(srv)
    }

    /// The same-host proof socket's name (sent in Welcome).
    pub(crate) fn local_socket(&self) -> String {
        self.local.lock().unwrap().as_ref().map(|l| l.name().to_string()).unwrap_or_default()
    }

    /// The same-host proof (the requester's descriptor was checked already): marks the link
    /// head with exactly these ends as proven (it must confirm region updates from now on) and
    /// returns the table version of that moment and this process's descriptor of the stream.
    fn confirm_local(&self, initiator: &str, target: &str) -> Option<(u64, std::os::fd::RawFd)> {
        let served = self.served.lock().unwrap();
        let s = served.values().find(|s| {
            s.peer_addr == initiator
                && s.local_addr == target
                && s.link_head.load(Ordering::Acquire)
                && !s.ended.load(Ordering::Acquire)
        })?;
        s.acks_updates.store(true, Ordering::SeqCst);
        // Read after the flag: any publish from here on waits for this stream.
        Some((self.ctx.registry.version(), s.sock.as_raw_fd()))
    }

    /// Whether one of this engine's served link heads has exactly these ends (seen from the
    /// initiator: `initiator` its end, `target` ours). Used in-process by the `self` backend.
    pub(crate) fn holds_stream(&self, initiator: &str, target: &str) -> bool {
        self.served.lock().unwrap().values().any(|s| {
            s.peer_addr == initiator
                && s.local_addr == target
                && s.link_head.load(Ordering::Acquire)
                && !s.ended.load(Ordering::Acquire)
        })
    }

    /// Whether handshakes from `ip` are slowed down for failing authentication.
    pub(crate) fn throttled(&self, ip: IpAddr) -> bool {
        let mut f = self.auth_failures.lock().unwrap();
        match f.get(&ip) {
            Some((since, _)) if since.elapsed() > AUTH_WINDOW => {
                f.remove(&ip);
                false
            }
            Some((_, n)) => *n >= AUTH_FAILURES_ALLOWED,
            None => false,
        }
    }

    /// Counts a failed authentication from `from` and logs it.
    pub(crate) fn auth_failed(&self, from: SocketAddr) {
        let mut f = self.auth_failures.lock().unwrap();
        if f.len() > 4096 {
            f.retain(|_, (since, _)| since.elapsed() <= AUTH_WINDOW);
        }
        let e = f.entry(from.ip()).or_insert((Instant::now(), 0));
        if e.0.elapsed() > AUTH_WINDOW {
            *e = (Instant::now(), 0);
        }
        e.1 += 1;
        if e.1 <= AUTH_FAILURES_ALLOWED {
            tracing::warn!(from = %from, failures = e.1, "a peer failed authentication");
        }
        if e.1 == AUTH_FAILURES_ALLOWED {
            tracing::warn!(
                from = %from.ip(),
                "{AUTH_FAILURES_ALLOWED} failed authentications: handshakes from this address now wait \
                 {} s for their challenge, for {} s after the last failure",
                AUTH_TARPIT.as_secs(),
                AUTH_WINDOW.as_secs()
            );
        }
    }

    /// Makes room for one more pending handshake from `ip`: over the per-source cap, that
    /// source's oldest is closed; over the total cap, the oldest of the source with the most
    /// pending (so that a flood from many addresses evicts its own, not a lone honest peer's).
    fn admit(&self, id: u64, ip: IpAddr) {
        let ip = source_key(ip);
        let mut p = self.pending.lock().unwrap();
        let from_ip = p.iter().filter(|(_, a)| *a == ip).count();
        let victim = if from_ip >= self.ctx.max_pending_per_source {
            p.iter().position(|(_, a)| *a == ip)
        } else if p.len() >= self.ctx.max_pending {
            let mut counts: HashMap<IpAddr, usize> = HashMap::new();
            for (_, a) in p.iter() {
                *counts.entry(*a).or_default() += 1;
            }
            let most = counts.values().copied().max().unwrap_or(0);
            p.iter().position(|(_, a)| counts[a] == most)
        } else {
            None
        };
        if let Some(i) = victim {
            let (old, _) = p.remove(i).unwrap();
            if let Some(s) = self.served.lock().unwrap().get(&old) {
                s.abort("too many pending handshakes");
            }
        }
        p.push_back((id, ip));
    }

    /// Counts a stream whose handshake succeeded as established, or says which cap refuses
    /// it (see `source_caps`).
    pub(crate) fn count_stream(&self, s: &Served, ip: IpAddr) -> std::result::Result<(), String> {
        let mut counted = s.counted.lock().unwrap();
        if s.finished.load(Ordering::Acquire) {
            return Err("the stream ended".into());
        }
        self.streams.admit(ip, 1)?;
        *counted = Some(ip);
        Ok(())
    }

    /// The stream's handshake ended (well or not): it no longer counts as pending.
    pub(crate) fn handshake_over(&self, id: u64) {
        self.pending.lock().unwrap().retain(|(i, _)| *i != id);
    }

    /// Takes every connection waiting on the listener (run by the reactor when it is readable).
    fn accept_ready(self: &Arc<Self>) -> Interest {
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return Interest::Gone;
            }
            let (sock, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Interest::Read,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: try again at the next connection.
                    tracing::warn!(error = %e, "accept failed");
                    return Interest::Read;
                }
            };
            if sock.set_nonblocking(false).is_err() {
                continue;
            }
            let Ok(local) = sock.local_addr() else { continue };
            let id = self.next.fetch_add(1, Ordering::Relaxed);
            let served = Arc::new(Served {
                holder_id: new_holder_id(),
                id,
                sock,
                rx: Mutex::new(ServedRx::new(FrameMac::default())),
                paused: AtomicBool::new(false),
                reader_token: AtomicU64::new(0),
                writer_token: AtomicU64::new(0),
                finished: AtomicBool::new(false),
                counted: Mutex::new(None),
                peer_addr: addr_text(from),
                local_addr: addr_text(local),
                sender: OnceLock::new(),
                send: Mutex::new(SendState::new()),
                welcomed: AtomicBool::new(false),
                acks_updates: AtomicBool::new(false),
                link_head: AtomicBool::new(false),
                acked: AtomicU64::new(0),
                ended: AtomicBool::new(false),
                due: AtomicU64::new(0),
                sent: AtomicU64::new(0),
                due_since: Mutex::new(None),
                update_bytes: AtomicU64::new(0),
                data_path: AtomicBool::new(false),
                accepted: Mutex::new(Vec::new()),
            });
            self.served.lock().unwrap().insert(id, served.clone());
            self.admit(id, from.ip());
            *self.live.lock().unwrap() += 1;
            let srv = self.clone();
            // The handshake only: the I/O workers take the stream after it (`start_serving`).
            let spawned = crate::place::spawn("hixl-handshake".into(), move || {
                if let Err(e) = serve(&srv, id, from, &served) {
                    tracing::info!(from = %from, error = %e, "served stream ended");
                    srv.end_stream(&served);
                }
            });
            if spawned.is_err() {
                self.handshake_over(id);
                self.served.lock().unwrap().remove(&id);
                *self.live.lock().unwrap() -= 1;
            }
        }
    }

    /// Hands a stream whose handshake ended to the I/O workers (`rx` opens its frames).
    pub(crate) fn start_serving(self: &Arc<Self>, s: &Arc<Served>, rx: FrameMac) -> std::io::Result<()> {
        nbio::prepare(&s.sock)?;
        *s.rx.lock().unwrap() = ServedRx::new(rx);
        let reactor = &self.ctx.reactor;
        let w = Arc::new(served_stream::Writer { srv: self.clone(), served: s.clone() });
        let r = Arc::new(served_stream::Reader { srv: self.clone(), served: s.clone() });
        let shard = reactor.next_shard();
        let wt = reactor
            .add_second(s.sock.as_raw_fd(), w, Interest::Idle, shard)
            .map_err(|e| std::io::Error::other(e.message))?;
        s.writer_token.store(wt, Ordering::Release);
        let rt = match reactor.add(s.sock.as_raw_fd(), r, Interest::Read, shard) {
            Ok(t) => t,
            Err(e) => {
                reactor.remove(wt);
                return Err(std::io::Error::other(e.message));
            }
        };
        s.reader_token.store(rt, Ordering::Release);
        // An update that became due during the handshake.
        reactor.schedule(wt);
        Ok(())
    }

    /// A served stream ended (the first call does the work): it leaves the reactor and the
    /// served set, and what it held (queued answers, pins) is let go.
    pub(crate) fn end_stream(&self, s: &Served) {
        if s.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        io::shutdown(s.sock.as_raw_fd());
        for t in [&s.reader_token, &s.writer_token] {
            let t = t.load(Ordering::Acquire);
            if t != 0 {
                self.ctx.reactor.remove(t);
            }
        }
        s.send.lock().unwrap().out.clear();
        // Backends' per-link state (queue pairs) goes with the link.
        drop(std::mem::take(&mut *s.accepted.lock().unwrap()));
        if let Ok(mut rx) = s.rx.try_lock() {
            rx.state = served_stream::RxState::Frames;
        }
        self.handshake_over(s.id);
        if let Some(ip) = s.counted.lock().unwrap().take() {
            self.streams.release(ip, 1);
        }
        self.served.lock().unwrap().remove(&s.id);
        // Flag first, then the lock: a publisher that saw the stream running is already
        // waiting and gets this wake-up.
        s.ended.store(true, Ordering::Release);
        *self.live.lock().unwrap() -= 1;
        self.gone.notify_all();
        self.acks.notify_all();
    }

    /// Whether `stop` has begun (served streams refuse new notifications from then on).
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Stops accepting, sends what the served streams owe (`STOP_DRAIN` at most), closes them
    /// and waits (bounded) for their threads.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let token = self.accept_token.swap(0, Ordering::AcqRel);
        if token != 0 {
            self.ctx.reactor.remove(token);
        }
        io::shutdown(self.listener.as_raw_fd());
        if let Some(l) = self.local.lock().unwrap().take() {
            withdraw(l.name());
            l.stop();
        }
        // Every answer owed (the Acks of notifications the application may hold) goes out
        // before any stream closes: an initiator reads them before it sees the streams end.
        let streams: Vec<Arc<Served>> = self.served.lock().unwrap().values().cloned().collect();
        served_stream::drain(self, &streams, Instant::now() + STOP_DRAIN);
        for s in self.served.lock().unwrap().values() {
            s.abort("engine finalized");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut live = self.live.lock().unwrap();
        while *live > 0 && Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            live = self.gone.wait_timeout(live, left).unwrap().0;
        }
    }
}

/// Most time `stop` spends sending the answers its served streams still owe.
const STOP_DRAIN: Duration = Duration::from_secs(1);

/// The listener, as the reactor runs it.
struct Acceptor(Arc<Server>);

impl Source for Acceptor {
    fn run(&self, _events: u32) -> Interest {
        self.0.accept_ready()
    }
}
