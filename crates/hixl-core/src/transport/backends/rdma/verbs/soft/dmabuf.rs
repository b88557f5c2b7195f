//! The soft NIC's stand-in for a dma-buf: a file (a memfd in tests) mapped into this process,
//! so that `reg_dmabuf_mr` and everything after it (keys, bounds, READ and WRITE by a peer)
//! runs without a GPU. It does not test GPU memory: a GPU's dma-buf is not mappable this way.

use std::os::fd::RawFd;

use super::access;
use crate::error::{Error, Result};

/// `offset + len` bytes of a file mapped shared; unmapped when dropped.
pub(super) struct Mapping {
    base: *mut libc::c_void,
    size: usize,
    offset: u64,
}

// SAFETY: the mapping is plain shared memory owned by this value; the addresses are used by
// the soft NIC's threads only while the region that owns it is registered.
unsafe impl Send for Mapping {}
// SAFETY: as above; the value itself is never mutated after it is made.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `offset + len` bytes of `fd` (writable when `acc` lets anything write
    /// the region). Err as `ibv_reg_dmabuf_mr` would answer: EINVAL for an empty range or one
    /// past the file's end.
    pub(super) fn new(fd: RawFd, offset: u64, len: u64, acc: u32) -> Result<Mapping> {
        let bad = |why: &str| {
            Error::param(format!("soft verbs: reg_dmabuf_mr(fd {fd}, offset {offset}, {len}): {why}"))
        };
        let end =
            offset.checked_add(len).filter(|_| len > 0).ok_or_else(|| bad("empty or wraps (EINVAL)"))?;
        // SAFETY: struct stat is plain integers: all zeroes is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid out-parameter.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(bad(&std::io::Error::last_os_error().to_string()));
        }
        if (st.st_size as u64) < end {
            return Err(bad(&format!("the file holds {} bytes (EINVAL)", st.st_size)));
        }
        let writes = access::LOCAL_WRITE | access::REMOTE_WRITE;
        let prot = libc::PROT_READ | if acc & writes != 0 { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping of a descriptor we were given; no fixed address.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), end as usize, prot, libc::MAP_SHARED, fd, 0) };
        if base == libc::MAP_FAILED {
            return Err(bad(&format!("mmap: {}", std::io::Error::last_os_error())));
        }
        Ok(Mapping { base, size: end as usize, offset })
    }

    /// The address in this process of the registered range's first byte.
    pub(super) fn at(&self) -> u64 {
        self.base as u64 + self.offset
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; no region uses it any more (it is dropped
        // with the last reference to the region).
        unsafe { libc::munmap(self.base, self.size) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_the_file_does_not_hold_is_refused_naming_it() {
        // SAFETY: a NUL-terminated name; the descriptor is closed below.
        let fd = unsafe { libc::memfd_create(c"hixl-t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: our descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd, 8192) }, 0);
        let e = Mapping::new(fd, 4096, 8192, access::REMOTE_READ).err().expect("past the end");
        assert!(e.message.contains("offset 4096") && e.message.contains("holds 8192 bytes"), "{e}");
        assert!(Mapping::new(fd, 0, 0, access::REMOTE_READ).is_err(), "empty");
        let m = Mapping::new(fd, 4096, 4096, access::REMOTE_READ).unwrap();
        assert_eq!(m.at() % 4096, 0, "a page into a fresh mapping");
        drop(m);
        // SAFETY: ours, closed once.
        unsafe { libc::close(fd) };
        let e = Mapping::new(-1, 0, 1, access::REMOTE_READ).err().expect("no descriptor");
        assert!(e.message.contains("Bad file descriptor"), "{e}");
    }
}
