//! One served stream: the target's half of the handshake (under one deadline, accepting only
//! the frames a handshake may carry), then data frames until the stream ends. Every remote
//! range is checked against this engine's registry before a byte is read into it or written
//! from it; a refused frame is answered with PARAM_INVALID and its bulk is discarded, so the
//! stream stays usable.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::auth::{self, FrameMac, Secret, SessionKeys, Transcript, MAC_LEN};
use crate::error::{Error, Result, Status};
use crate::registry::{Abort, Pin, Registry};
use crate::transport::io::{self, iov};
use crate::transport::server::{Served, Server, ServerCtx, AUTH_TARPIT};
use crate::wire::{self, Frame, Header, Kind, Seg, StridedSeg, FLAG_DATA_MAC, FLAG_DATA_PATH};

type IoResult<T> = std::io::Result<T>;

fn protocol_error(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

/// Sends a frame (sealed when the stream is), holding the send lock, after any region update
/// the publisher left half sent.
fn send(served: &Served, f: &Frame, tag: u64) -> IoResult<()> {
    let mut tx = served.send.lock().unwrap();
    tx.finish_outbox(served)?;
    let mut b = wire::encode(f, tag, 0);
    tx.mac.seal(&mut b);
    io::send_bytes(served.sock.as_raw_fd(), &b)
}

/// Sends an Error frame during the handshake: bounded by its deadline, so a peer that does not
/// read cannot hold this thread.
fn refuse(served: &Served, status: Status, message: &str, deadline: Instant) -> std::io::Error {
    let f = Frame::Error { status: status.code(), message: message.to_string() };
    let _ = io::send_bytes_by(served.sock.as_raw_fd(), &wire::encode(&f, 0, 0), deadline);
    std::io::Error::other(message.to_string())
}

/// Serves one accepted stream until it ends.
pub(crate) fn serve(
    srv: &Server,
    id: u64,
    from: SocketAddr,
    sock: &TcpStream,
    served: &Arc<Served>,
) -> IoResult<()> {
    let ctx = &*srv.ctx;
    let fd = sock.as_raw_fd();
    sock.set_nodelay(true)?;
    // The target sends no heartbeats of its own; keepalive ends a serve thread whose
    // initiator vanished without closing (a cut link) in about 25 s instead of never.
    io::keepalive(fd, 10, 5, 3)?;
    let deadline = Instant::now() + ctx.handshake_timeout;
    let mut payload = Vec::new();
    let mut rx = FrameMac::default();
    let hello = match io::recv_frame(fd, &mut payload, &mut rx, Some((deadline, &[Kind::Hello]))) {
        Ok(r) => r.frame,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            let message = if e.to_string().contains("during the handshake") {
                format!("expected Hello: {e}")
            } else {
                e.to_string()
            };
            return Err(refuse(served, Status::ParamInvalid, &message, deadline));
        }
        Err(e) => return Err(e),
    };
    let Frame::Hello { engine_id: peer, link_nonce, stream_index, auth_nonce, flags, dialled, .. } = hello
    else {
        return Err(protocol_error("not a Hello".into()));
    };
    let keys = match &ctx.secret {
        Some(secret) => {
            let nt = auth::nonce().map_err(|e| std::io::Error::other(e.message))?;
            let t = Transcript {
                ni: &auth_nonce,
                nt: &nt,
                initiator: &peer,
                target: &ctx.engine_id,
                dialled: &served.local_addr,
                link_nonce,
                stream_index,
                flags,
            };
            if dialled != served.local_addr {
                let message = format!(
                    "this stream reached {} but the initiator dialled {dialled}: a relay or NAT sits \
                     between the engines, and authenticated links need a direct path",
                    served.local_addr
                );
                return Err(refuse(served, Status::NotConnected, &message, deadline));
            }
            Some(authenticate(srv, from, secret, served, &t, &mut payload, deadline)?)
        }
        None if flags & FLAG_DATA_MAC != 0 => {
            let message = "hixl.data_mac needs a cluster secret, and this target has none";
            return Err(refuse(served, Status::ParamInvalid, message, deadline));
        }
        None => None,
    };
    srv.handshake_over(id);
    let data = flags & FLAG_DATA_MAC != 0;
    let mut rx = FrameMac::new(keys.as_ref().map(|k| k.initiator_to_target), data);
    // A data-path stream gets no region table: its link's control channel has it.
    let data_path = flags & FLAG_DATA_PATH != 0;
    served.link_head.store(stream_index == 0 && !data_path, Ordering::SeqCst);
    served.data_path.store(data_path, Ordering::SeqCst);
    {
        // Welcome goes out under the send lock, after this stream became visible to
        // `publish_regions`: any later update is sent after the Welcome, never before it.
        let mut tx = served.send.lock().unwrap();
        tx.mac = FrameMac::new(keys.as_ref().map(|k| k.target_to_initiator), data);
        let (table_version, regions) = if data_path { (0, Vec::new()) } else { ctx.registry.table() };
        let socket = srv.local_socket();
        let welcome = Frame::Welcome {
            engine_id: ctx.engine_id.clone(),
            host: ctx.host.clone(),
            table_version,
            capabilities: ctx.backends.iter().filter_map(|b| b.capability(&socket)).collect(),
            regions,
        };
        let mut b = wire::encode(&welcome, 0, 0);
        tx.mac.seal(&mut b);
        io::send_bytes_by(fd, &b, deadline.max(Instant::now() + ctx.slow_peer_timeout))?;
        served.sent.store(table_version, Ordering::SeqCst);
        // Nothing older than the Welcome's table can be in use at the peer.
        served.acked.store(table_version, Ordering::SeqCst);
        served.welcomed.store(true, Ordering::SeqCst);
    }
    serve_frames(srv, id, served, &mut rx, &mut payload)
}

/// Proves this target knows the secret and checks that the initiator does too; nothing about
/// this engine is sent before that succeeds. Returns the stream's session keys.
fn authenticate(
    srv: &Server,
    from: SocketAddr,
    secret: &Secret,
    served: &Served,
    t: &Transcript<'_>,
    payload: &mut Vec<u8>,
    deadline: Instant,
) -> IoResult<SessionKeys> {
    let fd = served.sock.as_raw_fd();
    if srv.throttled(from.ip()) {
        // This source failed too often: its proofs come slowly (each handshake still within its
        // own deadline, and the pending-handshake caps bound how many wait at once).
        std::thread::sleep(AUTH_TARPIT.min(deadline.saturating_duration_since(Instant::now())));
    }
    let challenge =
        Frame::AuthChallenge { nonce: *t.nt, proof: secret.target_proof(t), engine_id: t.target.to_string() };
    io::send_bytes_by(fd, &wire::encode(&challenge, 0, 0), deadline)?;
    let answer =
        io::recv_frame(fd, payload, &mut FrameMac::default(), Some((deadline, &[Kind::AuthResponse])));
    let ok = match answer {
        Ok(io::Received { frame: Frame::AuthResponse { proof }, .. }) => secret.check_initiator(t, &proof),
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => false,
        Err(e) => return Err(e),
    };
    if !ok {
        srv.auth_failed(from);
        let message = "authentication failed: the initiator does not know this cluster's secret \
                       (hixl.secret / HIXL_SECRET)";
        return Err(refuse(served, Status::NotConnected, message, deadline));
    }
    Ok(secret.session_keys(t))
}

fn serve_frames(
    srv: &Server,
    id: u64,
    served: &Arc<Served>,
    rx: &mut FrameMac,
    payload: &mut Vec<u8>,
) -> IoResult<()> {
    let ctx = &*srv.ctx;
    let fd = served.sock.as_raw_fd();
    // What backends set up for this link's initiator (RDMA queue pairs): dropped with the link.
    let mut accepted = crate::transport::backend::Accepted::new();
    loop {
        if served.due.load(Ordering::SeqCst) > served.sent.load(Ordering::Acquire) {
            served.send.lock().unwrap().send_update_if_due(served, ctx)?;
        }
        let got = match io::recv_frame(fd, payload, rx, None) {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let err = Frame::Error { status: Status::ParamInvalid.code(), message: e.to_string() };
                let _ = send(served, &err, 0);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        let (h, seq) = (got.header, got.seq);
        match got.frame {
            Frame::Write { segs } => serve_write(ctx, served, &h, Ranges::List(&segs), rx, seq)?,
            Frame::Read { segs } => serve_read(ctx, served, &h, Ranges::List(&segs))?,
            Frame::WriteStrided { seg } => serve_write(ctx, served, &h, Ranges::Strided(seg), rx, seq)?,
            Frame::ReadStrided { seg } => serve_read(ctx, served, &h, Ranges::Strided(seg))?,
            Frame::Notify { name, msg } => {
                let ack = match ctx.notifies.push(id, name, msg) {
                    Ok(()) => Frame::Ack { status: 0, message: String::new() },
                    Err(e) => Frame::Ack { status: e.code(), message: e.message },
                };
                send(served, &ack, h.tag)?;
            }
            Frame::Heartbeat => send(served, &Frame::HeartbeatAck, h.tag)?,
            Frame::BackendOpen { backend, payload } => {
                let head = served.link_head.load(Ordering::Acquire);
                let ans = crate::transport::backend::answer_open(
                    &ctx.backends,
                    head,
                    &backend,
                    &payload,
                    &mut accepted,
                );
                send(served, &ans, h.tag)?
            }
            Frame::RegionsAck { version } => {
                served.acked.fetch_max(version, Ordering::AcqRel);
                let _g = srv.live.lock().unwrap();
                srv.acks.notify_all();
            }
            Frame::RegionsQuery if served.data_path.load(Ordering::Acquire) => {
                let message = "a data-path stream gets no region table: ask on the control channel";
                let err = Frame::Error { status: Status::ParamInvalid.code(), message: message.into() };
                send(served, &err, h.tag)?;
                return Err(std::io::Error::other(message));
            }
            Frame::RegionsQuery => {
                let (version, regions) = ctx.registry.table();
                send(served, &Frame::RegionsTable { version, regions }, h.tag)?
            }
            Frame::Bye => {
                send(served, &Frame::Ack { status: 0, message: String::new() }, h.tag)?;
                return Ok(());
            }
            other => {
                let message = format!("unexpected {:?} frame from an initiator", other.kind());
                let err = Frame::Error { status: Status::ParamInvalid.code(), message: message.clone() };
                send(served, &err, h.tag)?;
                return Err(std::io::Error::other(message));
            }
        }
    }
}

/// Checks every segment against the registry and pins the regions they fall in.
fn check_and_pin(reg: &Registry, segs: &[Seg], holder: &Arc<dyn Abort>, write: bool) -> Result<Vec<Pin>> {
    let mut pins: Vec<Pin> = Vec::new();
    for s in segs {
        if let Some(p) = pins.last() {
            if p.region().contains(s.addr, s.len) {
                continue;
            }
        }
        let region = reg.lookup_for(s.addr, s.len, "remote", write)?;
        if !pins.iter().any(|p| p.region().id == region.id) {
            pins.push(region.pin(holder)?);
        }
    }
    Ok(pins)
}

/// The target ranges of one data frame: a list of segments or one strided descriptor.
enum Ranges<'a> {
    List(&'a [Seg]),
    Strided(StridedSeg),
}

impl Ranges<'_> {
    /// Checks the ranges against the registry and pins their regions.
    fn pin(&self, reg: &Registry, served: &Arc<Served>, write: bool) -> Result<Vec<Pin>> {
        let holder: &Arc<dyn Abort> = &(served.clone() as Arc<dyn Abort>);
        match self {
            Ranges::List(segs) => check_and_pin(reg, segs, holder, write),
            Ranges::Strided(st) => {
                let span = st.span().ok_or_else(|| Error::param("strided range overflows"))?;
                let region = reg.lookup_for(st.addr, span, "remote strided", write)?;
                Ok(vec![region.pin(holder)?])
            }
        }
    }

    /// Calls `f` with iovecs over the ranges, at most IOV_MAX at a time.
    fn for_each_chunk(&self, mut f: impl FnMut(&mut [libc::iovec]) -> IoResult<()>) -> IoResult<()> {
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

    /// Feeds the bytes of the ranges to a data-MAC hasher.
    ///
    /// # Safety
    /// The ranges must lie in registered regions that stay pinned during the call.
    unsafe fn hash(&self, h: &mut blake3::Hasher) {
        let _ = self.for_each_chunk(|v| {
            for io in v.iter() {
                // SAFETY: the caller guarantees the range is pinned, registered memory.
                h.update(unsafe { std::slice::from_raw_parts(io.iov_base as *const u8, io.iov_len) });
            }
            Ok(())
        });
    }
}

fn serve_write(
    ctx: &ServerCtx,
    served: &Arc<Served>,
    h: &Header,
    ranges: Ranges<'_>,
    rx: &FrameMac,
    seq: u64,
) -> IoResult<()> {
    let fd = served.sock.as_raw_fd();
    let data_mac_len = if rx.data() { MAC_LEN as u64 } else { 0 };
    let ack = match ranges.pin(&ctx.registry, served, true) {
        Ok(pins) => {
            let mut got = 0u64;
            // SAFETY: every range was checked to lie inside a registered region, and those
            // regions are pinned (cannot be deregistered and freed) until `pins` drops.
            let placed = ranges.for_each_chunk(|v| unsafe { io::recv_all_counted(fd, v, &mut got) });
            if let Err(e) = placed {
                if e.raw_os_error() != Some(libc::EFAULT) {
                    return Err(e);
                }
                // Registered memory that was unmapped or protected since: fail this request,
                // skip the rest of its bytes, keep the stream.
                drop(pins);
                io::discard(fd, h.bulk_len.saturating_sub(got) + data_mac_len)?;
                let message = format!(
                    "the target cannot write its registered memory after byte {got} of this \
                     request (EFAULT: unmapped or write-protected since it was registered)"
                );
                return send(served, &Frame::Ack { status: Status::ParamInvalid.code(), message }, h.tag);
            }
            if let Some(mut hasher) = rx.data_hasher(seq) {
                let mut tag = [0u8; MAC_LEN];
                io::recv_exact(fd, &mut tag)?;
                // SAFETY: as above: checked and pinned.
                unsafe { ranges.hash(&mut hasher) };
                if !auth::constant_eq(&auth::data_mac(&hasher), &tag) {
                    let message = "the written bytes do not match their data MAC (altered on the way); \
                                   closing the stream";
                    let _ = send(
                        served,
                        &Frame::Ack { status: Status::Failed.code(), message: message.into() },
                        h.tag,
                    );
                    return Err(protocol_error(message.into()));
                }
            }
            drop(pins);
            Frame::Ack { status: 0, message: String::new() }
        }
        Err(e) => {
            io::discard(fd, h.bulk_len + data_mac_len)?;
            Frame::Ack { status: e.code(), message: e.message }
        }
    };
    send(served, &ack, h.tag)
}

fn serve_read(ctx: &ServerCtx, served: &Arc<Served>, h: &Header, ranges: Ranges<'_>) -> IoResult<()> {
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
            // Registered memory unmapped since: refuse before the reply promises its bytes. (A
            // page made PROT_NONE is still mapped; sending from it fails mid-reply and closes
            // the stream.)
            if let Some(p) = pins.iter().find(|p| !io::is_mapped(p.region().addr, p.region().len)) {
                let message = format!(
                    "the target's registered region 0x{:x}+{} is no longer mapped (unmapped since \
                     it was registered)",
                    p.region().addr,
                    p.region().len
                );
                drop(pins);
                let resp = Frame::ReadResp { status: Status::ParamInvalid.code(), message };
                return send(served, &resp, h.tag);
            }
            let fd = served.sock.as_raw_fd();
            let mut tx = served.send.lock().unwrap();
            tx.finish_outbox(served)?;
            let mac = &mut tx.mac;
            let mut head = wire::encode(&Frame::ReadResp { status: 0, message: String::new() }, h.tag, total);
            let seq = mac.seal(&mut head);
            io::send_bytes(fd, &head)?;
            // SAFETY: the ranges lie in registered regions pinned until `pins` drops.
            ranges.for_each_chunk(|v| unsafe { io::send_all(fd, v) })?;
            if let Some(mut hasher) = mac.data_hasher(seq) {
                // SAFETY: as above.
                unsafe { ranges.hash(&mut hasher) };
                io::send_bytes(fd, &auth::data_mac(&hasher))?;
            }
            drop(pins);
            Ok(())
        }
        Err(e) => send(served, &Frame::ReadResp { status: e.code(), message: e.message }, h.tag),
    }
}
