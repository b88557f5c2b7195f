//! `ibv_reg_dmabuf_mr`, the one optional symbol of the `verbs` provider: rdma-core added it in
//! release 34 (libibverbs symbol version IBVERBS_1.12), so an older libibverbs loads without
//! it and GPU memory is then registered, if at all, through nvidia-peermem (`gpudirect.rs`).
//!
//! Its C signature (`<infiniband/verbs.h>`):
//! `struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
//! uint64_t iova, int fd, int access);`

use std::ffi::{c_int, c_void};
use std::os::fd::RawFd;

use super::{errno_err, fn_ptr, offsets, ptr, LibVerbs};
use crate::error::Result;
use crate::transport::backends::rdma::verbs::{Mr, Pd};

/// The symbol's name.
pub(crate) const SYMBOL: &str = "ibv_reg_dmabuf_mr";

/// `ibv_reg_dmabuf_mr`'s type.
pub(super) type RegDmabufMr = unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut c_void;

/// Looks the symbol up in the libibverbs handle `h` (loaded as `name`); Err names it as missing.
///
/// # Safety
/// `h` must be a live `dlopen` handle of libibverbs.
pub(super) unsafe fn resolve(h: *mut c_void, name: &str) -> std::result::Result<RegDmabufMr, String> {
    // SAFETY: a symbol lookup in a live handle (the caller's contract), NUL-terminated name.
    let p = unsafe { libc::dlsym(h, c"ibv_reg_dmabuf_mr".as_ptr()) };
    if p.is_null() {
        return Err(format!("{name} has no {SYMBOL} (rdma-core >= 34 has it)"));
    }
    // SAFETY: the symbol is libibverbs' function of the signature `RegDmabufMr` spells.
    Ok(unsafe { fn_ptr(p) })
}

impl LibVerbs {
    /// `ibv_reg_dmabuf_mr`; UNSUPPORTED naming the symbol when this libibverbs lacks it.
    ///
    /// # Safety
    /// `fd` must be a dma-buf of at least `offset + len` bytes.
    pub(super) unsafe fn dmabuf_mr(
        &self,
        pd: Pd,
        offset: u64,
        len: u64,
        iova: u64,
        fd: RawFd,
        acc: u32,
    ) -> Result<(Mr, u32, u32)> {
        let f = self
            .f
            .reg_dmabuf_mr
            .as_ref()
            .map_err(|why| crate::transport::backends::rdma::unsupported(why.clone()))?;
        // SAFETY: a live PD; the dma-buf's extent is the caller's contract; the kernel takes
        // its own reference to the dma-buf for the region's life.
        let m = unsafe { f(ptr(pd.0), offset, len as usize, iova, fd, acc as c_int) };
        if m.is_null() {
            return Err(errno_err(&format!("{SYMBOL}(fd {fd}, offset {offset}, 0x{iova:x}+{len})")));
        }
        // SAFETY: a live struct ibv_mr; lkey and rkey at their offsets (checked against the header).
        let (lkey, rkey) = unsafe {
            let b = m as *const u8;
            (*(b.add(offsets::MR_LKEY) as *const u32), *(b.add(offsets::MR_RKEY) as *const u32))
        };
        Ok((Mr(m as u64), lkey, rkey))
    }
}
