//! Device memory as a dma-buf, for GPUDirect RDMA registration (`ibv_reg_dmabuf_mr`): whether
//! a device can export one (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`) and the export itself
//! (`cuMemGetHandleForAddressRange` with `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`). Both need a
//! driver of CUDA 11.7 or later; the entry point is looked up optionally, so an older driver
//! still loads and the caller is told what is missing.
//!
//! Built and unit-tested without a GPU (the page arithmetic); never run on a GPU here.

use std::ffi::c_int;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::driver::handles::export_dmabuf;
use super::driver::{self, Driver};
use super::CtxGuard;
use crate::error::{Error, Result, Status};

/// Whether device `ordinal` exports its memory as dma-bufs (the device attribute). Err: why it
/// cannot be asked (no CUDA, no such device, the query failed).
pub(crate) fn supported(ordinal: u8) -> std::result::Result<bool, String> {
    let d = Driver::get()?;
    if ordinal as i32 >= Driver::device_count() {
        return Err(format!("cuda:{ordinal} does not exist ({} device(s))", Driver::device_count()));
    }
    let dev = d.check_res(d.device(ordinal as c_int), "cuDeviceGet")?;
    // A driver older than the attribute answers CUDA_ERROR_INVALID_VALUE, reported as the
    // error it is.
    let v = d.check_res(
        d.device_attribute(driver::ATTR_DMA_BUF_SUPPORTED, dev),
        "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)",
    )?;
    Ok(v == 1)
}

/// The page-aligned range a dma-buf export of `[addr, addr + len)` covers, and where `addr`
/// lies in it: `(base, size, offset)`. The driver exports whole host pages (NCCL and
/// rdma-core's tests align the same way); `ibv_reg_dmabuf_mr` then registers `len` bytes at
/// `offset`. None when the range wraps around.
pub(crate) fn page_span(addr: u64, len: u64, page: u64) -> Option<(u64, u64, u64)> {
    debug_assert!(page.is_power_of_two());
    let base = addr & !(page - 1);
    let end = addr.checked_add(len)?.checked_add(page - 1)? & !(page - 1);
    Some((base, end - base, addr - base))
}

/// The host page size.
pub(crate) fn host_page() -> u64 {
    crate::sys::memfd::page_size()
}

/// A dma-buf the CUDA driver exported for the whole pages around a device range, and where
/// that range starts in it: it holds at least `offset + len` bytes. Made only by [`export`],
/// so a value says so (`ibv_reg_dmabuf_mr` may register `len` bytes at `offset` of it).
#[derive(Debug)]
pub(crate) struct DmaBuf {
    /// Closed when dropped (once the NICs have registered it: each region holds its own
    /// reference).
    fd: OwnedFd,
    offset: u64,
    addr: u64,
    len: u64,
}

impl DmaBuf {
    /// Its descriptor.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Where the exported range starts in the dma-buf.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The device range `[addr, addr + len)` it was exported for: `(addr, len)`.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.addr, self.len)
    }
}

/// Exports `[addr, addr + len)` of device `ordinal` as a dma-buf: the descriptor (owned: closed
/// when dropped, which the caller does once the NIC has registered it) and `addr`'s offset in
/// it. UNSUPPORTED naming the entry point when the driver lacks it.
pub(crate) fn export(ordinal: u8, addr: u64, len: u64) -> Result<DmaBuf> {
    let d = super::driver()?;
    let get = driver::get_handle_for_address_range().map_err(|why| Error::new(Status::Unsupported, why))?;
    let (base, size, offset) = page_span(addr, len, host_page())
        .ok_or_else(|| Error::param(format!("device range 0x{addr:x}+{len} wraps around")))?;
    let _ctx = CtxGuard::enter(d, ordinal)?;
    // The range is device memory the engine resolved (`cuda::resolve`), widened to whole pages.
    let fd = export_dmabuf(get, base, size as usize).map_err(|rc| {
        let what = format!("{}(0x{base:x}+{size}, DMA_BUF_FD)", driver::GET_HANDLE_FOR_ADDRESS_RANGE);
        Error::new(Status::Failed, d.check(rc, &what).expect_err("an error code"))
    })?;
    match fd {
        Some(fd) => Ok(DmaBuf { fd, offset, addr, len }),
        None => {
            Err(Error::failed(format!("{} returned no descriptor", driver::GET_HANDLE_FOR_ADDRESS_RANGE)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn an_export_covers_whole_pages_and_says_where_the_range_starts() {
        assert_eq!(page_span(0x10000, 4096, 4096), Some((0x10000, 4096, 0)));
        assert_eq!(page_span(0x10010, 100, 4096), Some((0x10000, 4096, 0x10)));
        assert_eq!(page_span(0x10ff0, 0x20, 4096), Some((0x10000, 0x2000, 0xff0)), "straddles a page");
        assert_eq!(page_span(0x20000, 1 << 21, 1 << 16), Some((0x20000, 1 << 21, 0)));
        assert_eq!(page_span(u64::MAX - 10, 100, 4096), None);
        assert!(host_page().is_power_of_two());
    }

    /// On a GPU machine (scripts/gpu_check.sh; skipped without CUDA): real device memory is
    /// exported as a dma-buf of the whole pages around the range, or the device says it cannot.
    /// This is the CUDA half of GPUDirect over dma-buf; no NIC is involved.
    #[test]
    fn real_device_memory_is_exported_as_a_dmabuf_where_the_device_allows_it() {
        if Driver::get().is_err() {
            eprintln!("skipped: no CUDA here");
            return;
        }
        let buf = super::super::DeviceBuffer::new(0, 4 << 20, 0x5a).unwrap();
        let (addr, len) = (buf.addr() + 4096 + 100, 1 << 20);
        let supported = supported(0).unwrap();
        let got = export(0, addr, len);
        eprintln!("cuda:0 DMA_BUF_SUPPORTED={supported}; export: {:?}", got.as_ref().map(|b| b.offset()));
        if !supported {
            assert!(got.is_err(), "a device without dma-buf support exported one");
            return;
        }
        let dmabuf = got.unwrap();
        let (_, size, want_offset) = page_span(addr, len, host_page()).unwrap();
        assert_eq!(dmabuf.offset(), want_offset);
        assert_eq!(dmabuf.range(), (addr, len));
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", dmabuf.fd().as_raw_fd())).unwrap();
        assert!(info.contains("exp_name:"), "not a dma-buf: {info}");
        let sz = info.lines().find_map(|l| l.strip_prefix("size:")).map(|v| v.trim().parse::<u64>().unwrap());
        assert_eq!(sz, Some(size), "{info}");
    }

    #[test]
    fn without_cuda_the_export_and_the_attribute_say_why() {
        if Driver::get().is_ok() {
            eprintln!("skipped: this machine has CUDA");
            return;
        }
        let e = supported(0).unwrap_err();
        assert!(e.contains("CUDA was"), "{e}");
        let e = export(0, 0x7f00_0000_0000, 4096).unwrap_err();
        assert_eq!(e.status, Status::Unsupported, "{e}");
        assert!(e.message.contains("CUDA was"), "{e}");
        // The entry point is looked up without initialising CUDA; without the library it is
        // missing for that reason.
        if Driver::loadable().is_err() {
            let e = driver::get_handle_for_address_range().expect_err("no driver, no entry point");
            assert!(e.contains("libcuda.so.1"), "{e}");
        }
    }
}
