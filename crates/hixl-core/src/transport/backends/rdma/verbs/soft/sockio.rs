//! Blocking socket I/O of the soft NIC (its requester and responder threads block, as a NIC's
//! engines wait on the wire): whole iovec lists sent with MSG_NOSIGNAL, bytes skipped.

use std::io;
use std::os::fd::RawFd;

use crate::transport::io::IOV_MAX;

/// An iovec over `b`.
pub(super) fn iov_of(b: &[u8]) -> libc::iovec {
    libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() }
}

/// Consumes `n` sent or received bytes from the front of `iovs[start..]`; returns the new start.
fn advance(iovs: &mut [libc::iovec], mut start: usize, mut n: usize) -> usize {
    while start < iovs.len() {
        let v = &mut iovs[start];
        if n < v.iov_len {
            // SAFETY: stays inside the iovec's own buffer (n < its length).
            v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) }.cast();
            v.iov_len -= n;
            return start;
        }
        n -= v.iov_len;
        start += 1;
    }
    start
}

/// Sends every byte `iovs` describe (resuming partial sends; a closed peer is an error, never
/// SIGPIPE).
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the call.
pub(super) unsafe fn send_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut start = advance(iovs, 0, 0);
    while start < iovs.len() {
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iovs[start..].as_mut_ptr();
        msg.msg_iovlen = (iovs.len() - start).min(IOV_MAX);
        // SAFETY: the iovecs point at memory the caller guarantees readable.
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

/// Sends all of `b`.
pub(super) fn send_bytes(fd: RawFd, b: &[u8]) -> io::Result<()> {
    let mut v = [iov_of(b)];
    // SAFETY: the iovec covers `b`, borrowed for the call.
    unsafe { send_all(fd, &mut v) }
}

/// Reads and drops `n` bytes.
pub(super) fn discard(fd: RawFd, mut n: u64) -> io::Result<()> {
    let mut buf = [0u8; 64 << 10];
    while n > 0 {
        let k = (n as usize).min(buf.len());
        crate::transport::io::recv_exact(fd, &mut buf[..k])?;
        n -= k as u64;
    }
    Ok(())
}
