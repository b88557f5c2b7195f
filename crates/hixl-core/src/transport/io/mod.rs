//! Thin blocking socket I/O: vectored sends and receives straight between a socket and memory,
//! and whole-frame reads. No protocol logic lives here.

pub(crate) mod nbio;
pub(crate) mod ranges;

use std::io;
use std::os::fd::RawFd;
use std::time::Instant;

use crate::auth::{FrameMac, MAC_LEN};
use crate::sys::{self, sockio};
use crate::wire::{self, Frame, Header, Kind, HEADER_LEN};

pub use crate::sys::IOV_MAX;

/// The payload buffer a frame's reader starts with; it doubles as the bytes arrive, up to what
/// the header declares, so a header whose payload never comes costs at most this.
pub const PAYLOAD_START: usize = 64 * 1024;

/// An iovec for `len` bytes at `addr`.
pub fn iov(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize }
}

pub use crate::sys::sockio::{recv_all, recv_all_counted};

/// Whether `[addr, addr+len)` lies entirely in mappings of this process. `msync(MS_ASYNC)`
/// only walks the mappings (it neither reads nor writes the pages) and fails with ENOMEM when
/// part of the range is not mapped. Protection is not checked: a PROT_NONE page is mapped.
pub fn is_mapped(addr: u64, len: u64) -> bool {
    sys::is_mapped(addr, len)
}

/// Receives exactly `buf.len()` bytes.
pub fn recv_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    sockio::recv_exact(fd, buf)
}

/// Waits until `fd` is readable (or writable, with `write`) or `deadline` passes (TimedOut).
pub fn wait_ready(fd: RawFd, write: bool, deadline: Instant) -> io::Result<()> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        let events = if write { libc::POLLOUT } else { libc::POLLIN };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        match sys::poll_one(fd, events, ms) {
            Ok(0) => {}
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Receives exactly `buf.len()` bytes before `deadline`: one deadline for the whole read, so a
/// peer that trickles bytes cannot stretch it (a per-read timeout would restart every byte).
pub fn recv_exact_by(fd: RawFd, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        wait_ready(fd, false, deadline)?;
        let r = match sockio::recv(fd, &mut buf[got..], libc::MSG_DONTWAIT) {
            Ok(r) => r,
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) => continue,
            Err(e) => return Err(e),
        };
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        got += r;
    }
    Ok(())
}

/// Sends all of `buf` before `deadline`; a peer that does not drain its socket in time is an
/// error (TimedOut), never a thread blocked for ever.
pub fn send_bytes_by(fd: RawFd, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut sent = send_some(fd, buf)?;
    while sent < buf.len() {
        wait_ready(fd, true, deadline)?;
        sent += send_some(fd, &buf[sent..])?;
    }
    Ok(())
}

/// One frame as received: its header, the decoded frame and its sequence number on the stream
/// (for a data MAC).
pub struct Received {
    /// The header.
    pub header: Header,
    /// The decoded payload.
    pub frame: Frame,
    /// Sequence number of the frame in its direction.
    pub seq: u64,
}

/// Reads one frame's header, payload and (on a sealed stream) MAC, and checks the MAC before
/// decoding; the bulk is left on the socket. `payload` is reused between calls. With
/// `handshake`, only the listed kinds are accepted (checked on the header, before the payload
/// is read) and the whole frame must arrive before the deadline.
pub fn recv_frame(
    fd: RawFd,
    payload: &mut Vec<u8>,
    mac: &mut FrameMac,
    handshake: Option<(Instant, &[Kind])>,
) -> io::Result<Received> {
    let read = |buf: &mut [u8]| match handshake {
        Some((deadline, _)) => recv_exact_by(fd, buf, deadline),
        None => recv_exact(fd, buf),
    };
    let mut hb = [0u8; HEADER_LEN];
    read(&mut hb)?;
    let h = wire::decode_header(&hb).map_err(proto)?;
    if let Some((_, allowed)) = handshake {
        if !allowed.contains(&h.kind) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected {:?} frame during the handshake (expected {allowed:?})", h.kind),
            ));
        }
    }
    // Grown as the bytes arrive, never sized from the header alone.
    payload.clear();
    let want = h.payload_len as usize;
    while payload.len() < want {
        let got = payload.len();
        payload.resize(want.min((got * 2).max(PAYLOAD_START)), 0);
        read(&mut payload[got..])?;
    }
    // A refusal during the handshake comes unsealed (the target has no keys it trusts yet).
    if handshake.is_some() && h.kind == Kind::Error {
        let frame = wire::decode_payload(&h, payload).map_err(proto)?;
        return Ok(Received { header: h, frame, seq: 0 });
    }
    let mut tag = [0u8; MAC_LEN];
    if mac.sealed() {
        read(&mut tag)?;
    }
    let seq = mac.open(&[&hb, payload], &tag).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let frame = wire::decode_payload(&h, payload).map_err(proto)?;
    Ok(Received { header: h, frame, seq })
}

/// Wraps a wire error as an I/O error of kind InvalidData.
pub fn proto(e: wire::WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Bytes in a socket's send queue (not yet sent or not yet acknowledged), or None.
pub fn queued_bytes(fd: RawFd) -> Option<usize> {
    sockio::queued_bytes(fd)
}

/// Bytes a socket received that nobody read yet, or None.
pub fn unread_bytes(fd: RawFd) -> Option<usize> {
    sockio::unread_bytes(fd)
}

/// Turns on TCP keepalive: after `idle_s` seconds without traffic the kernel probes every
/// `interval_s` seconds and reports the connection dead after `count` unanswered probes, so a
/// blocked read on a connection whose peer vanished without a FIN ends.
pub fn keepalive(fd: RawFd, idle_s: i32, interval_s: i32, count: i32) -> io::Result<()> {
    for (level, opt, v) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle_s),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval_s),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count),
    ] {
        sockio::set_int_opt(fd, level, opt, v)?;
    }
    Ok(())
}

/// Shuts a socket down in both directions (wakes threads blocked on it).
pub fn shutdown(fd: RawFd) {
    sockio::shutdown(fd);
}

/// Ends a TCP connection at once, like a close with SO_LINGER 0: whatever is still queued to
/// send is dropped and the peer gets a reset. A closed link's bytes must never land at the
/// peer later (after a cut link comes back, say, and a new link has written the same memory
/// since); a plain shutdown would still send them before its FIN. Threads blocked on the
/// socket wake with an error, as after [`shutdown`]; the descriptor stays open until dropped.
pub fn abort(fd: RawFd) {
    sockio::disconnect(fd);
    shutdown(fd);
}

/// Sends what the socket takes now of `buf` without blocking; returns how many bytes went.
pub fn send_some(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    let mut sent = 0;
    while sent < buf.len() {
        match sockio::send(fd, &buf[sent..], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) {
            Ok(r) => sent += r,
            Err(e) => match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => break,
                _ => return Err(e),
            },
        }
    }
    Ok(sent)
}

/// Canonical text of a socket address: IPv4-mapped IPv6 written as IPv4.
pub fn addr_text(a: std::net::SocketAddr) -> String {
    match a {
        std::net::SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => std::net::SocketAddr::new(std::net::IpAddr::V4(v4), v6.port()).to_string(),
            None => a.to_string(),
        },
        std::net::SocketAddr::V4(_) => a.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_handshake_frame_is_not_sized_from_its_header() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let h = Header { kind: Kind::Welcome, payload_len: wire::MAX_TABLE_PAYLOAD, tag: 0, bulk_len: 0 };
        send_some(b.as_raw_fd(), &wire::encode_header(&h)).unwrap();
        send_some(b.as_raw_fd(), &[0u8; 100]).unwrap();
        let mut payload = Vec::new();
        let deadline = Instant::now() + std::time::Duration::from_millis(200);
        let allowed = [Kind::Welcome];
        let e = recv_frame(a.as_raw_fd(), &mut payload, &mut FrameMac::default(), Some((deadline, &allowed)))
            .err()
            .expect("the payload never comes");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(payload.capacity() <= PAYLOAD_START, "{} set aside for 100 bytes", payload.capacity());
    }
}
