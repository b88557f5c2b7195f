//! Engine-allocated shared memory (`Engine::alloc`): a sealed memfd mapped shared, which
//! same-host peers map too and copy through with plain memcpy (the `shm` backend's keys name
//! the memfd).

use std::os::fd::OwnedFd;

use crate::error::{Error, Result};
use crate::sys::memfd::{self, Mapping};

/// Seals an engine-allocated memfd must carry before a peer maps it: it can then never shrink
/// under the mapping (SIGBUS) or change size at all.
pub(crate) const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// Memory allocated by the engine: a memfd (no name in /dev/shm, nothing left behind after a
/// crash) mapped shared, 2 MiB aligned. Unmapped when the last reference drops.
pub struct SharedMem {
    /// Dropped (unmapped) before the memfd closes.
    map: Mapping,
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
        let sys =
            |what: &str, e: std::io::Error| Error::failed(format!("{what} of {size} bytes failed: {e}"));
        let fd = memfd::create().map_err(|e| sys("memfd_create", e))?;
        memfd::truncate(&fd, size).map_err(|e| sys("ftruncate", e))?;
        // Sealed before anyone can map it: its size never changes again, so no mapping of it
        // (ours or a peer's) can fault past its end.
        memfd::add_seals(&fd, REQUIRED_SEALS | libc::F_SEAL_SEAL).map_err(|e| sys("sealing the memfd", e))?;
        // Reserve size + 2 MiB of address space, then map the memfd at the aligned start.
        let map =
            Mapping::shared_aligned(&fd, size, SHARED_ALIGN).map_err(|e| sys("mmap of the memfd", e))?;
        Ok(SharedMem { map, _fd: fd })
    }

    /// Start address (2 MiB aligned).
    pub fn addr(&self) -> u64 {
        self.map.addr()
    }

    /// Length in bytes (a multiple of 2 MiB).
    pub fn len(&self) -> u64 {
        self.map.len()
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
