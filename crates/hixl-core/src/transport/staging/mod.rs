//! Staging CUDA device memory over TCP: the seam between the `tcp` backend and CUDA.
//!
//! TCP moves bytes between sockets and host memory, and a socket cannot read or write device
//! memory, so device bytes go through pinned host bounce buffers in chunks
//! (`hixl.cuda.stage_chunk` bytes, `hixl.cuda.stage_depth` of them per request):
//!
//! - **Initiator** (`initiator.rs`): a request over `tcp` with device memory on either side is
//!   handed to the engine's [`Stager`] instead of the link. Its workers cut it into chunks
//!   (`cuda::stage_plan`) and run them as a pipeline: for a WRITE from device memory the copy
//!   of chunk k+1 into its slot runs while chunk k is on the wire; for a READ into device
//!   memory chunk k+1 arrives while chunk k is copied out. Each chunk is an ordinary host
//!   transfer on the same `TcpLink` (zero-copy from the slot), so the TCP code never sees
//!   device memory, and host-to-host requests never come here.
//! - **Target** (`target.rs`): a WRITE or READ frame whose ranges lie in device regions of the
//!   target's registry is received into (or sent from) a pinned buffer, with the copy to (or
//!   from) the device in between; `served.rs` calls it at two points. The pinned bytes lent at
//!   once are capped per engine and per peer (`budget.rs`).
//!
//! Where CUDA is not usable, every entry point answers `UNSUPPORTED` with "CUDA was not
//! found: ..." (nothing panics).

pub(crate) mod budget;
mod initiator;
pub(crate) mod target;

pub(crate) use initiator::Stager;

use std::ffi::c_void;

use crate::cuda::driver::{self, CuHandle, Driver};
use crate::cuda::{check, driver as loaded_driver, CtxGuard};
use crate::error::{Error, Result, Status};
use crate::wire::Domain;

/// The (local, remote) domain pairs the `tcp` backend serves: host memory directly, device
/// memory (`Cuda(0)` stands for every `cuda:N`) by staging on the side that owns it.
pub(crate) const TCP_PAIRS: &[(Domain, Domain)] = &[
    (Domain::Host, Domain::Host),
    (Domain::Cuda(0), Domain::Host),
    (Domain::Host, Domain::Cuda(0)),
    (Domain::Cuda(0), Domain::Cuda(0)),
];

/// The device of a staged request's local memory: the first pinned region in device memory.
pub(crate) fn device_of(pins: &[crate::registry::Pin]) -> Option<u8> {
    pins.iter().find_map(|p| match p.region().mem_type {
        Domain::Cuda(n) => Some(n),
        Domain::Device => Some(0),
        Domain::Host => None,
    })
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
        let rc = unsafe { (d.mem_host_alloc)(&mut p, len.max(1) as usize, driver::MEMHOSTALLOC_PORTABLE) };
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

/// A non-blocking stream of one device (it never waits for the legacy default stream, so
/// staging does not wait for the caller's kernels) and its events, one per ring slot.
pub(crate) struct CopyStream {
    d: &'static Driver,
    ordinal: u8,
    stream: CuHandle,
    events: Vec<CuHandle>,
}

// SAFETY: CUDA streams and events may be used from any thread that has their context current
// (every use here enters it first); one owner at a time uses them.
unsafe impl Send for CopyStream {}

impl CopyStream {
    /// A stream on device `ordinal` with `events` events.
    pub(crate) fn new(ordinal: u8, events: usize) -> Result<CopyStream> {
        let d = loaded_driver()?;
        let _ctx = CtxGuard::enter(d, ordinal)?;
        let mut stream: CuHandle = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; the device's context is current.
        let rc = unsafe { (d.stream_create)(&mut stream, driver::STREAM_NON_BLOCKING) };
        check(d, rc, "cuStreamCreate", Status::Failed)?;
        let mut s = CopyStream { d, ordinal, stream, events: Vec::with_capacity(events) };
        for _ in 0..events {
            let mut e: CuHandle = std::ptr::null_mut();
            // SAFETY: a valid out-parameter; the context is current.
            let rc = unsafe { (d.event_create)(&mut e, driver::EVENT_DISABLE_TIMING) };
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

    /// Waits until every queued copy ended.
    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: our stream.
        let rc = unsafe { (self.d.stream_synchronize)(self.stream) };
        check(self.d, rc, "cuStreamSynchronize (staging copies)", Status::Failed)
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        if let Ok(_ctx) = CtxGuard::enter(self.d, self.ordinal) {
            // SAFETY: ours, destroyed once, after the copies on them ended (sync first).
            unsafe {
                (self.d.stream_synchronize)(self.stream);
                for e in &self.events {
                    (self.d.event_destroy)(*e);
                }
                (self.d.stream_destroy)(self.stream);
            }
        }
    }
}

/// Why device memory cannot be staged here ("CUDA was not found: ..."), as UNSUPPORTED.
pub(crate) fn unsupported_here(what: &str) -> Option<Error> {
    loaded_driver().err().map(|e| Error::new(Status::Unsupported, format!("{what}: {}", e.message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;

    #[test]
    fn staging_defaults_to_four_slots_of_four_mib_and_is_bounded() {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let o = Options::default();
        assert_eq!((o.stage_chunk, o.stage_depth), (4 << 20, 4));
        let o = Options::parse(&map(&[("hixl.cuda.stage_chunk", "65536"), ("hixl.cuda.stage_depth", "16")]))
            .unwrap();
        assert_eq!((o.stage_chunk, o.stage_depth), (65536, 16));
        for (k, bad) in [
            ("hixl.cuda.stage_chunk", "65535"),
            ("hixl.cuda.stage_chunk", "67108865"),
            ("hixl.cuda.stage_depth", "1"),
            ("hixl.cuda.stage_depth", "17"),
        ] {
            let e = Options::parse(&map(&[(k, bad)])).unwrap_err();
            assert!(e.message.contains(k), "{e}");
        }
    }

    #[test]
    fn without_cuda_staging_says_cuda_was_not_found() {
        if crate::cuda::info().available {
            return;
        }
        let e = unsupported_here("staging device memory over TCP").expect("no CUDA here");
        assert_eq!(e.status, Status::Unsupported);
        assert!(e.message.starts_with("staging device memory over TCP: CUDA was"), "{}", e.message);
        let e = PinnedBuf::new(4096).err().expect("no CUDA here");
        assert_eq!(e.status, Status::Unsupported);
        let e = CopyStream::new(0, 2).err().expect("no CUDA here");
        assert!(e.message.contains("CUDA was"), "{}", e.message);
    }
}
