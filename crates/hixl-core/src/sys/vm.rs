//! Cross-memory attach: process_vm_readv(2) / process_vm_writev(2).

use std::io;

use super::cvt_size;
use super::mem::{iov, not_covered, PinnedMemory};
use super::IOV_MAX;
use crate::error::{Error, Result, Status};
use crate::op::{SegPair, TransferOp};

/// One process_vm_writev (`write`) or process_vm_readv call between `local` iovecs of this
/// process and `remote` iovecs of process `pid`; the bytes moved.
///
/// # Safety
/// Every local iovec must describe memory of this process valid for its length during the
/// call: readable for a write, writable (and not aliased by a live Rust reference) for a read.
/// Remote iovecs need no promise: the kernel checks them against `pid`'s mappings.
#[inline]
pub(crate) unsafe fn process_vm(
    pid: libc::pid_t,
    write: bool,
    local: &[libc::iovec],
    remote: &[libc::iovec],
) -> io::Result<usize> {
    let (nl, nr) = (local.len() as libc::c_ulong, remote.len() as libc::c_ulong);
    // SAFETY: the local iovecs are valid by the caller's contract; the kernel validates the
    // remote ones; both arrays are live for the call and only read.
    let r = unsafe {
        if write {
            libc::process_vm_writev(pid, local.as_ptr(), nl, remote.as_ptr(), nr, 0)
        } else {
            libc::process_vm_readv(pid, local.as_ptr(), nl, remote.as_ptr(), nr, 0)
        }
    };
    cvt_size(r)
}

/// Copies every segment with process_vm_writev (WRITE) or process_vm_readv (READ), at most
/// IOV_MAX segments per call, resuming after short counts. Every local range must lie in
/// `local` (the part's pins: checked here, FAILED and nothing copied otherwise); the kernel
/// checks the remote ranges against `pid`'s mappings.
pub(crate) fn cma(pid: i32, op: TransferOp, local: &dyn PinnedMemory, segs: &[SegPair]) -> Result<()> {
    if let Some(s) = segs.iter().find(|s| !local.covers(s.local, s.len)) {
        return Err(not_covered(s.local, s.len));
    }
    let (mut i, mut off) = (0usize, 0u64);
    let mut local = Vec::with_capacity(segs.len().min(IOV_MAX));
    let mut remote = Vec::with_capacity(segs.len().min(IOV_MAX));
    while i < segs.len() {
        local.clear();
        remote.clear();
        for (k, s) in segs[i..segs.len().min(i + IOV_MAX)].iter().enumerate() {
            let o = if k == 0 { off } else { 0 };
            local.push(iov(s.local + o, s.len - o));
            remote.push(iov(s.remote + o, s.len - o));
        }
        // SAFETY: every local iovec lies in `local` (checked above), which the borrow keeps
        // valid during the call; the kernel validates the remote ones.
        let r = match unsafe { process_vm(pid, op == TransferOp::Write, &local, &remote) } {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(cma_error(pid, e)),
        };
        if r == 0 {
            return Err(Error::failed(format!("cross-memory attach to pid {pid} made no progress")));
        }
        let mut left = r as u64;
        while left > 0 {
            let rest = segs[i].len - off;
            if left >= rest {
                left -= rest;
                i += 1;
                off = 0;
            } else {
                off += left;
                left = 0;
            }
        }
    }
    Ok(())
}

pub(crate) fn cma_error(pid: i32, e: std::io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EFAULT) => Error::param(format!("a range is not accessible in pid {pid} (EFAULT): {e}")),
        Some(libc::ESRCH) => Error::not_connected(format!("peer process {pid} is gone (ESRCH)")),
        Some(libc::EPERM) => Error::new(
            Status::Unsupported,
            format!(
                "not permitted to access pid {pid} (EPERM; did it exec a program of more privilege?): {e}"
            ),
        ),
        _ => Error::failed(format!("cross-memory attach to pid {pid} failed: {e}")),
    }
}
