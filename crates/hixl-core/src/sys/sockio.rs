//! Socket calls: receives and sends into borrowed buffers, vectored `sendmsg`/`recvmsg`/`readv`
//! over raw iovecs (`unsafe fn`s: the iovecs' memory is the caller's to vouch for), socket
//! options, peer credentials and descriptor passing over Unix sockets.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use super::mem::RawIov;
use super::IOV_MAX;
use super::{cvt, cvt_size};

/// One `recv(2)` into `buf` with `flags`; the bytes received (0 at EOF).
#[inline]
pub(crate) fn recv(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `buf`, exclusively borrowed.
    cvt_size(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) })
}

/// One `send(2)` of `buf` with `flags`; the bytes sent.
#[inline]
pub(crate) fn send(fd: RawFd, buf: &[u8], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `buf`, borrowed for the call.
    cvt_size(unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) })
}

/// One `sendmsg(2)` of the bytes `iovs` describe, with `flags`; the bytes sent.
///
/// # Safety
/// Every iovec must describe memory readable for its length during the call.
#[inline]
pub(crate) unsafe fn sendmsg_iovs(fd: RawFd, iovs: &[libc::iovec], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_ptr().cast_mut();
    msg.msg_iovlen = iovs.len();
    // SAFETY: the header points at `iovs`, which the kernel only reads; their memory is
    // readable by the caller's contract.
    cvt_size(unsafe { libc::sendmsg(fd, &msg, flags) })
}

/// One `recvmsg(2)` into the memory `iovs` describe, with `flags`; the bytes received (0 at
/// EOF).
///
/// # Safety
/// Every iovec must describe memory writable for its length during the call, and not aliased
/// by any live Rust reference.
#[inline]
pub(crate) unsafe fn recvmsg_iovs(fd: RawFd, iovs: &[libc::iovec], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iovs.as_ptr().cast_mut();
    msg.msg_iovlen = iovs.len();
    // SAFETY: the kernel reads the iovec array (never writes it) and writes into the memory
    // it describes, which is writable by the caller's contract.
    cvt_size(unsafe { libc::recvmsg(fd, &mut msg, flags) })
}

/// Sets an integer socket option.
pub(crate) fn set_int_opt(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: `v` is a live c_int and the length matches it.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as _,
        )
    };
    cvt(r).map(drop)
}

/// Reads a socket option whose value is the plain-data type `T` (all-zero valid).
fn get_opt<T: Copy>(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    zero: T,
) -> io::Result<(T, libc::socklen_t)> {
    let mut v = zero;
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into the live `v`, and stores the length
    // it wrote in `len`.
    cvt(unsafe { libc::getsockopt(fd, level, opt, (&mut v as *mut T).cast(), &mut len) })?;
    Ok((v, len))
}

/// The credentials (SO_PEERCRED) the kernel recorded for the other end of a Unix socket.
pub(crate) fn peer_cred(fd: RawFd) -> io::Result<libc::ucred> {
    get_opt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, libc::ucred { pid: 0, uid: 0, gid: 0 }).map(|(c, _)| c)
}

/// A pidfd for the process behind a Unix socket, from socket option `opt` (SO_PEERPIDFD).
pub(crate) fn peer_pidfd(fd: RawFd, opt: libc::c_int) -> io::Result<OwnedFd> {
    let (pidfd, _) = get_opt(fd, libc::SOL_SOCKET, opt, -1 as libc::c_int)?;
    if pidfd < 0 {
        return Err(io::Error::other("no pidfd"));
    }
    // SAFETY: the kernel gave us a new descriptor, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd) })
}

/// The kernel's TCP_INFO of a TCP socket.
pub(crate) fn tcp_info(fd: RawFd) -> io::Result<libc::tcp_info> {
    // SAFETY: tcp_info is plain data; all-zero is valid.
    let zero: libc::tcp_info = unsafe { std::mem::zeroed() };
    get_opt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, zero).map(|(i, _)| i)
}

/// Bytes in a socket's send queue (TIOCOUTQ), or None.
#[inline]
pub(crate) fn queued_bytes(fd: RawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one c_int to the pointer, which is live.
    let r = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n as *mut libc::c_int) };
    (r == 0).then_some(n as usize)
}

/// Bytes received on a socket and not read yet (FIONREAD, SIOCINQ), or None.
#[inline]
pub(crate) fn unread_bytes(fd: RawFd) -> Option<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD (SIOCINQ) writes one c_int to the pointer, which is live.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) };
    (r == 0).then_some(n as usize)
}

/// shutdown(2) in both directions; on a closed descriptor it only fails.
pub(crate) fn shutdown(fd: RawFd) {
    // SAFETY: touches no memory.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// `connect` to AF_UNSPEC: disconnects a TCP socket (its send queue purged, a reset sent);
/// on a closed descriptor it only fails.
pub(crate) fn disconnect(fd: RawFd) {
    let unspec = libc::sockaddr { sa_family: libc::AF_UNSPEC as libc::sa_family_t, sa_data: [0; 14] };
    // SAFETY: connect reads `unspec` for the given length.
    unsafe { libc::connect(fd, &unspec, std::mem::size_of::<libc::sockaddr>() as libc::socklen_t) };
}

/// A new non-blocking, close-on-exec Unix stream socket.
pub(crate) fn unix_stream_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() with constant arguments returns a new descriptor or -1.
    super::owned(unsafe {
        libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0)
    })
}

/// Connects a Unix socket to the abstract name `name` (no leading NUL; cut to fit).
pub(crate) fn connect_abstract(fd: RawFd, name: &[u8]) -> io::Result<()> {
    let mut sa = libc::sockaddr_un { sun_family: libc::AF_UNIX as libc::sa_family_t, sun_path: [0; 108] };
    let n = name.len().min(sa.sun_path.len() - 1);
    for (i, b) in name[..n].iter().enumerate() {
        sa.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
    // SAFETY: `sa` is a valid sockaddr_un and `len` covers the family and the name.
    cvt(unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) }).map(drop)
}

/// Receives into `buf` one message of a Unix socket and at most one attached descriptor
/// (SCM_RIGHTS; any more are closed); the bytes received and the descriptor.
pub(crate) fn recv_with_fd(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // u64 storage keeps the control buffer aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: the msghdr points at live buffers of the stated sizes (`buf`, `cbuf`).
    let n = cvt_size(unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) })?;
    let mut got = None;
    // SAFETY: CMSG_FIRSTHDR/NXTHDR walk the control buffer the kernel filled, within
    // msg_controllen; an SCM_RIGHTS payload is an array of c_int descriptors now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let owned = OwnedFd::from_raw_fd(data.add(i).read_unaligned());
                    if got.is_none() {
                        got = Some(owned); // extra descriptors are closed as they drop
                    }
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, got))
}

/// Sends `bytes` over a Unix socket with descriptor `attach` attached (SCM_RIGHTS); the bytes
/// sent.
pub(crate) fn send_with_fd(fd: RawFd, bytes: &[u8], attach: RawFd) -> io::Result<usize> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let mut cbuf = [0u64; 4];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
    // SAFETY: the control buffer holds CMSG_SPACE(4) bytes (32 >= 24); we fill one cmsghdr with
    // one descriptor, then send the iovec, which points at `bytes` (only read).
    let n = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as usize;
        (libc::CMSG_DATA(c) as *mut libc::c_int).write_unaligned(attach);
        libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL)
    };
    cvt_size(n)
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
            super::mem::iov_skip(v, n);
            n = 0;
        }
    }
    while start < iovs.len() && iovs[start].iov_len == 0 {
        start += 1;
    }
    start
}

/// Receives exactly the bytes described by `iovs` (resuming partial reads); EOF is an error.
///
/// # Safety
/// Every iovec must describe writable memory that stays valid for the duration of the call.
pub unsafe fn recv_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut got = 0;
    // SAFETY: the caller's contract is this function's.
    unsafe { recv_all_counted(fd, iovs, &mut got) }
}

/// [`recv_all`], adding to `got` every byte received, so that after an error the caller knows
/// how many bytes of the stream were consumed (an EFAULT consumes none of the bytes it could
/// not place).
///
/// # Safety
/// As for [`recv_all`].
pub unsafe fn recv_all_counted(fd: RawFd, iovs: &mut [libc::iovec], got: &mut u64) -> io::Result<()> {
    let mut start = advance(iovs, 0, 0);
    while start < iovs.len() {
        let n = (iovs.len() - start).min(IOV_MAX);
        // SAFETY: the iovecs point at writable memory the caller guarantees (see above).
        let r = match unsafe { super::mem::readv(fd, &iovs[start..start + n]) } {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the stream"));
        }
        *got += r as u64;
        start = advance(iovs, start, r);
    }
    Ok(())
}

/// Sends every byte `iovs` describe (blocking, resuming partial sends); a closed peer is an
/// error, never SIGPIPE (MSG_NOSIGNAL).
///
/// # Safety
/// Every iovec must describe readable memory that stays valid for the duration of the call.
pub(crate) unsafe fn send_all(fd: RawFd, iovs: &mut [libc::iovec]) -> io::Result<()> {
    let mut start = advance(iovs, 0, 0);
    while start < iovs.len() {
        let n = (iovs.len() - start).min(IOV_MAX);
        // SAFETY: the iovecs point at readable memory the caller guarantees (see above).
        let r = match unsafe { sendmsg_iovs(fd, &iovs[start..start + n], libc::MSG_NOSIGNAL) } {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        start = advance(iovs, start, r);
    }
    Ok(())
}

/// Sends all of `buf` (blocking), as [`send_all`].
pub(crate) fn send_all_bytes(fd: RawFd, buf: &[u8]) -> io::Result<()> {
    let mut v = [super::mem::iov(buf.as_ptr() as u64, buf.len() as u64)];
    // SAFETY: the iovec covers `buf`, borrowed (and only read) for the call.
    unsafe { send_all(fd, &mut v) }
}

/// Reads and drops `n` bytes (blocking); EOF is an error.
pub(crate) fn discard(fd: RawFd, mut n: u64) -> io::Result<()> {
    let mut buf = [0u8; 64 << 10];
    while n > 0 {
        let k = (n as usize).min(buf.len());
        recv_exact(fd, &mut buf[..k])?;
        n -= k as u64;
    }
    Ok(())
}

/// Receives exactly `buf.len()` bytes (blocking); EOF is an error.
pub(crate) fn recv_exact(fd: RawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut v = [super::mem::iov(buf.as_mut_ptr() as u64, buf.len() as u64)];
    // SAFETY: the iovec covers `buf`, which is exclusively borrowed for the call.
    unsafe { recv_all(fd, &mut v) }
}

/// Runs `f` on `fd` viewed as a `TcpStream`, without taking it over (it stays open after).
pub(crate) fn with_tcp_stream<R>(
    fd: std::os::fd::BorrowedFd<'_>,
    f: impl FnOnce(&std::net::TcpStream) -> R,
) -> R {
    use std::os::fd::AsRawFd;
    // SAFETY: `fd` is open for at least the borrow; ManuallyDrop never closes it.
    let s = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd.as_raw_fd()) });
    f(&s)
}

/// One `sendmsg(2)` of the bytes `iovs` describe, with `flags`; the bytes sent.
#[inline]
pub(crate) fn send_iovs(fd: RawFd, iovs: &[RawIov], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: every RawIov names readable memory (the promise of `RawIov::new`).
    unsafe { sendmsg_iovs(fd, RawIov::as_iovecs(iovs), flags) }
}

/// One `recvmsg(2)` into the memory `iovs` describe, with `flags`; the bytes received (0 at
/// EOF).
#[inline]
pub(crate) fn recv_iovs(fd: RawFd, iovs: &[RawIov], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: every RawIov names writable memory (the promise of `RawIov::new`).
    unsafe { recvmsg_iovs(fd, RawIov::as_iovecs(iovs), flags) }
}
