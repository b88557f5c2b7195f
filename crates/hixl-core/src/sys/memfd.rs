//! memfds, seals and mappings: the `shm` backend's engine-allocated regions and their
//! peers' mappings of them. A [`Mapping`] unmaps itself on drop.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::{cvt, owned};

/// A new close-on-exec memfd that allows sealing, named "hixl".
pub(crate) fn create() -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal; flags are valid.
    owned(unsafe { libc::memfd_create(c"hixl".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })
}

/// Sets the file's size.
pub(crate) fn truncate(fd: &OwnedFd, size: u64) -> io::Result<()> {
    // SAFETY: ftruncate on a descriptor we hold; touches no memory.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) }).map(drop)
}

/// Adds `seals` (F_SEAL_*) to a memfd.
pub(crate) fn add_seals(fd: &OwnedFd, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS takes an int; it fails on anything but a sealable file.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }).map(drop)
}

/// The seals of a memfd (EINVAL on anything but a memfd/shmem file).
pub(crate) fn seals(fd: &impl AsRawFd) -> io::Result<libc::c_int> {
    // SAFETY: F_GET_SEALS takes no argument.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
}

/// The size of the file `fd` refers to (fstat's `st_size`).
pub(crate) fn file_size(fd: &impl AsRawFd) -> io::Result<u64> {
    // SAFETY: struct stat is plain integers: all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes one stat into the live `st`; it touches no other memory.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st.st_size as u64)
}

/// A mapping of this process, unmapped when dropped. Its existence proves that
/// `[addr, addr+len)` is mapped (readable, and writable unless made read-only by
/// [`Mapping::shared_file`]) for as long as it lives.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: u64,
    len: u64,
}

impl Mapping {
    /// A new shared read-write mapping of the first `len` bytes of `fd`.
    pub(crate) fn shared(fd: &impl AsRawFd, len: u64) -> io::Result<Mapping> {
        Mapping::shared_file(fd, len, true)
    }

    /// A new shared mapping of the first `len` bytes of `fd`: read-write when `writable`,
    /// else read-only (a descriptor opened read-only can only be mapped so).
    pub(crate) fn shared_file(fd: &impl AsRawFd, len: u64, writable: bool) -> io::Result<Mapping> {
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping at an address the kernel picks; no existing memory changes.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len as usize, prot, libc::MAP_SHARED, fd.as_raw_fd(), 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { addr: p as u64, len })
    }

    /// A shared read-write mapping of the first `size` bytes of `fd` at an address aligned to
    /// `align` (a power of two): a PROT_NONE reservation of `size + align` bytes, the file
    /// mapped over its aligned part, the rest given back.
    pub(crate) fn shared_aligned(fd: &impl AsRawFd, size: u64, align: u64) -> io::Result<Mapping> {
        let span = (size + align) as usize;
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
            return Err(io::Error::last_os_error());
        }
        let start = (base as u64).div_ceil(align) * align;
        // SAFETY: [start, start+size) lies inside our reservation; MAP_FIXED replaces only it.
        let p = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        let err = (p == libc::MAP_FAILED).then(io::Error::last_os_error);
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
        if let Some(e) = err {
            // SAFETY: unmap the reservation part that the failed MAP_FIXED left.
            unsafe { libc::munmap(start as *mut libc::c_void, size as usize) };
            return Err(e);
        }
        Ok(Mapping { addr: start, len: size })
    }

    /// Start address.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping this value made, unmapped once.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

/// The host page size (4096 when the system does not say).
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf with a constant name has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}
