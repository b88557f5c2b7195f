//! The soft NIC's stand-in for a dma-buf: a file (a memfd in tests) mapped into this process,
//! so that `reg_dmabuf_mr` and everything after it (keys, bounds, READ and WRITE by a peer)
//! runs without a GPU. It does not test GPU memory: a GPU's dma-buf is not mappable this way.

use std::os::fd::RawFd;

use super::access;
use crate::error::{Error, Result};
use crate::sys::memfd;

/// `offset + len` bytes of a file mapped shared; unmapped when dropped.
pub(super) struct Mapping {
    map: memfd::Mapping,
    offset: u64,
}

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
        let size = memfd::file_size(&fd).map_err(|e| bad(&e.to_string()))?;
        if size < end {
            return Err(bad(&format!("the file holds {size} bytes (EINVAL)")));
        }
        let writable = acc & (access::LOCAL_WRITE | access::REMOTE_WRITE) != 0;
        let map = memfd::Mapping::shared_file(&fd, end, writable).map_err(|e| bad(&format!("mmap: {e}")))?;
        Ok(Mapping { map, offset })
    }

    /// The address in this process of the registered range's first byte.
    pub(super) fn at(&self) -> u64 {
        self.map.addr() + self.offset
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[test]
    fn a_range_the_file_does_not_hold_is_refused_naming_it() {
        let file = memfd::create().unwrap();
        memfd::truncate(&file, 8192).unwrap();
        let fd = file.as_raw_fd();
        let e = Mapping::new(fd, 4096, 8192, access::REMOTE_READ).err().expect("past the end");
        assert!(e.message.contains("offset 4096") && e.message.contains("holds 8192 bytes"), "{e}");
        assert!(Mapping::new(fd, 0, 0, access::REMOTE_READ).is_err(), "empty");
        let m = Mapping::new(fd, 4096, 4096, access::REMOTE_READ).unwrap();
        assert_eq!(m.at() % 4096, 0, "a page into a fresh mapping");
        drop(m);
        drop(file);
        let e = Mapping::new(-1, 0, 1, access::REMOTE_READ).err().expect("no descriptor");
        assert!(e.message.contains("Bad file descriptor"), "{e}");
    }
}
