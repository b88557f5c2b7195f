//! Thin blocking socket I/O: vectored sends and receives straight between a socket and memory,
//! and whole-frame reads. No protocol logic lives here.

use std::io;
use std::os::fd::RawFd;

use crate::wire::{self, Frame, Header, HEADER_LEN};

/// Most iovecs the kernel accepts in one call.
pub const IOV_MAX: usize = 1024;

/// An iovec for `len` bytes at `addr`.
pub fn iov(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize }
}

/// An iovec over a byte slice (only read from).
pub fn iov_of(b: &[u8]) -> libc::iovec {
    iov(b.as_ptr() as u64, b.len() as u64)
}

/// Drops `n` bytes from the front of an iovec list, returning the index of the first iovec that
/// still has bytes.
fn advance(iovs: &mut [libc::iovec], mut start: usize, mut n: usize) -> usize {
    while n > 0 {
        let v = &mut iovs[start];
        if n >= v.iov_len {
            n -= v.iov_len;
            start += 1;
        } else {
            // SAFETY: n < iov_len, so the new base still points into the same buffer.
            v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
            v.iov_len -= n;
            n = 0;
        }
    }
    while start < iovs.len() && iovs[start].iov_len == 0 {
        start += 1;
    }
    start
}

/// Sends every byte described by `iovs` (at most IOV_MAX per call, resuming partial sends),
/// with MSG_NOSIGNAL so a closed peer is an error, never SIGPIPE.
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the duration of the call.
pub unsafe fn send_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut start = advance(iovs, 0, 0);
    while start < iovs.len() {
        let n = (iovs.len() - start).min(IOV_MAX);
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovs[start..].as_mut_ptr();
        msg.msg_iovlen = n;
        // SAFETY: the iovecs point at memory the caller guarantees readable (see above).
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        start = advance(iovs, start, r as usize);
    }
    Ok(())
}

/// Receives exactly the bytes described by `iovs` (resuming partial reads); EOF is an error.
///
/// # Safety
/// Every iovec must describe writable memory that stays valid for the duration of the call.
pub unsafe fn recv_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut start = advance(iovs, 0, 0);
    while start < iovs.len() {
        let n = (iovs.len() - start).min(IOV_MAX) as libc::c_int;
        // SAFETY: the iovecs point at writable memory the caller guarantees (see above).
        let r = unsafe { libc::readv(fd, iovs[start..].as_ptr(), n) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        start = advance(iovs, start, r as usize);
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes.
pub fn recv_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut v = [iov(buf.as_mut_ptr() as u64, buf.len() as u64)];
    // SAFETY: the iovec covers `buf`, which is exclusively borrowed for the call.
    unsafe { recv_all(fd, &mut v) }
}

/// Sends a whole byte buffer.
pub fn send_bytes(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    let mut v = [iov_of(buf)];
    // SAFETY: the iovec covers `buf`, which is borrowed for the call.
    unsafe { send_all(fd, &mut v) }
}

/// Reads and throws away `n` bytes (the bulk of a refused frame), keeping the stream in sync.
pub fn discard(fd: RawFd, mut n: u64) -> io::Result<()> {
    let mut scratch = vec![0u8; 64 * 1024];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        recv_exact(fd, &mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Reads one frame's header and payload (not its bulk). `payload` is reused between calls.
pub fn recv_frame(fd: RawFd, payload: &mut Vec<u8>) -> io::Result<(Header, Frame)> {
    let mut hb = [0u8; HEADER_LEN];
    recv_exact(fd, &mut hb)?;
    let h = wire::decode_header(&hb).map_err(proto)?;
    payload.clear();
    payload.resize(h.payload_len as usize, 0);
    recv_exact(fd, payload)?;
    let f = wire::decode_payload(&h, payload).map_err(proto)?;
    Ok((h, f))
}

/// Wraps a wire error as an I/O error of kind InvalidData.
pub fn proto(e: wire::WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Bytes in a socket's send queue (not yet sent or not yet acknowledged), or None.
pub fn queued_bytes(fd: RawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one c_int to the pointer, which is live.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    (r == 0).then_some(n as usize)
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
        // SAFETY: `v` is a live c_int and the length matches it.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Shuts a socket down in both directions (wakes threads blocked on it).
pub fn shutdown(fd: RawFd) {
    // SAFETY: shutdown on a possibly closed fd only returns an error.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}
