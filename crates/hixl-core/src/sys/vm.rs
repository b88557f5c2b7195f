//! Cross-memory attach: process_vm_readv(2) / process_vm_writev(2).

use std::io;

use super::cvt_size;
use super::mem::{iov, not_covered, PinnedMemory};
use super::IOV_MAX;
use crate::error::{Error, Result, Status};
use crate::op::{SegPair, TransferOp};

/// Segments of a `cma` call described on the stack rather than in allocated vectors.
const SMALL_IOVS: usize = 8;

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
    // A chunk of up to SMALL_IOVS segments (a small request's one) is described on the stack,
    // larger ones in two vectors allocated once.
    let (mut l_small, mut r_small) = ([iov(0, 0); SMALL_IOVS], [iov(0, 0); SMALL_IOVS]);
    let (mut l_vec, mut r_vec) = (Vec::new(), Vec::new());
    while i < segs.len() {
        let chunk = &segs[i..segs.len().min(i + IOV_MAX)];
        let (local, remote): (&mut [libc::iovec], &mut [libc::iovec]) = if chunk.len() <= SMALL_IOVS {
            (&mut l_small[..chunk.len()], &mut r_small[..chunk.len()])
        } else {
            l_vec.resize(chunk.len(), iov(0, 0));
            r_vec.resize(chunk.len(), iov(0, 0));
            (&mut l_vec[..chunk.len()], &mut r_vec[..chunk.len()])
        };
        for (k, s) in chunk.iter().enumerate() {
            let o = if k == 0 { off } else { 0 };
            local[k] = iov(s.local + o, s.len - o);
            remote[k] = iov(s.remote + o, s.len - o);
        }
        // SAFETY: every local iovec lies in `local` (checked above), which the borrow keeps
        // valid during the call; the kernel validates the remote ones.
        let r = match unsafe { process_vm(pid, op == TransferOp::Write, local, remote) } {
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

/// Baseline for same-host copies: raw `process_vm_writev` (or `_readv` when `write` is false)
/// of `descs` (local, remote, len) to process `pid`, IOV_MAX descriptors per call, with the
/// iovec arrays built before timing. Returns each round's seconds after one warm-up round.
///
/// # Safety
///
/// Every local range of `descs` must be memory of this process that may be written (for a
/// READ, `write == false`) or read for the whole call; the kernel checks the remote ranges.
#[cfg(feature = "baselines")]
pub unsafe fn raw_cma(pid: u32, write: bool, descs: &[(u64, u64, u64)], iters: usize) -> Result<Vec<f64>> {
    let local: Vec<_> = descs.iter().map(|d| iov(d.0, d.2)).collect();
    let remote: Vec<_> = descs.iter().map(|d| iov(d.1, d.2)).collect();
    let total: u64 = descs.iter().map(|d| d.2).sum();
    let mut out = Vec::with_capacity(iters);
    for i in 0..=iters {
        let t0 = std::time::Instant::now();
        let mut moved = 0u64;
        for (l, r) in local.chunks(IOV_MAX).zip(remote.chunks(IOV_MAX)) {
            // SAFETY: the local ranges are live memory of this process (this function's
            // contract); the kernel checks the remote ranges.
            let got = unsafe { process_vm(pid as libc::pid_t, write, l, r) }
                .map_err(|e| Error::failed(format!("raw CMA: {e}")))?;
            moved += got as u64;
        }
        if moved != total {
            return Err(Error::failed(format!("raw CMA moved {moved} of {total} bytes")));
        }
        if i > 0 {
            out.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

/// The error of a failed CMA call to `pid`, by its errno.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A vector's bytes as pinned memory (the test keeps the vector alive and unmoved).
    struct Kept(u64, u64);

    // SAFETY: each test keeps the vector that `Kept` describes alive, unmoved and unborrowed
    // while `cma` runs.
    unsafe impl PinnedMemory for Kept {
        fn covers(&self, addr: u64, len: u64) -> bool {
            addr >= self.0 && addr.checked_add(len).is_some_and(|e| e <= self.0 + self.1)
        }
    }

    /// Segment counts on both sides of the stack iovecs and of IOV_MAX, where one call's chunk
    /// goes on the heap and the next on the stack (1030 = 1024 + 6): every byte lands.
    #[test]
    fn cma_copies_every_segment_whether_its_iovecs_are_on_the_stack_or_not() {
        for n in [1, SMALL_IOVS, SMALL_IOVS + 1, IOV_MAX + 6, IOV_MAX * 2 + 1] {
            let blk = 16u64;
            let src: Vec<u8> = (0..n as u64 * blk).map(|i| (i * 7 + n as u64) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            let (s, d) = (src.as_ptr() as u64, dst.as_mut_ptr() as u64);
            // Reversed order: no two segments merge into one range on both sides.
            let segs: Vec<SegPair> = (0..n as u64)
                .map(|i| SegPair { local: s + i * blk, remote: d + (n as u64 - 1 - i) * blk, len: blk })
                .collect();
            cma(std::process::id() as i32, TransferOp::Write, &Kept(s, src.len() as u64), &segs).unwrap();
            for i in 0..n {
                let j = n - 1 - i;
                let b = blk as usize;
                assert_eq!(dst[j * b..(j + 1) * b], src[i * b..(i + 1) * b], "{n} segments: segment {i}");
            }
        }
    }

    #[test]
    fn cma_refuses_a_local_range_outside_the_pinned_memory() {
        let src = [1u8; 64];
        let mut dst = vec![0u8; 64];
        let s = src.as_ptr() as u64;
        let segs = [SegPair { local: s + 32, remote: dst.as_mut_ptr() as u64, len: 64 }];
        assert!(cma(std::process::id() as i32, TransferOp::Write, &Kept(s, 64), &segs).is_err());
        assert_eq!(dst, [0u8; 64], "nothing was copied");
    }
}
