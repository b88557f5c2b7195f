//! The target side: a listener that accepts streams and serves data frames from its own
//! threads. Every remote range is checked against this engine's registry before a byte is read
//! into it or written from it; a refused frame is answered with PARAM_INVALID and its bulk is
//! discarded, so the stream stays usable. No application code runs here.

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::{self, Secret};
use crate::error::{Error, Result, Status};
use crate::notify::NotifyStore;
use crate::registry::{Abort, Pin, Registry};
use crate::transport::io::{self, iov};
use crate::wire::{self, Frame, Header, Seg, StridedSeg};

/// What served streams need from the engine.
pub struct ServerCtx {
    /// This engine's id.
    pub engine_id: String,
    /// This process's id.
    pub pid: u32,
    /// The registry to check ranges against.
    pub registry: Arc<Registry>,
    /// Where incoming notifications go.
    pub notifies: Arc<NotifyStore>,
    /// Deadline for a new stream's Hello.
    pub handshake_timeout: Duration,
    /// This machine's identity (see `shm::host_id`).
    pub host: String,
    /// Address and token of the probe that same-host initiators read directly.
    pub probe_addr: u64,
    /// The token stored at `probe_addr`.
    pub probe_token: u64,
    /// The cluster secret every stream must prove it knows before Welcome, if any.
    pub secret: Option<Secret>,
}

struct Served {
    sock: TcpStream,
    /// Frames of the serve thread and region updates never interleave.
    send_lock: Mutex<()>,
    /// Set after Hello: the first stream of a link on this host (region updates need its ack).
    acks_updates: AtomicBool,
    /// First stream of its link (region updates go there).
    link_head: AtomicBool,
    /// Highest region-table version the peer confirmed.
    acked: AtomicU64,
    /// Set when the serve thread is done with this stream (it confirms nothing any more).
    ended: AtomicBool,
    /// Newest region-table version this stream's peer must be sent.
    due: AtomicU64,
    /// Newest version sent to it.
    sent: AtomicU64,
}

/// Sends the current region table if a newer version is due. The caller holds the send lock.
fn send_update_if_due(ctx: &ServerCtx, s: &Served) -> std::io::Result<()> {
    let due = s.due.load(Ordering::Acquire);
    if due <= s.sent.load(Ordering::Acquire) {
        return Ok(());
    }
    let frame = wire::encode(&Frame::RegionsUpdate { version: due, regions: ctx.registry.table() }, 0, 0);
    io::send_bytes(s.sock.as_raw_fd(), &frame)?;
    s.sent.fetch_max(due, Ordering::AcqRel);
    Ok(())
}

impl Abort for Served {
    fn abort(&self, _why: &str) {
        io::shutdown(self.sock.as_raw_fd());
    }
}

/// A running listener.
pub struct Server {
    listener: TcpListener,
    ctx: Arc<ServerCtx>,
    stopping: AtomicBool,
    served: Mutex<HashMap<u64, Arc<Served>>>,
    next: AtomicU64,
    live: Mutex<usize>,
    gone: Condvar,
    accept: Mutex<Option<JoinHandle<()>>>,
    version: AtomicU64,
    acks: Condvar,
}

impl Server {
    /// Starts serving `listener` on a background thread.
    pub fn start(listener: TcpListener, ctx: Arc<ServerCtx>) -> Result<Arc<Server>> {
        let srv = Arc::new(Server {
            listener,
            ctx,
            stopping: AtomicBool::new(false),
            served: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            live: Mutex::new(0),
            gone: Condvar::new(),
            accept: Mutex::new(None),
            version: AtomicU64::new(0),
            acks: Condvar::new(),
        });
        let s = srv.clone();
        let h = std::thread::Builder::new()
            .name("hixl-accept".into())
            .spawn(move || s.accept_loop())
            .map_err(|e| Error::failed(format!("cannot start the accept thread: {e}")))?;
        *srv.accept.lock().unwrap() = Some(h);
        Ok(srv)
    }

    fn accept_loop(self: Arc<Self>) {
        loop {
            match self.listener.accept() {
                Ok((sock, from)) => {
                    if self.stopping.load(Ordering::Acquire) {
                        break;
                    }
                    let id = self.next.fetch_add(1, Ordering::Relaxed);
                    let served = match sock.try_clone() {
                        Ok(c) => Arc::new(Served {
                            sock: c,
                            send_lock: Mutex::new(()),
                            acks_updates: AtomicBool::new(false),
                            link_head: AtomicBool::new(false),
                            acked: AtomicU64::new(0),
                            ended: AtomicBool::new(false),
                            due: AtomicU64::new(0),
                            sent: AtomicU64::new(0),
                        }),
                        Err(_) => continue,
                    };
                    self.served.lock().unwrap().insert(id, served.clone());
                    *self.live.lock().unwrap() += 1;
                    let srv = self.clone();
                    let spawned = std::thread::Builder::new().name("hixl-serve".into()).spawn(move || {
                        if let Err(e) = serve(&srv, &sock, &served) {
                            tracing::info!(from = %from, error = %e, "served stream ended");
                        }
                        srv.served.lock().unwrap().remove(&id);
                        // Flag first, then the lock: a publisher that saw the stream running
                        // is already waiting and gets this wake-up.
                        served.ended.store(true, Ordering::Release);
                        *srv.live.lock().unwrap() -= 1;
                        srv.gone.notify_all();
                        srv.acks.notify_all();
                    });
                    if spawned.is_err() {
                        self.served.lock().unwrap().remove(&id);
                        *self.live.lock().unwrap() -= 1;
                    }
                }
                Err(e) => {
                    if self.stopping.load(Ordering::Acquire) {
                        break;
                    }
                    tracing::warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// Sends the current region table to every connected initiator. With `wait`, also waits
    /// until every initiator on this host (which may access memory directly, without the
    /// target-side check) confirmed it; one that does not within `wait` is disconnected and
    /// the call fails, so the caller must not free the memory.
    pub fn publish_regions(&self, wait: Option<Duration>) -> Result<()> {
        let version = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        let heads: Vec<Arc<Served>> = self
            .served
            .lock()
            .unwrap()
            .values()
            .filter(|s| s.link_head.load(Ordering::Acquire))
            .cloned()
            .collect();
        for s in &heads {
            // Due first, then try to send: a serve thread busy with a frame sends it when that
            // frame is done (it checks after releasing the lock), so nobody blocks here.
            s.due.fetch_max(version, Ordering::SeqCst);
            if let Ok(_g) = s.send_lock.try_lock() {
                if send_update_if_due(&self.ctx, s).is_err() {
                    s.abort("cannot send a region update");
                }
            }
        }
        let Some(wait) = wait else { return Ok(()) };
        let deadline = Instant::now() + wait;
        let mut g = self.live.lock().unwrap();
        loop {
            let pending: Vec<_> = heads
                .iter()
                .filter(|s| {
                    s.acks_updates.load(Ordering::Acquire)
                        && s.acked.load(Ordering::Acquire) < version
                        && !s.ended.load(Ordering::Acquire)
                })
                .collect();
            let now = Instant::now();
            if pending.is_empty() {
                return Ok(());
            }
            if now >= deadline {
                for s in &pending {
                    s.abort("peer did not confirm a region update");
                }
                return Err(Error::failed(format!(
                    "{} same-host peer(s) did not confirm the region update within {wait:?}; they \
                     were disconnected, and the memory must stay allocated",
                    pending.len()
                )));
            }
            g = self.acks.wait_timeout(g, deadline - now).unwrap().0;
        }
    }

    /// Stops accepting, closes every served stream and waits (bounded) for their threads.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        io::shutdown(self.listener.as_raw_fd());
        if let Some(h) = self.accept.lock().unwrap().take() {
            let _ = h.join();
        }
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

fn send(served: &Served, f: &Frame, tag: u64) -> std::io::Result<()> {
    let _g = served.send_lock.lock().unwrap();
    io::send_bytes(served.sock.as_raw_fd(), &wire::encode(f, tag, 0))
}

/// Checks every segment against the registry and pins the regions they fall in.
fn check_and_pin(reg: &Registry, segs: &[Seg], holder: &Arc<Served>, write: bool) -> Result<Vec<Pin>> {
    let mut pins: Vec<Pin> = Vec::new();
    for s in segs {
        if let Some(p) = pins.last() {
            if p.region().contains(s.addr, s.len) {
                continue;
            }
        }
        let region = reg.lookup_for(s.addr, s.len, "remote", write)?;
        if !pins.iter().any(|p| p.region().id == region.id) {
            pins.push(region.pin(holder.clone())?);
        }
    }
    Ok(pins)
}

fn serve(srv: &Server, sock: &TcpStream, served: &Arc<Served>) -> std::io::Result<()> {
    let ctx = &*srv.ctx;
    let fd = sock.as_raw_fd();
    sock.set_nodelay(true)?;
    // The target sends no heartbeats of its own; keepalive ends a serve thread whose
    // initiator vanished without closing (a cut link) in about 25 s instead of never.
    io::keepalive(fd, 10, 5, 3)?;
    sock.set_read_timeout(Some(ctx.handshake_timeout))?;
    let mut payload = Vec::new();
    let (_, hello) = io::recv_frame(fd, &mut payload)?;
    let Frame::Hello { engine_id: peer, host, stream_index, auth_nonce, .. } = hello else {
        let err = Frame::Error { status: Status::ParamInvalid.code(), message: "expected Hello".into() };
        send(served, &err, 0)?;
        return Err(std::io::Error::other(format!("first frame was {:?}, not Hello", hello.kind())));
    };
    if let Some(secret) = &ctx.secret {
        authenticate(secret, served, &auth_nonce, &mut payload)?;
    }
    served.link_head.store(stream_index == 0, Ordering::Release);
    served.acks_updates.store(stream_index == 0 && host == ctx.host, Ordering::Release);
    {
        // The table is read and sent under the send lock, after this stream became visible to
        // `publish_regions`: any later update is sent after the Welcome, never before it.
        let _g = served.send_lock.lock().unwrap();
        let welcome = Frame::Welcome {
            engine_id: ctx.engine_id.clone(),
            host: ctx.host.clone(),
            pid: ctx.pid,
            probe_addr: ctx.probe_addr,
            probe_token: ctx.probe_token,
            regions: ctx.registry.table(),
        };
        io::send_bytes(fd, &wire::encode(&welcome, 0, 0))?;
    }
    sock.set_read_timeout(None)?;
    loop {
        if served.due.load(Ordering::SeqCst) > served.sent.load(Ordering::Acquire) {
            let _g = served.send_lock.lock().unwrap();
            send_update_if_due(ctx, served)?;
        }
        let (h, f) = match io::recv_frame(fd, &mut payload) {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let err = Frame::Error { status: Status::ParamInvalid.code(), message: e.to_string() };
                let _ = send(served, &err, 0);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        match f {
            Frame::Write { segs } => serve_write(ctx, sock, served, &h, Ranges::List(&segs))?,
            Frame::Read { segs } => serve_read(ctx, sock, served, &h, Ranges::List(&segs))?,
            Frame::WriteStrided { seg } => serve_write(ctx, sock, served, &h, Ranges::Strided(seg))?,
            Frame::ReadStrided { seg } => serve_read(ctx, sock, served, &h, Ranges::Strided(seg))?,
            Frame::Notify { name, msg } => {
                let ack = match ctx.notifies.push(&peer, name, msg) {
                    Ok(()) => Frame::Ack { status: 0, message: String::new() },
                    Err(e) => Frame::Ack { status: e.code(), message: e.message },
                };
                send(served, &ack, h.tag)?;
            }
            Frame::Heartbeat => send(served, &Frame::HeartbeatAck, h.tag)?,
            Frame::RegionsAck { version } => {
                served.acked.fetch_max(version, Ordering::AcqRel);
                let _g = srv.live.lock().unwrap();
                srv.acks.notify_all();
            }
            Frame::RegionsQuery => {
                send(served, &Frame::RegionsTable { regions: ctx.registry.table() }, h.tag)?
            }
            Frame::Bye => {
                send(served, &Frame::Ack { status: 0, message: String::new() }, h.tag)?;
                return Ok(());
            }
            other => {
                let message = format!("unexpected {:?} frame from an initiator", other.kind());
                send(
                    served,
                    &Frame::Error { status: Status::ParamInvalid.code(), message: message.clone() },
                    h.tag,
                )?;
                return Err(std::io::Error::other(message));
            }
        }
    }
}

/// Proves this target knows the secret and checks that the initiator does too; nothing about
/// this engine is sent before that succeeds.
fn authenticate(
    secret: &Secret,
    served: &Served,
    ni: &auth::Nonce,
    payload: &mut Vec<u8>,
) -> std::io::Result<()> {
    let nt = auth::nonce().map_err(|e| std::io::Error::other(e.message))?;
    send(served, &Frame::AuthChallenge { nonce: nt, proof: secret.target_proof(ni, &nt) }, 0)?;
    let fd = served.sock.as_raw_fd();
    let ok = match io::recv_frame(fd, payload)? {
        (_, Frame::AuthResponse { proof }) => secret.check_initiator(ni, &nt, &proof),
        _ => false,
    };
    if !ok {
        let message = "authentication failed: the initiator does not know this cluster's secret \
                       (hixl.secret / HIXL_SECRET)";
        let _ =
            send(served, &Frame::Error { status: Status::NotConnected.code(), message: message.into() }, 0);
        return Err(std::io::Error::other("an initiator failed authentication"));
    }
    Ok(())
}

/// The target ranges of one data frame: a list of segments or one strided descriptor.
enum Ranges<'a> {
    List(&'a [Seg]),
    Strided(StridedSeg),
}

impl Ranges<'_> {
    /// Checks the ranges against the registry and pins their regions.
    fn pin(&self, reg: &Registry, holder: &Arc<Served>, write: bool) -> Result<Vec<Pin>> {
        match self {
            Ranges::List(segs) => check_and_pin(reg, segs, holder, write),
            Ranges::Strided(st) => {
                let span = st.span().ok_or_else(|| Error::param("strided range overflows"))?;
                let region = reg.lookup_for(st.addr, span, "remote strided", write)?;
                Ok(vec![region.pin(holder.clone())?])
            }
        }
    }

    /// Calls `f` with iovecs over the ranges, at most IOV_MAX at a time.
    fn for_each_chunk(
        &self,
        mut f: impl FnMut(&mut [libc::iovec]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut buf: Vec<libc::iovec> = Vec::new();
        match self {
            Ranges::List(segs) => {
                for c in segs.chunks(io::IOV_MAX) {
                    buf.clear();
                    buf.extend(c.iter().map(|s| iov(s.addr, s.len)));
                    f(&mut buf)?;
                }
            }
            Ranges::Strided(st) => {
                let mut i = 0;
                while i < st.count {
                    let n = (st.count - i).min(io::IOV_MAX as u64);
                    buf.clear();
                    buf.extend((i..i + n).map(|k| iov(st.addr + k * st.stride, st.size)));
                    f(&mut buf)?;
                    i += n;
                }
            }
        }
        Ok(())
    }
}

fn serve_write(
    ctx: &ServerCtx,
    sock: &TcpStream,
    served: &Arc<Served>,
    h: &Header,
    ranges: Ranges<'_>,
) -> std::io::Result<()> {
    let fd = sock.as_raw_fd();
    let ack = match ranges.pin(&ctx.registry, served, true) {
        Ok(pins) => {
            // SAFETY: every range was checked to lie inside a registered region, and those
            // regions are pinned (cannot be deregistered and freed) until `pins` drops.
            ranges.for_each_chunk(|v| unsafe { io::recv_all(fd, v) })?;
            drop(pins);
            Frame::Ack { status: 0, message: String::new() }
        }
        Err(e) => {
            io::discard(fd, h.bulk_len)?;
            Frame::Ack { status: e.code(), message: e.message }
        }
    };
    send(served, &ack, h.tag)
}

fn serve_read(
    ctx: &ServerCtx,
    sock: &TcpStream,
    served: &Arc<Served>,
    h: &Header,
    ranges: Ranges<'_>,
) -> std::io::Result<()> {
    let total = match &ranges {
        Ranges::List(segs) => wire::total_len(segs).ok(),
        Ranges::Strided(st) => st.bytes(),
    };
    let Some(total) = total else {
        let resp = Frame::ReadResp { status: Status::ParamInvalid.code(), message: "ranges overflow".into() };
        return send(served, &resp, h.tag);
    };
    match ranges.pin(&ctx.registry, served, false) {
        Ok(pins) => {
            let head = wire::encode(&Frame::ReadResp { status: 0, message: String::new() }, h.tag, total);
            let fd = sock.as_raw_fd();
            let _g = served.send_lock.lock().unwrap();
            io::send_bytes(fd, &head)?;
            // SAFETY: the ranges lie in registered regions pinned until `pins` drops.
            ranges.for_each_chunk(|v| unsafe { io::send_all(fd, v) })?;
            drop(pins);
            Ok(())
        }
        Err(e) => send(served, &Frame::ReadResp { status: e.code(), message: e.message }, h.tag),
    }
}
