//! The CUDA handles hixl makes, as owned values that give their resource back on drop: the
//! current-context guard, the primary contexts, device allocations, pinned host allocations
//! and host registrations, IPC mappings of a peer's allocation, and a copy stream with its
//! events. Every raw driver call that makes or frees one of them is here, so the rest of the
//! CUDA code (and the staging and `cuda_ipc` code above it) holds these values and calls their
//! safe methods.
//!
//! Making and freeing a handle is memory-safe whatever the arguments (the driver refuses a bad
//! one with an error code, and a freed handle is never used again: its owner is gone). What is
//! not is a copy between raw addresses: [`CopyStream::copy`] stays an `unsafe fn`, and
//! [`CopyStream::copy_pinned`] is the safe copy between a staging buffer and ranges whose
//! validity a [`PinnedRanges`] value proves, [`CopyStream::copy_kept`] the safe asynchronous
//! one between a slot of a staging buffer and a range of a request's pins, which it keeps
//! until the stream is synchronised.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::{CuDevicePtr, CuHandle, Driver, IpcMemHandle};
use crate::cuda::{check, driver as loaded_driver};
use crate::error::{Error, Result, Status};
use crate::queue::PinSet;
use crate::sys::mem::PinnedRanges;

/// Makes the primary context of one device current on this thread, and puts back the
/// caller's context when dropped (a Python thread's current device is torch's business).
pub(crate) struct CtxGuard {
    d: &'static Driver,
    previous: CuHandle,
}

impl CtxGuard {
    /// The primary context of device `ordinal`, current until the guard drops.
    pub(crate) fn enter(d: &'static Driver, ordinal: u8) -> Result<CtxGuard> {
        let ctx = primary_context(d, ordinal)?;
        let mut previous: CuHandle = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        check(d, unsafe { (d.ctx_get_current)(&mut previous) }, "cuCtxGetCurrent", Status::Failed)?;
        // SAFETY: `ctx` is a retained primary context (never released: it lives as long as
        // the process, like the runtime's).
        check(d, unsafe { (d.ctx_set_current)(ctx) }, "cuCtxSetCurrent", Status::Failed)?;
        Ok(CtxGuard { d, previous })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        // SAFETY: `previous` was current on this thread (or null, which unsets) a moment ago.
        unsafe { (self.d.ctx_set_current)(self.previous) };
    }
}

/// The retained primary context of device `ordinal` (retained once per process and device,
/// and kept: the primary context is shared with the CUDA runtime, torch and CuPy).
pub(crate) fn primary_context(d: &'static Driver, ordinal: u8) -> Result<CuHandle> {
    use std::sync::Mutex;
    /// Retained contexts, by ordinal (as addresses: the handles are plain pointers).
    static CTX: Mutex<Vec<(u8, usize)>> = Mutex::new(Vec::new());
    let mut all = CTX.lock().unwrap();
    if let Some((_, c)) = all.iter().find(|(o, _)| *o == ordinal) {
        return Ok(*c as CuHandle);
    }
    if ordinal as i32 >= Driver::device_count() {
        return Err(Error::param(format!(
            "cuda:{ordinal} does not exist: this process sees {} CUDA device(s)",
            Driver::device_count()
        )));
    }
    let mut dev = 0;
    // SAFETY: valid out-parameter; ordinal below the device count.
    check(d, unsafe { (d.device_get)(&mut dev, ordinal as c_int) }, "cuDeviceGet", Status::Failed)?;
    let mut ctx: CuHandle = std::ptr::null_mut();
    // SAFETY: valid out-parameter and device.
    check(d, unsafe { (d.primary_ctx_retain)(&mut ctx, dev) }, "cuDevicePrimaryCtxRetain", Status::Failed)?;
    all.push((ordinal, ctx as usize));
    Ok(ctx)
}

/// A peer's allocation opened in this process by its IPC handle (`cuIpcOpenMemHandle`),
/// closed on drop (`cuIpcCloseMemHandle`): its owner keeps it until no copy uses it.
pub(crate) struct IpcMapping {
    d: &'static Driver,
    ptr: CuDevicePtr,
}

impl IpcMapping {
    /// Opens the allocation of `handle` (with lazy peer access); the caller has a context
    /// current. Err: the driver's text (a bad or foreign handle is refused with a code).
    pub(crate) fn open(d: &'static Driver, handle: &[u8; 64]) -> std::result::Result<IpcMapping, String> {
        let mut p: CuDevicePtr = 0;
        let h = IpcMemHandle { reserved: *handle };
        // SAFETY: a valid out-parameter; a bad or foreign handle is refused by the driver with
        // an error code.
        let rc = unsafe { (d.ipc_open_mem_handle)(&mut p, h, super::IPC_MEM_LAZY_ENABLE_PEER_ACCESS) };
        d.check(rc, "cuIpcOpenMemHandle")?;
        Ok(IpcMapping { d, ptr: p })
    }

    /// Its address in this process.
    pub(crate) fn addr(&self) -> CuDevicePtr {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // SAFETY: opened by `open`, closed once; its owner drops it only after its last copy.
        unsafe { (self.d.ipc_close_mem_handle)(self.ptr) };
    }
}

/// Device memory from `cuMemAlloc`, freed on drop (in its device's context).
pub(crate) struct DeviceAlloc {
    d: &'static Driver,
    ptr: CuDevicePtr,
    len: u64,
    ordinal: u8,
}

impl DeviceAlloc {
    /// `len` bytes on device `ordinal`; the caller has that device's context current.
    pub(crate) fn new(d: &'static Driver, ordinal: u8, len: u64) -> Result<DeviceAlloc> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: a valid out-parameter; the device's context is current.
        check(d, unsafe { (d.mem_alloc)(&mut p, len as usize) }, "cuMemAlloc", Status::ResourceExhausted)?;
        Ok(DeviceAlloc { d, ptr: p, len, ordinal })
    }

    /// Its device address.
    pub(crate) fn addr(&self) -> CuDevicePtr {
        self.ptr
    }

    /// Sets every byte to `fill` on the null stream and waits for it (the engine's streams
    /// do not wait for the null stream by themselves); its context is current.
    pub(crate) fn fill(&self, fill: u8) -> Result<()> {
        let d = self.d;
        // SAFETY: our allocation of `len` bytes; the synchronize ends the set before we return.
        unsafe {
            check(d, (d.memset_d8)(self.ptr, fill, self.len as usize), "cuMemsetD8", Status::Failed)?;
            check(d, (d.stream_synchronize)(std::ptr::null_mut()), "cuStreamSynchronize", Status::Failed)?;
        }
        Ok(())
    }

    /// Copies `data` to offset `at` and waits for the copy.
    pub(crate) fn write_at(&self, at: u64, data: &[u8]) -> Result<()> {
        self.check_range(at, data.len() as u64)?;
        // The device pointer and the host slice are both UVA addresses: cuMemcpy finds the kinds.
        // SAFETY: the device range is inside our allocation (checked), the source is the
        // caller's slice, borrowed for the call; `sync_copy` ends the copy before returning.
        unsafe { self.sync_copy(self.ptr + at, data.as_ptr() as u64, data.len()) }
    }

    /// Copies `out.len()` bytes from offset `at` into `out` and waits for the copy.
    pub(crate) fn read_at(&self, at: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(at, out.len() as u64)?;
        // SAFETY: as in `write_at`, with the caller's slice borrowed mutably as the destination.
        unsafe { self.sync_copy(out.as_mut_ptr() as u64, self.ptr + at, out.len()) }
    }

    fn check_range(&self, at: u64, n: u64) -> Result<()> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::param(format!(
                "range {at}+{n} is outside the device buffer of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies in the device's context, on the null stream with a synchronize after it, so
    /// that the copy has ended when it returns.
    ///
    /// # Safety
    /// Both ranges are valid for `n` bytes for the call.
    unsafe fn sync_copy(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        let d = self.d;
        let _ctx = CtxGuard::enter(d, self.ordinal)?;
        // SAFETY: the caller's contract; the synchronize ends the copy before we return.
        unsafe {
            check(d, (d.memcpy_async)(dst, src, n, std::ptr::null_mut()), "cuMemcpyAsync", Status::Failed)?;
            check(d, (d.stream_synchronize)(std::ptr::null_mut()), "cuStreamSynchronize", Status::Failed)
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Ok(_ctx) = CtxGuard::enter(self.d, self.ordinal) {
            // SAFETY: our allocation, freed once.
            unsafe { (self.d.mem_free)(self.ptr) };
        }
    }
}

/// Pinned (page-locked) host memory from `cuMemHostAlloc`, usable by every context; freed on
/// drop. The DMA engines copy to and from it at full speed, and sockets read and write it
/// like any host memory.
pub(crate) struct PinnedBuf {
    d: &'static Driver,
    ptr: *mut c_void,
    len: u64,
}

// SAFETY: the buffer is plain host memory owned by this value; whoever writes or reads it
// through `addr` synchronises by the pipeline's own ordering (events, request completion).
unsafe impl Send for PinnedBuf {}
// SAFETY: as above; `&PinnedBuf` only hands out the address.
unsafe impl Sync for PinnedBuf {}

// SAFETY: `[addr, addr+len)` is host memory that cuMemHostAlloc gave this value, freed only
// when it drops; Rust holds no references into it (it is reached by address only).
unsafe impl crate::sys::mem::PinnedMemory for PinnedBuf {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr() && addr.checked_add(len).is_some_and(|e| e <= self.addr() + self.len)
    }
}

impl PinnedBuf {
    /// `len` bytes (at least 1) of pinned host memory. UNSUPPORTED without CUDA.
    pub(crate) fn new(len: u64) -> Result<PinnedBuf> {
        let d = loaded_driver()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; PORTABLE needs no current context.
        let rc = unsafe { (d.mem_host_alloc)(&mut p, len.max(1) as usize, super::MEMHOSTALLOC_PORTABLE) };
        check(d, rc, "cuMemHostAlloc", Status::ResourceExhausted)?;
        Ok(PinnedBuf { d, ptr: p, len: len.max(1) })
    }

    /// Its address.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Its length.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once; no copy or socket uses it any more
        // (its owners drop it only after their copies and transfers ended).
        unsafe { (self.d.mem_free_host)(self.ptr) };
    }
}

/// The first `len` bytes of a shared [`PinnedBuf`], as ranges a socket job may move
/// (`IoJob::push_pinned`) or a hash may read: the value keeps the buffer alive.
#[derive(Clone)]
pub(crate) struct PinnedPrefix {
    buf: std::sync::Arc<PinnedBuf>,
    len: u64,
}

impl PinnedPrefix {
    /// The first `len` bytes of `buf`, or None when it is shorter.
    pub(crate) fn new(buf: std::sync::Arc<PinnedBuf>, len: u64) -> Option<PinnedPrefix> {
        (len <= buf.len()).then_some(PinnedPrefix { buf, len })
    }
}

// SAFETY: the range is the first `len` bytes of the buffer (`new` checks `len` against its
// length), a cuMemHostAlloc allocation of this process that the value keeps alive through its
// `Arc` and that never moves; nothing in Rust holds a reference into it (its owners use only
// its address).
unsafe impl PinnedRanges for PinnedPrefix {
    fn for_each_range(&self, mut f: impl FnMut(u64, u64)) {
        f(self.buf.addr(), self.len)
    }
}

/// A [`PinnedPrefix`] with what must live as long as its bytes are used (a staging lease and
/// its budget, the frame's pins), dropped after the prefix's share of the buffer.
pub(crate) struct PinnedBytes {
    prefix: PinnedPrefix,
    _keep: Box<dyn Send>,
}

impl PinnedBytes {
    /// `prefix`, keeping `keep` until the value drops.
    pub(crate) fn new(prefix: PinnedPrefix, keep: Box<dyn Send>) -> PinnedBytes {
        PinnedBytes { prefix, _keep: keep }
    }
}

// SAFETY: the ranges are those of `prefix`, which vouches for them (its own `PinnedRanges`)
// and lives exactly as long as the value.
unsafe impl PinnedRanges for PinnedBytes {
    fn for_each_range(&self, f: impl FnMut(u64, u64)) {
        self.prefix.for_each_range(f)
    }
}

/// Host memory registered with the driver (`cuMemHostRegister`, portable: pinned for every
/// context), so that a GPU copy can reach it; unregistered on drop, in the context of the
/// device it was registered from. Registering neither reads nor writes the memory (the driver
/// refuses a range that is not mapped); the copies to it are what carry a contract.
pub(crate) struct HostRegistration {
    d: &'static Driver,
    ordinal: u8,
    base: u64,
}

impl HostRegistration {
    /// Registers `[base, base + len)` from device `ordinal`'s context (the caller's current
    /// one); Err with `status` naming the call.
    pub(crate) fn new(
        d: &'static Driver,
        ordinal: u8,
        base: u64,
        len: u64,
        status: Status,
    ) -> Result<HostRegistration> {
        // SAFETY: the driver only pins the pages of the range, which it checks are mapped.
        let rc = unsafe {
            (d.mem_host_register)(base as *mut c_void, len as usize, super::MEMHOSTREGISTER_PORTABLE)
        };
        check(d, rc, "cuMemHostRegister", status)?;
        Ok(HostRegistration { d, ordinal, base })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ctx = CtxGuard::enter(self.d, self.ordinal);
        // SAFETY: exactly the range registered in `new`, unregistered once; its owner drops it
        // after its copies ended and before the memory is unmapped.
        unsafe { (self.d.mem_host_unregister)(self.base as *mut c_void) };
    }
}

/// A non-blocking stream of one device (it never waits for the legacy default stream, so
/// staging does not wait for the caller's kernels) and its events, one per ring slot.
pub(crate) struct CopyStream {
    d: &'static Driver,
    ordinal: u8,
    stream: CuHandle,
    events: Vec<CuHandle>,
    /// What the copies queued by `copy_kept` since the last `sync` read and write: kept until
    /// that `sync`, by which they ended.
    kept: RefCell<Vec<Kept>>,
}

/// A proof that [`CopyStream::copy_kept`] keeps while its copy may run.
enum Kept {
    Buf(Arc<PinnedBuf>),
    Pins(Arc<PinSet>),
}

// SAFETY: CUDA streams and events may be used from any thread that has their context current
// (every use here enters it first); one owner at a time uses them, and with them what they
// keep (`Arc`s of values that are Send and Sync).
unsafe impl Send for CopyStream {}

impl CopyStream {
    /// A stream on device `ordinal` with `events` events.
    pub(crate) fn new(ordinal: u8, events: usize) -> Result<CopyStream> {
        let d = loaded_driver()?;
        let _ctx = CtxGuard::enter(d, ordinal)?;
        let mut stream: CuHandle = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; the device's context is current.
        let rc = unsafe { (d.stream_create)(&mut stream, super::STREAM_NON_BLOCKING) };
        check(d, rc, "cuStreamCreate", Status::Failed)?;
        let mut s = CopyStream {
            d,
            ordinal,
            stream,
            events: Vec::with_capacity(events),
            kept: RefCell::new(Vec::new()),
        };
        for _ in 0..events {
            let mut e: CuHandle = std::ptr::null_mut();
            // SAFETY: a valid out-parameter; the context is current.
            let rc = unsafe { (d.event_create)(&mut e, super::EVENT_DISABLE_TIMING) };
            check(d, rc, "cuEventCreate", Status::Failed)?;
            s.events.push(e);
        }
        Ok(s)
    }

    /// The device.
    pub(crate) fn ordinal(&self) -> u8 {
        self.ordinal
    }

    /// Makes the stream's context current on this thread until the guard drops.
    pub(crate) fn enter(&self) -> Result<CtxGuard> {
        CtxGuard::enter(self.d, self.ordinal)
    }

    /// Queues a copy of `len` bytes from `src` to `dst` (unified addresses: device or host).
    ///
    /// # Safety
    /// Both ranges must stay valid until the copy ended (an event recorded after it, or
    /// `sync`); the stream's context must be current.
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        let rc = unsafe { (self.d.memcpy_async)(dst, src, len as usize, self.stream) };
        check(self.d, rc, "cuMemcpyAsync", Status::Failed)
    }

    /// Copies between `buf` (from offset 0, in order) and the ranges of `ranges` (walked
    /// lazily), towards the ranges when `to_ranges`, and waits until every copy it queued has
    /// ended (on an error too). The stream's context must be current (`enter`); the ranges
    /// may be device or host memory (unified addresses).
    pub(crate) fn copy_pinned(
        &self,
        buf: &PinnedBuf,
        ranges: &impl PinnedRanges,
        to_ranges: bool,
    ) -> Result<()> {
        let mut off = 0u64;
        let mut res = Ok(());
        ranges.for_each_range(|addr, len| {
            if res.is_err() {
                return;
            }
            if off.checked_add(len).is_none_or(|end| end > buf.len()) {
                res = Err(Error::param(format!(
                    "{} bytes of ranges do not fit a staging buffer of {} bytes",
                    off.saturating_add(len),
                    buf.len()
                )));
                return;
            }
            let (dst, src) = if to_ranges { (addr, buf.addr() + off) } else { (buf.addr() + off, addr) };
            // SAFETY: `addr..addr+len` is valid while `ranges` lives (the promise of
            // `PinnedRanges`: registered memory, pinned), and `ranges` outlives this call; the
            // buffer range was checked to lie inside `buf`, borrowed for the call; `sync` below
            // ends every queued copy before either is released.
            res = unsafe { self.copy(dst, src, len) };
            off += len;
        });
        let synced = self.sync();
        res?;
        synced
    }

    /// Queues a copy of `len` bytes between offset `off` of `buf` and `addr`, every byte of
    /// which must lie in a region of `pins` (device or host memory: unified addresses), towards
    /// `addr` when `to_pins`; keeps `buf` and `pins` until the next [`CopyStream::sync`], by
    /// which the copy ended. Err, nothing queued: a range outside its memory. The stream's
    /// context must be current (`enter`).
    pub(crate) fn copy_kept(
        &self,
        buf: &Arc<PinnedBuf>,
        off: u64,
        pins: &Arc<PinSet>,
        addr: u64,
        len: u64,
        to_pins: bool,
    ) -> Result<()> {
        let in_buf = off.checked_add(len).is_some_and(|end| end <= buf.len());
        if !in_buf || !pins.in_regions(addr, len) {
            return Err(Error::failed(format!(
                "a staged copy of 0x{addr:x}+{len} lies outside the request's pinned regions or its slot"
            )));
        }
        {
            let mut kept = self.kept.borrow_mut();
            let has_buf = kept.iter().any(|k| matches!(k, Kept::Buf(b) if Arc::ptr_eq(b, buf)));
            if !has_buf {
                kept.push(Kept::Buf(buf.clone()));
            }
            if !kept.iter().any(|k| matches!(k, Kept::Pins(p) if Arc::ptr_eq(p, pins))) {
                kept.push(Kept::Pins(pins.clone()));
            }
        }
        let slot = buf.addr() + off;
        let (dst, src) = if to_pins { (addr, slot) } else { (slot, addr) };
        // SAFETY: checked just above: the slot range lies in `buf`, and every byte of
        // `addr..addr+len` in a region of `pins`, whose registrant promised it valid memory of
        // its domain until it is deregistered (`Engine::register_mem`), which a pin prevents (a
        // range across two adjacent regions lies in both). The stream keeps both (`kept`) until
        // `sync` (or the stream's drop) has seen every queued copy end; when that cannot be
        // seen (the synchronisation fails, or the context cannot be entered at drop) they are
        // leaked, kept pinned for good, rather than let go. The context is the
        // caller's to make current (`enter`), as for `copy_pinned`: the driver refuses a stream
        // whose context is not current with an error, touching no memory.
        unsafe { self.copy(dst, src, len) }
    }

    /// Records event `i` after everything queued so far.
    pub(crate) fn record(&self, i: usize) -> Result<()> {
        // SAFETY: our event and stream; the context is current (caller's use of `enter`).
        let rc = unsafe { (self.d.event_record)(self.events[i], self.stream) };
        check(self.d, rc, "cuEventRecord", Status::Failed)
    }

    /// Waits until event `i` happened: the copies queued before it ended.
    pub(crate) fn wait(&self, i: usize) -> Result<()> {
        // SAFETY: our event.
        let rc = unsafe { (self.d.event_synchronize)(self.events[i]) };
        check(self.d, rc, "cuEventSynchronize (a staging copy)", Status::Failed)
    }

    /// Waits until every queued copy ended, then lets go of what `copy_kept` kept for them.
    /// When the wait fails, nothing says the copies ended: what they touch is leaked (kept
    /// pinned for good) rather than let go.
    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: our stream.
        let rc = unsafe { (self.d.stream_synchronize)(self.stream) };
        self.let_go_of_kept(rc == 0);
        check(self.d, rc, "cuStreamSynchronize (staging copies)", Status::Failed)
    }

    /// Drops what `copy_kept` kept when its copies are known to have ended; leaks it otherwise.
    fn let_go_of_kept(&self, copies_ended: bool) {
        let kept = std::mem::take(&mut *self.kept.borrow_mut());
        if copies_ended {
            drop(kept);
        } else if !kept.is_empty() {
            tracing::error!(
                "a CUDA staging stream could not be synchronized: {} pinned buffers and regions \
                 its copies touch stay pinned for good",
                kept.len()
            );
            std::mem::forget(kept);
        }
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let Ok(_ctx) = CtxGuard::enter(self.d, self.ordinal) else {
            self.let_go_of_kept(false);
            return;
        };
        // SAFETY: ours, destroyed once, after the copies on them ended (sync first).
        let rc = unsafe { (self.d.stream_synchronize)(self.stream) };
        self.let_go_of_kept(rc == 0);
        // SAFETY: as above; a failed synchronize leaves the stream to the driver's teardown.
        unsafe {
            for e in &self.events {
                (self.d.event_destroy)(*e);
            }
            (self.d.stream_destroy)(self.stream);
        }
    }
}
