//! One served stream's handshake: the target's half (under one deadline, accepting only the
//! frames a handshake may carry), on a thread of its own; then the stream goes to the
//! engine's I/O workers (see `served_stream`).

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::auth::{self, FrameMac, Secret, SessionKeys, Transcript};
use crate::error::Status;
use crate::transport::io;
use crate::transport::target_side::{Served, Server, AUTH_TARPIT};
use crate::wire::{self, Frame, Kind, FLAG_DATA_MAC, FLAG_DATA_PATH};

type IoResult<T> = std::io::Result<T>;

fn protocol_error(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

/// Sends an Error frame during the handshake: bounded by its deadline, so a peer that does not
/// read cannot hold this thread.
fn refuse(served: &Served, status: Status, message: &str, deadline: Instant) -> std::io::Error {
    let f = Frame::Error { status: status.code(), message: message.to_string() };
    let _ = io::send_bytes_by(served.sock.as_raw_fd(), &wire::encode(&f, 0, 0), deadline);
    std::io::Error::other(message.to_string())
}

/// Serves one accepted stream until it ends.
pub(crate) fn serve(srv: &Arc<Server>, id: u64, from: SocketAddr, served: &Arc<Served>) -> IoResult<()> {
    let ctx = &*srv.ctx;
    let sock = &served.sock;
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
    let local = sock.local_addr().map(|a| a.ip()).unwrap_or(from.ip());
    match crate::transport::target_side::sender::sender_id(&peer, from.ip(), local) {
        Ok(id) => {
            let _ = served.sender.set(id);
        }
        Err(why) => {
            tracing::info!(from = %from, claim = %peer, reason = %why, "engine id not verified: its notifications name ?claim");
            let _ = served.sender.set(format!("?{peer}"));
        }
    }
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
    if let Err(message) = srv.count_stream(served, from.ip()) {
        return Err(refuse(served, Status::ResourceExhausted, &message, deadline));
    }
    srv.handshake_over(id);
    let data = flags & FLAG_DATA_MAC != 0;
    let rx = FrameMac::new(keys.as_ref().map(|k| k.initiator_to_target), data);
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
    let _ = id;
    srv.start_serving(served, rx)
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
