//! Raw copies and views of memory named by address: the `self` backend's copies, the
//! same-host direct copies, and the data MAC's view of registered memory.

/// Copies `len` bytes from `src` to `dst` (memmove: the ranges may overlap).
///
/// # Safety
/// `[src, src+len)` must be readable and `[dst, dst+len)` writable memory of this process,
/// valid during the call and not aliased by a live Rust reference to `dst`'s range.
#[inline]
unsafe fn copy(dst: u64, src: u64, len: u64) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) }
}

/// The `len` bytes at `addr`, as a slice for the duration of `f`.
///
/// # Safety
/// `[addr, addr+len)` must be readable memory of this process that nothing writes through a
/// Rust reference while `f` runs (a concurrent DMA or peer write only makes the bytes
/// unspecified, which the data MAC then reports).
#[inline]
pub(crate) unsafe fn with_bytes<R>(addr: u64, len: u64, f: impl FnOnce(&[u8]) -> R) -> R {
    if len == 0 {
        return f(&[]);
    }
    // SAFETY: the caller's contract.
    f(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) })
}

/// An iovec for `len` bytes at `addr` (no promise: building one is harmless; using it is
/// what the vectored calls' contracts cover).
#[inline]
pub(crate) fn iov(addr: u64, len: u64) -> libc::iovec {
    libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len as usize }
}

/// `v` without its first `n` bytes (`n` at most its length). Pointer arithmetic without a
/// dereference: `wrapping_add` keeps it safe.
#[inline]
pub(crate) fn iov_skip(v: &mut libc::iovec, n: usize) {
    debug_assert!(n <= v.iov_len);
    v.iov_base = (v.iov_base as *mut u8).wrapping_add(n).cast();
    v.iov_len -= n;
}

/// An iovec whose memory someone vouched for: `len` bytes at `base` that stay valid (readable
/// for a send, writable for a receive) for as long as the value, or any value made from it,
/// is used. The one promise is made at [`RawIov::new`], an `unsafe fn` whose callers name the
/// pin (a registry pin held by the job, an owned buffer the job keeps) that keeps the memory
/// there; the vectored calls over `RawIov`s ([`super::sockio::send_iovs`], ...) are then safe,
/// and so is the hot path above them. Narrowing one ([`RawIov::skip`], [`RawIov::prefix`])
/// keeps it inside the vouched range.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct RawIov(libc::iovec);

// SAFETY: a RawIov is an address and a length; the memory it names is valid from any thread
// (registered memory, or buffers the owner keeps), by the promise of `RawIov::new`.
unsafe impl Send for RawIov {}

impl RawIov {
    /// An empty iovec (no memory).
    pub(crate) const EMPTY: RawIov = RawIov(libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 });

    /// `len` bytes at `addr`.
    ///
    /// # Safety
    /// `[addr, addr+len)` must stay valid memory of this process (readable where it is sent
    /// from, writable and not aliased by a live Rust reference where it is received into) for
    /// as long as this value or one made from it is used.
    #[inline]
    pub(crate) unsafe fn new(addr: u64, len: u64) -> RawIov {
        RawIov(iov(addr, len))
    }

    /// Its length in bytes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.0.iov_len
    }

    /// Drops its first `n` bytes (`n` at most its length).
    #[inline]
    pub(crate) fn skip(&mut self, n: usize) {
        iov_skip(&mut self.0, n);
    }

    /// Its first `n` bytes (all of it when `n` is longer).
    #[inline]
    pub(crate) fn prefix(&self, n: usize) -> RawIov {
        RawIov(libc::iovec { iov_base: self.0.iov_base, iov_len: self.0.iov_len.min(n) })
    }

    /// The iovecs as the kernel's type.
    #[inline]
    pub(super) fn as_iovecs(v: &[RawIov]) -> &[libc::iovec] {
        // SAFETY: RawIov is repr(transparent) over libc::iovec.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) }
    }

    /// Copies `src` into the start of its memory (at most its length); the bytes copied.
    #[inline]
    pub(crate) fn copy_from(&self, src: &[u8]) -> usize {
        let n = src.len().min(self.len());
        // SAFETY: `n` bytes fit in the vouched, writable range (the promise of `new`); `src`
        // is a Rust slice, which that range (outside Rust's borrows) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.iov_base.cast::<u8>(), n) };
        n
    }
}

/// How many bytes at the start of `dst` the kernel could write, found by reading the
/// `/dev/zero` descriptor `zero` into them (which zeroes them): all of them, or up to the first
/// byte of memory that is unmapped or may not be written (EFAULT). A read cut short by a
/// signal (the kernel zeroes page by page and stops early when one is pending) goes on where
/// it stopped. Looks at the first `N` iovecs of `dst` only.
pub(crate) fn writable_prefix<const N: usize>(zero: std::os::fd::RawFd, dst: &[RawIov]) -> usize {
    let mut slots = [RawIov::EMPTY; N];
    let n = dst.len().min(N);
    slots[..n].copy_from_slice(&dst[..n]);
    let (mut first, mut done) = (0, 0);
    while first < n {
        let r = match readv_iovs(zero, &slots[first..n]) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break, // EFAULT: the memory from here on refuses writes
        };
        if r == 0 {
            break;
        }
        let mut k = r;
        done += k;
        // Skip what was written; a cut iovec starts where the read stopped.
        while first < n && k >= slots[first].len() {
            k -= slots[first].len();
            first += 1;
        }
        if first < n {
            slots[first].skip(k);
        }
    }
    done
}

/// One `readv(2)` into the memory `iovs` describe; the bytes read (0 at EOF).
///
/// # Safety
/// `iovs` must name writable memory of this process, valid during the call (as for
/// [`super::sockio::recvmsg_iovs`]).
#[inline]
pub(crate) unsafe fn readv(fd: std::os::fd::RawFd, iovs: &[libc::iovec]) -> std::io::Result<usize> {
    // SAFETY: as for `recvmsg_iovs`, by the caller's contract.
    super::cvt_size(unsafe { libc::readv(fd, iovs.as_ptr(), iovs.len() as libc::c_int) })
}

/// One `readv(2)` into the memory `iovs` describe; the bytes read (0 at EOF).
#[inline]
pub(crate) fn readv_iovs(fd: std::os::fd::RawFd, iovs: &[RawIov]) -> std::io::Result<usize> {
    // SAFETY: every RawIov names writable memory (the promise of `RawIov::new`).
    unsafe { readv(fd, RawIov::as_iovecs(iovs)) }
}

/// The shape of ranges that are `count` elements of `size` bytes, `stride` apart from `addr`
/// (see [`PinnedRanges::strided`]): a consumer may walk them lazily instead of one by one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StridedShape {
    pub(crate) addr: u64,
    pub(crate) count: u64,
    pub(crate) size: u64,
    pub(crate) stride: u64,
}

/// Ranges of memory whose validity is proven by the value that yields them: the promise that
/// raw addresses name memory is made once, by the `unsafe impl` of the type that checked the
/// ranges (against the registry, or a buffer it owns) and holds what keeps them there (the
/// pins, the buffer). Consumers that own such a value (an `IoJob`, a hash) then move its bytes
/// through safe calls.
///
/// # Safety
/// Every range that [`PinnedRanges::for_each_range`] yields (and every range of the shape
/// [`PinnedRanges::strided`] returns, which must be the same ranges in the same order) is
/// memory of this process, valid for reads and writes of its length, and not aliased by a live
/// Rust reference, for as long as the value lives, and stays where it is when the value moves
/// (it is never the value's own inline storage: consumers move the value after taking its
/// ranges). The value must be built only where that is checked (constructors private to the
/// module that checks and pins).
pub(crate) unsafe trait PinnedRanges {
    /// Calls `f` with every contiguous (address, length), in order.
    fn for_each_range(&self, f: impl FnMut(u64, u64));

    /// The ranges as one strided shape, when they are one (walked lazily by `IoJob`).
    fn strided(&self) -> Option<StridedShape> {
        None
    }
}

/// Memory that a value keeps valid while it lives: registry pins ([`crate::queue::PinSet`]), a
/// buffer it owns, a mapping. Unlike [`PinnedRanges`], which names its ranges, it answers for
/// any range: a consumer checks each range it is handed (`covers`) and then moves bytes through
/// the safe calls here ([`copy_covered`], [`super::vm::cma`], `IoJob::push_kept`), holding the
/// value (an `Arc`) for as long as it uses the range.
///
/// # Safety
/// Every byte of a range for which [`PinnedMemory::covers`] returns true is host memory of
/// this process, valid for reads and writes and not aliased by a live Rust reference, for as
/// long as the value lives (and its answer for a range never changes while it lives).
pub(crate) unsafe trait PinnedMemory: Send + Sync {
    /// Whether all of `[addr, addr+len)` lies in the memory this value keeps valid.
    fn covers(&self, addr: u64, len: u64) -> bool;
}

/// The error for a local range outside the memory that should keep it valid (never one the
/// engine checked and pinned): nothing is moved.
pub(crate) fn not_covered(addr: u64, len: u64) -> crate::error::Error {
    crate::error::Error::failed(format!(
        "local range 0x{addr:x}+{len} is not in pinned host memory of this process; nothing was copied"
    ))
}

/// [`PinnedRanges`] whose ranges also stay valid after the value is gone, for as long as the
/// [`PinnedMemory`] its [`KeptRanges::keeper`] returns lives: a borrowed view (a part's local
/// side) that a consumer outliving it (an `IoJob`) keeps valid by keeping the keeper.
///
/// # Safety
/// Every range the value yields lies in memory that the keeper covers (checked where the value
/// is made).
pub(crate) unsafe trait KeptRanges: PinnedRanges {
    /// What keeps every range of the value valid.
    fn keeper(&self) -> &std::sync::Arc<dyn PinnedMemory>;
}

/// Copies `len` bytes from `src` (which `src_mem` must cover) to `dst` (which `dst_mem` must
/// cover), as memmove (the ranges may overlap); false, and nothing copied, when either is
/// not covered. A concurrent DMA or peer copy into either range only makes bytes unspecified.
#[inline]
pub(crate) fn copy_covered(
    dst_mem: &dyn PinnedMemory,
    dst: u64,
    src_mem: &dyn PinnedMemory,
    src: u64,
    len: u64,
) -> bool {
    if !(dst_mem.covers(dst, len) && src_mem.covers(src, len)) {
        return false;
    }
    // SAFETY: both ranges were just found covered: valid memory of this process (the promise
    // of `PinnedMemory`) while the borrowed values live, which is past this call.
    unsafe { copy(dst, src, len) };
    true
}

/// Calls `f` with the bytes of every range of `r`, in order (the data MAC's view of pinned
/// memory). A concurrent DMA or peer write only makes the bytes unspecified, which the MAC
/// then reports.
#[inline]
pub(crate) fn for_each_slice(r: &impl PinnedRanges, mut f: impl FnMut(&[u8])) {
    r.for_each_range(|addr, len| {
        // SAFETY: `r` vouches that the range is valid memory while it lives, and it outlives
        // this call (the promise of `PinnedRanges`).
        unsafe { with_bytes(addr, len, &mut f) }
    });
}
