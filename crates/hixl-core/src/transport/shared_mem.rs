//! Engine-allocated shared memory (`Engine::alloc`): a sealed memfd mapped shared, which
//! same-host peers map too and copy through with plain memcpy (the `shm` backend's keys name
//! the memfd).

use std::os::fd::{FromRawFd, OwnedFd};

use crate::error::{Error, Result};

/// Seals an engine-allocated memfd must carry before a peer maps it: it can then never shrink
/// under the mapping (SIGBUS) or change size at all.
pub(crate) const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Memory allocated by the engine: a memfd (no name in /dev/shm, nothing left behind after a
/// crash) mapped shared, 2 MiB aligned. Unmapped when the last reference drops.
pub struct SharedMem {
    addr: u64,
    len: u64,
    _fd: OwnedFd,
}

/// Alignment of [`SharedMem`] (one huge page).
pub const SHARED_ALIGN: u64 = 2 << 20;

impl SharedMem {
    /// Allocates `len` bytes (rounded up to 2 MiB), zero-filled.
    pub fn new(len: u64) -> Result<SharedMem> {
        if len == 0 {
            return Err(Error::param("cannot allocate 0 bytes (size=0)"));
        }
        let size = len.div_ceil(SHARED_ALIGN) * SHARED_ALIGN;
        let sys = |what: &str| {
            Error::failed(format!("{what} of {size} bytes failed: {}", std::io::Error::last_os_error()))
        };
        // SAFETY: the name is a NUL-terminated literal; flags are valid.
        let fd = unsafe { libc::memfd_create(c"hixl".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(sys("memfd_create"));
        }
        // SAFETY: fd is a fresh descriptor we own from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(raw, size as libc::off_t) } != 0 {
            return Err(sys("ftruncate"));
        }
        // Sealed before anyone can map it: its size never changes again, so no mapping of it
        // (ours or a peer's) can fault past its end.
        // SAFETY: F_ADD_SEALS on our own memfd, created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, REQUIRED_SEALS | libc::F_SEAL_SEAL) } != 0 {
            return Err(sys("sealing the memfd"));
        }
        // Reserve size + 2 MiB of address space, then map the memfd at the aligned start.
        let span = (size + SHARED_ALIGN) as usize;
        // SAFETY: an anonymous PROT_NONE reservation; no memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(sys("mmap"));
        }
        let start = (base as u64).div_ceil(SHARED_ALIGN) * SHARED_ALIGN;
        // SAFETY: [start, start+size) lies inside our reservation; MAP_FIXED replaces it.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                raw,
                0,
            )
        };
        // SAFETY: both munmaps release only the unused head and tail of our reservation.
        unsafe {
            let head = start - base as u64;
            if head > 0 {
                libc::munmap(base, head as usize);
            }
            let tail = span as u64 - head - size;
            if tail > 0 {
                libc::munmap((start + size) as *mut libc::c_void, tail as usize);
            }
        }
        if p == libc::MAP_FAILED {
            // SAFETY: unmap the reservation part that the failed MAP_FIXED left.
            unsafe { libc::munmap(start as *mut libc::c_void, size as usize) };
            return Err(sys("mmap of the memfd"));
        }
        Ok(SharedMem { addr: start, len: size, _fd: fd })
    }

    /// Start address (2 MiB aligned).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes (a multiple of 2 MiB).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The memfd (kept open while mapped, so same-host peers can map it through /proc).
    pub fn fd(&self) -> i32 {
        std::os::fd::AsRawFd::as_raw_fd(&self._fd)
    }

    /// Always false: a SharedMem has at least 2 MiB.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping created in `new`, unmapped once.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}
