//! The initiator's half of the handshake on one stream: connect, Hello, and (with a cluster
//! secret) the mutual proof bound to both engines and the dialled address, then Welcome, the
//! first sealed frame. One deadline covers all of it.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::auth::{self, FrameMac, Transcript};
use crate::error::{Error, Result, Status};
use crate::registry::RemoteTable;
use crate::transport::io;
use crate::transport::io::addr_text;
use std::sync::Arc;

use crate::auth::Secret;
use crate::transport::reactor::Reactor;
use crate::transport::PeerInfo;
use crate::wire::{self, Frame, Kind, FLAG_DATA_MAC, FLAG_DATA_PATH};

/// Opens one TCP connection, retrying while nobody listens yet (peers start in any order).
pub(crate) fn connect_one(addr: SocketAddr, deadline: Instant, peer: &str) -> Result<TcpStream> {
    let mut last: Option<std::io::Error> = None;
    let mut backoff = Duration::from_millis(2);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(format!(
                "connect to {peer}: no answer within the timeout (last error: {})",
                last.map_or("none".into(), |e| e.to_string())
            )));
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                last = Some(e);
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(50));
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => last = Some(e),
            Err(e) => return Err(Error::not_connected(format!("connect to {peer}: {e}"))),
        }
    }
}

fn io_error(peer: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e: std::io::Error| {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            Error::timeout(format!("handshake with {peer}: no answer within the timeout"))
        } else {
            Error::not_connected(format!("handshake with {peer}: {e}"))
        }
    }
}

/// What this side sent in Hello (the proofs are bound to it).
pub(crate) struct SentHello {
    ni: auth::Nonce,
    link_nonce: u64,
    stream_index: u16,
    flags: u32,
    dialled: String,
}

/// Sends Hello on a fresh stream; `data_path`: the stream carries a data path, not a control
/// channel (see `wire::FLAG_DATA_PATH`).
pub(crate) fn send_hello(
    s: &TcpStream,
    p: &ConnectParams,
    data_path: bool,
    link_nonce: u64,
    i: usize,
    deadline: Instant,
    peer: &str,
) -> Result<SentHello> {
    let map_io = io_error(peer);
    s.set_nodelay(true).map_err(&map_io)?;
    let dialled = addr_text(s.peer_addr().map_err(&map_io)?);
    let flags = if p.data_mac { FLAG_DATA_MAC } else { 0 } | if data_path { FLAG_DATA_PATH } else { 0 };
    let sent = SentHello { ni: auth::nonce()?, link_nonce, stream_index: i as u16, flags, dialled };
    let hello = Frame::Hello {
        engine_id: p.local_id.clone(),
        host: p.host.clone(),
        link_nonce,
        stream_index: sent.stream_index,
        stream_count: p.streams as u16,
        auth_nonce: sent.ni,
        flags,
        dialled: sent.dialled.clone(),
    };
    io::send_bytes_by(s.as_raw_fd(), &wire::encode(&hello, 0, 0), deadline).map_err(&map_io)?;
    Ok(sent)
}

/// Reads the Welcome that answers Hello (authenticating first when the target challenges, or
/// refusing a target that does not when this engine has a secret). Returns the peer's facts and
/// the stream's sending and receiving MACs.
pub(crate) fn recv_welcome(
    s: &TcpStream,
    peer: &str,
    p: &ConnectParams,
    hello: &SentHello,
    deadline: Instant,
) -> Result<(PeerInfo, FrameMac, FrameMac)> {
    let map_io = io_error(peer);
    let fd = s.as_raw_fd();
    let mut buf = Vec::new();
    let first = [Kind::AuthChallenge, Kind::Welcome, Kind::Error];
    let mut f = io::recv_frame(fd, &mut buf, &mut FrameMac::default(), Some((deadline, &first)))
        .map_err(&map_io)?
        .frame;
    let (mut tx, mut rx) = (FrameMac::default(), FrameMac::default());
    let mut target_id = None;
    if let Frame::AuthChallenge { nonce: nt, proof, engine_id } = &f {
        let Some(secret) = &p.secret else {
            return Err(Error::not_connected(format!(
                "{peer} requires a cluster secret: set hixl.secret (or HIXL_SECRET) to the cluster's secret"
            )));
        };
        let t = Transcript {
            ni: &hello.ni,
            nt,
            initiator: &p.local_id,
            target: engine_id,
            dialled: &hello.dialled,
            link_nonce: hello.link_nonce,
            stream_index: hello.stream_index,
            flags: hello.flags,
        };
        if !secret.check_target(&t, proof) {
            return Err(Error::not_connected(format!(
                "{peer} failed authentication: it does not know this cluster's secret, or a relay sits \
                 between us (its proof is not for {})",
                hello.dialled
            )));
        }
        let answer = Frame::AuthResponse { proof: secret.initiator_proof(&t) };
        io::send_bytes_by(fd, &wire::encode(&answer, 0, 0), deadline).map_err(&map_io)?;
        let keys = secret.session_keys(&t);
        let data = hello.flags & FLAG_DATA_MAC != 0;
        tx = FrameMac::new(Some(keys.initiator_to_target), data);
        rx = FrameMac::new(Some(keys.target_to_initiator), data);
        target_id = Some(engine_id.clone());
        f = io::recv_frame(fd, &mut buf, &mut rx, Some((deadline, &[Kind::Welcome, Kind::Error])))
            .map_err(&map_io)?
            .frame;
    } else if p.secret.is_some() && matches!(f, Frame::Welcome { .. }) {
        return Err(Error::not_connected(format!(
            "{peer} did not authenticate, but this engine has a cluster secret (hixl.secret): refusing it"
        )));
    }
    match f {
        Frame::Welcome { engine_id, host, table_version, capabilities, regions } => {
            if target_id.is_some_and(|t| t != engine_id) {
                return Err(Error::not_connected(format!(
                    "{peer} authenticated as one engine and welcomed us as {engine_id}"
                )));
            }
            let info =
                PeerInfo { engine_id, host, capabilities, table_version, regions: RemoteTable::new(regions) };
            Ok((info, tx, rx))
        }
        Frame::Error { status, message } => {
            Err(Error::new(Status::from_code(status), format!("{peer} refused the handshake: {message}")))
        }
        other => {
            Err(Error::not_connected(format!("handshake with {peer}: unexpected {:?} frame", other.kind())))
        }
    }
}

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
    /// The engine's I/O workers, which run the streams.
    pub reactor: Arc<Reactor>,
}
