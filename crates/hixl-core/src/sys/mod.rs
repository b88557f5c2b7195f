//! The system-call layer: every raw `libc` call of the transports goes through a small
//! wrapper here, so that the crate's `unsafe` blocks that are not FFI sit in one place, each
//! with its `SAFETY` argument. The FFI modules `cuda/driver` and `transport/backends/rdma/verbs`
//! call their C libraries directly; the soft RDMA provider in the latter, which emulates
//! libibverbs, takes its sockets, eventfds, polls and mappings from here.
//!
//! # Design
//!
//! - Most calls are memory-safe whatever their arguments once the wrapper owns the pointers
//!   it passes: CPU affinity ([`affinity`]), epoll ([`epoll`]), eventfds ([`eventfd`]), socket options, peer credentials
//!   and descriptor passing ([`sockio`]), pidfds ([`pidfd`]), memfd creation, sealing and
//!   mapping ([`memfd`], whose [`memfd::Mapping`] unmaps itself on drop), and the small calls
//!   below. Those wrappers are safe functions. A raw descriptor number (`RawFd`) is not a
//!   memory-safety matter: a call on a closed or foreign descriptor fails or acts on that
//!   descriptor, it never touches this process's memory.
//! - Calls that move bytes to or from raw addresses (vectored `sendmsg`/`recvmsg`/`readv`,
//!   `process_vm_*`, raw copies) can only be as safe as the addresses. Those wrappers are
//!   `unsafe fn`s with a `# Safety` section ([`sockio::sendmsg_iovs`], [`vm::process_vm`],
//!   `mem::copy`, ...), and the transports reach them through types that carry the proof:
//!   a type that checked its ranges and holds what keeps them valid implements the unsafe
//!   trait [`mem::PinnedRanges`] (a served frame's `PinnedFrame`, checked against the registry
//!   and pinned in transport/io/ranges.rs), and an `IoJob` (transport/io/nbio.rs) takes such a
//!   value and keeps it, so neither needs an `unsafe` block. The initiator's side proves
//!   itself the same way: a part's local ranges, checked against the request's pins that the
//!   part keeps (`queue::PinSet`, an unsafe impl of [`mem::PinnedMemory`]), are a
//!   [`mem::KeptRanges`] value that `IoJob::push_kept` takes, and the same-host copies
//!   ([`vm::cma`], [`mem::copy_covered`]) check every range against a `PinnedMemory` value
//!   they borrow. An `IoJob`'s iovecs are made in one place, [`iovs`], from the values it
//!   keeps (only tests push raw addresses). From then on its `send`/`recv` (the hot path)
//!   are safe calls.
//! - Hot-path wrappers are `#[inline]` and allocate nothing: they are the call they wrap plus
//!   the `errno` translation the call sites had.

pub(crate) mod affinity;
pub(crate) mod epoll;
pub(crate) mod eventfd;
pub(crate) mod iovs;
pub(crate) mod mem;
pub(crate) mod memfd;
pub(crate) mod pidfd;
pub(crate) mod sockio;
pub(crate) mod vm;

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// `Ok(r)` for a non-negative return, else the `errno` error.
#[inline]
pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Most iovecs the kernel accepts in one call.
pub const IOV_MAX: usize = 1024;

/// `Ok(n)` for a non-negative byte count, else the `errno` error.
#[inline]
pub(crate) fn cvt_size(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Takes ownership of a descriptor a system call just returned (or its error).
#[inline]
fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    let fd = cvt(fd)?;
    // SAFETY: a non-negative return of a call that creates a descriptor is a fresh descriptor
    // nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Polls one descriptor for `events` for at most `ms` milliseconds (-1: no limit); the
/// number of ready descriptors (0 or 1), or the error (EINTR included).
#[inline]
pub(crate) fn poll_one(fd: RawFd, events: libc::c_short, ms: libc::c_int) -> io::Result<usize> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid, live pollfd.
    cvt(unsafe { libc::poll(&mut p, 1, ms) }).map(|n| n as usize)
}

/// The real and effective user ids of this process.
pub(crate) fn uids() -> (u32, u32) {
    // SAFETY: getuid and geteuid have no preconditions and cannot fail.
    unsafe { (libc::getuid(), libc::geteuid()) }
}

/// The soft limit on open descriptors (RLIMIT_NOFILE), or None.
pub(crate) fn nofile_limit() -> Option<u64> {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the live `l`.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } == 0).then_some(l.rlim_cur)
}

/// This machine's node (host) name, or an empty string.
pub(crate) fn nodename() -> String {
    // SAFETY: utsname is plain data; all-zero is a valid value.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uts` is a valid, writable utsname.
    if unsafe { libc::uname(&mut uts) } != 0 {
        return String::new();
    }
    // SAFETY: the kernel NUL-terminates nodename, which lives in `uts`.
    unsafe { std::ffi::CStr::from_ptr(uts.nodename.as_ptr()) }.to_string_lossy().into_owned()
}

/// Fills `buf` from getrandom(2); the number of bytes written by this one call.
pub(crate) fn getrandom(buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `buf`, exclusively borrowed.
    cvt_size(unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) })
}

/// Whether `[addr, addr+len)` lies entirely in mappings of this process. `msync(MS_ASYNC)`
/// only walks the mappings (it neither reads nor writes the pages) and fails with ENOMEM when
/// part of the range is not mapped. Protection is not checked: a PROT_NONE page is mapped.
pub(crate) fn is_mapped(addr: u64, len: u64) -> bool {
    const PAGE: u64 = 4096;
    let start = addr & !(PAGE - 1);
    let Some(end) = addr.checked_add(len) else { return false };
    // SAFETY: MS_ASYNC neither reads nor writes memory; the call only checks the mappings
    // covering the page-aligned range.
    let rc = unsafe { libc::msync(start as *mut libc::c_void, (end - start) as usize, libc::MS_ASYNC) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ENOMEM)
}

/// Registers `f` to run in the child after every fork(2) of this process.
pub(crate) fn at_fork_child(f: extern "C" fn()) {
    // SAFETY: registers a plain function pointer; it runs in the forked child, where the
    // handler must only do async-signal-safe work (the handler's own contract).
    unsafe { libc::pthread_atfork(None, None, Some(f)) };
}

/// Polls every descriptor of `fds` for at most `ms` milliseconds; how many are ready, or the
/// error (EINTR included).
#[inline]
pub(crate) fn poll(fds: &mut [libc::pollfd], ms: libc::c_int) -> io::Result<usize> {
    // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfds.
    cvt(unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) }).map(|n| n as usize)
}
