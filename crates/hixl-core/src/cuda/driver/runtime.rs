//! The CUDA side of one engine: the device context its copies run in, a pool of
//! `hixl.cuda.streams` streams, recycled events, and the ONE completion thread
//! (`hixl-cuda-done`) that polls every in-flight copy's events and reports it. Links issue
//! copies on the caller's thread and hand the events here; no thread per peer or per request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::owned::{primary_context, CtxGuard};
use super::{self as driver, CuHandle, Driver};
use crate::cuda::hold::{Held, TryHold};
use crate::cuda::{check, plan};
use crate::error::{Error, Result, Status};
use crate::queue::SegPair;

/// Below this many bytes a copy is not cut across streams (one stream's copy engine is as fast).
const MIN_SHARE: u64 = 1 << 20;
/// How long the completion thread sleeps between polls while copies are in flight.
const POLL: Duration = Duration::from_micros(20);
/// Bound on the waits of `copy` (the completion thread answers at once; a copy ends on the GPU).
const HOLD_WAIT: Duration = Duration::from_secs(60);

/// Waits (at most `HOLD_WAIT`) for the completion thread's answer to a hold request.
fn wait_answer(a: &Answer) -> bool {
    let end = Instant::now() + HOLD_WAIT;
    let mut got = a.0.lock().unwrap();
    loop {
        if let Some(ok) = *got {
            return ok;
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        got = a.1.wait_timeout(got, left).unwrap().0;
    }
}

/// What the completion thread calls when a copy's events have all fired (or one failed).
pub(crate) type OnDone = Box<dyn FnOnce(Result<()>) + Send>;

/// A copy in flight: its events, who issued it, and what to call at the end.
struct InFlight {
    owner: u64,
    events: Vec<usize>,
    /// An error met while issuing: reported once the issued part has finished.
    failed: Option<Error>,
    on_done: OnDone,
    /// Set once it was reported.
    finished: Arc<AtomicBool>,
    /// The owner's table guard for the completion thread to take (see `hold`), when it does
    /// not hold one yet, and where to answer whether it could.
    hold: Option<(TryHold, Arc<Answer>)>,
}

/// The completion thread's answer to a hold request: whether it keeps the guard.
type Answer = (Mutex<Option<bool>>, Condvar);

/// One owner's (link's) copies in flight, and whether the completion thread keeps its table
/// guard (it does from the first copy it could take it for until the last one ended).
#[derive(Default)]
struct Owner {
    in_flight: usize,
    held: bool,
}

/// State shared with the completion thread.
struct Shared {
    d: &'static Driver,
    ctx: usize,
    queue: Mutex<Vec<InFlight>>,
    bell: Condvar,
    stop: AtomicBool,
    /// In-flight copies per owner (a link), for its close and its table guard.
    owners: Mutex<HashMap<u64, Owner>>,
    /// Events ready for reuse.
    free_events: Mutex<Vec<usize>>,
}

/// One engine's CUDA copy machinery (see the module doc).
pub(crate) struct Gpu {
    shared: Arc<Shared>,
    /// The device whose primary context runs the copies.
    pub(crate) ordinal: u8,
    streams: Vec<usize>,
    next: AtomicUsize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Gpu {
    /// Creates `streams` non-blocking streams on device `ordinal` and starts the completion
    /// thread.
    pub(crate) fn new(ordinal: u8, streams: usize) -> Result<Arc<Gpu>> {
        let d = crate::cuda::driver()?;
        let ctx = primary_context(d, ordinal)? as usize;
        let _g = CtxGuard::enter(d, ordinal)?;
        let mut made = Vec::with_capacity(streams.max(1));
        for _ in 0..streams.max(1) {
            let mut s: CuHandle = std::ptr::null_mut();
            // SAFETY: a valid out-parameter; the device's context is current.
            let rc = unsafe { (d.stream_create)(&mut s, driver::STREAM_NON_BLOCKING) };
            if let Err(e) = check(d, rc, "cuStreamCreate", Status::Failed) {
                for s in made {
                    // SAFETY: streams made above, unused.
                    unsafe { (d.stream_destroy)(s as CuHandle) };
                }
                return Err(e);
            }
            made.push(s as usize);
        }
        let shared = Arc::new(Shared {
            d,
            ctx,
            queue: Mutex::new(Vec::new()),
            bell: Condvar::new(),
            stop: AtomicBool::new(false),
            owners: Mutex::new(HashMap::new()),
            free_events: Mutex::new(Vec::new()),
        });
        let s2 = shared.clone();
        let h = crate::place::spawn("hixl-cuda-done".into(), move || s2.run())
            .map_err(|e| Error::failed(format!("cannot start thread hixl-cuda-done: {e}")))?;
        Ok(Arc::new(Gpu {
            shared,
            ordinal,
            streams: made,
            next: AtomicUsize::new(0),
            thread: Mutex::new(Some(h)),
        }))
    }

    /// The driver.
    pub(crate) fn driver(&self) -> &'static Driver {
        self.shared.d
    }

    /// Issues the copies `segs` (`local` = destination, `remote` = source, both addresses of
    /// this process: device pointers, IPC mappings or host memory), spread over the stream
    /// pool, then hands them to the completion thread, which calls `on_done` once every copy
    /// has finished. Must be called with this device's context current (`CtxGuard`), and
    /// with the owner's table guard held, which `hold` takes again: when the call returns, the
    /// completion thread keeps that guard until the owner's last copy ended, or (when it could
    /// not take it without waiting) these copies have ended already.
    pub(crate) fn copy(&self, owner: u64, segs: &[SegPair], on_done: OnDone, hold: TryHold) {
        let d = self.shared.d;
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut events = Vec::new();
        let mut failed = None;
        for (stream, share) in plan::spread(segs, self.streams.len(), first, MIN_SHARE) {
            let s = self.streams[stream] as CuHandle;
            for c in &share {
                // SAFETY: both ranges are mapped in this process for the copy's life: the local
                // one lies in a region pinned until the part is reported, the remote one in a
                // peer allocation opened (or a peer mapping made) by the link, which is closed
                // only after its copies ended.
                let rc = unsafe { (d.memcpy_async)(c.local, c.remote, c.len as usize, s) };
                if let Err(e) = check(d, rc, "cuMemcpyAsync", Status::Failed) {
                    failed = Some(e);
                    break;
                }
            }
            match self.shared.event() {
                Ok(ev) => {
                    // SAFETY: a live event and stream of this context.
                    let rc = unsafe { (d.event_record)(ev as CuHandle, s) };
                    match check(d, rc, "cuEventRecord", Status::Failed) {
                        Ok(()) => events.push(ev),
                        Err(e) => {
                            self.shared.free_events.lock().unwrap().push(ev);
                            // Without an event, wait for the stream here (bounded by the GPU).
                            // SAFETY: a live stream of this context.
                            unsafe { (d.stream_synchronize)(s) };
                            failed.get_or_insert(e);
                        }
                    }
                }
                Err(e) => {
                    // No event for this share: wait for its stream here instead.
                    // SAFETY: a live stream of this context.
                    unsafe { (d.stream_synchronize)(s) };
                    failed.get_or_insert(e);
                }
            }
            if failed.is_some() {
                break;
            }
        }
        let finished = Arc::new(AtomicBool::new(false));
        let held = {
            let mut owners = self.shared.owners.lock().unwrap();
            let o = owners.entry(owner).or_default();
            o.in_flight += 1;
            // While this copy counts, the completion thread cannot let go of a guard it keeps.
            o.held
        };
        let answer = (!held).then(|| Arc::new((Mutex::new(None), Condvar::new())));
        let f = InFlight {
            owner,
            events,
            failed,
            on_done,
            finished: finished.clone(),
            hold: answer.clone().map(|a| (hold, a)),
        };
        self.shared.queue.lock().unwrap().push(f);
        self.shared.bell.notify_one();
        let Some(answer) = answer else { return };
        if wait_answer(&answer) {
            return;
        }
        // The guard could not be kept (a table update is waiting for it): these copies end
        // before the caller lets go of its own guard.
        let end = Instant::now() + HOLD_WAIT;
        while !finished.load(Ordering::Acquire) {
            if Instant::now() >= end {
                tracing::warn!("a CUDA copy did not end within {HOLD_WAIT:?}");
                return;
            }
            std::thread::sleep(POLL);
        }
    }

    /// Copies issued by `owner` that have not been reported yet.
    pub(crate) fn in_flight(&self, owner: u64) -> usize {
        self.shared.owners.lock().unwrap().get(&owner).map_or(0, |o| o.in_flight)
    }

    /// Waits until `owner` has no copy in flight, at most `limit`; whether it has none.
    pub(crate) fn drain(&self, owner: u64, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        while self.in_flight(owner) > 0 {
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.bell.notify_all();
        if let Some(h) = self.thread.lock().unwrap().take() {
            let _ = h.join();
        }
        let d = self.shared.d;
        let _ctx = CtxGuard::enter(d, self.ordinal);
        for s in &self.streams {
            // SAFETY: our streams; the completion thread has reported every copy on them.
            unsafe { (d.stream_destroy)(*s as CuHandle) };
        }
        for ev in self.shared.free_events.lock().unwrap().drain(..) {
            // SAFETY: our events, no longer recorded on any stream.
            unsafe { (d.event_destroy)(ev as CuHandle) };
        }
    }
}

impl Shared {
    /// A free event, or a new one (timing disabled: the cheapest kind).
    fn event(&self) -> Result<usize> {
        if let Some(ev) = self.free_events.lock().unwrap().pop() {
            return Ok(ev);
        }
        let mut ev: CuHandle = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; the caller made our context current.
        let rc = unsafe { (self.d.event_create)(&mut ev, driver::EVENT_DISABLE_TIMING) };
        check(self.d, rc, "cuEventCreate", Status::Failed)?;
        Ok(ev as usize)
    }

    /// The completion thread: polls the events of every copy in flight, reports each copy when
    /// all its events fired, sleeps on the bell when nothing is in flight.
    fn run(self: Arc<Self>) {
        // SAFETY: the retained primary context of our device; this thread's own.
        unsafe { (self.d.ctx_set_current)(self.ctx as CuHandle) };
        let mut work: Vec<InFlight> = Vec::new();
        // The table guards kept, by owner (made, kept and dropped on this thread only).
        let mut kept: HashMap<u64, Held> = HashMap::new();
        loop {
            let fresh = {
                let mut q = self.queue.lock().unwrap();
                if work.is_empty() && q.is_empty() {
                    if self.stop.load(Ordering::Acquire) {
                        return;
                    }
                    q = self.bell.wait_timeout(q, Duration::from_secs(1)).unwrap().0;
                }
                std::mem::take(&mut *q)
            };
            for mut f in fresh {
                if let Some((try_hold, answer)) = f.hold.take() {
                    let ok =
                        kept.contains_key(&f.owner) || try_hold().map(|g| kept.insert(f.owner, g)).is_some();
                    if ok {
                        self.owners.lock().unwrap().entry(f.owner).or_default().held = true;
                    }
                    *answer.0.lock().unwrap() = Some(ok);
                    answer.1.notify_all();
                }
                work.push(f);
            }
            let mut i = 0;
            while i < work.len() {
                match self.poll(&work[i]) {
                    None => i += 1,
                    Some(res) => {
                        let f = work.swap_remove(i);
                        self.free_events.lock().unwrap().extend(&f.events);
                        let res = match f.failed {
                            Some(e) => Err(e),
                            None => res,
                        };
                        (f.on_done)(res);
                        f.finished.store(true, Ordering::Release);
                        let mut owners = self.owners.lock().unwrap();
                        if let Some(o) = owners.get_mut(&f.owner) {
                            o.in_flight -= 1;
                            if o.in_flight == 0 {
                                // The owner's last copy ended: table updates may go on.
                                owners.remove(&f.owner);
                                kept.remove(&f.owner);
                            }
                        }
                    }
                }
            }
            if !work.is_empty() {
                std::thread::sleep(POLL);
            }
        }
    }

    /// None while an event of the copy is pending; else its result.
    fn poll(&self, f: &InFlight) -> Option<Result<()>> {
        for ev in &f.events {
            // SAFETY: a live event recorded on one of our streams.
            let rc = unsafe { (self.d.event_query)(*ev as CuHandle) };
            if rc == driver::ERROR_NOT_READY {
                return None;
            }
            if let Err(e) = check(self.d, rc, "a CUDA copy", Status::Failed) {
                return Some(Err(e));
            }
        }
        Some(Ok(()))
    }
}

/// An engine's `Gpu`, made on the first copy that needs it, not at connect: an engine on a GPU
/// machine that only ever moves host memory creates no CUDA context, stream or thread. Its
/// device is the one of the first device region registered (else `cuda:0`).
#[derive(Default)]
pub(crate) struct GpuSlot {
    gpu: Mutex<Option<Arc<Gpu>>>,
    home: Mutex<Option<u8>>,
    has_device: AtomicBool,
}

impl GpuSlot {
    /// Notes that this engine registered memory of device `ordinal`.
    pub(crate) fn note_device(&self, ordinal: u8) {
        self.home.lock().unwrap().get_or_insert(ordinal);
        self.has_device.store(true, Ordering::Release);
    }

    /// Whether this engine has registered device memory (else every local address is host).
    pub(crate) fn has_device(&self) -> bool {
        self.has_device.load(Ordering::Acquire)
    }

    /// The `Gpu`, made now (with `streams` streams) if it was not yet.
    pub(crate) fn get(&self, streams: usize) -> Result<Arc<Gpu>> {
        let mut g = self.gpu.lock().unwrap();
        if let Some(g) = &*g {
            return Ok(g.clone());
        }
        let made = Gpu::new(self.home.lock().unwrap().unwrap_or(0), streams)?;
        *g = Some(made.clone());
        Ok(made)
    }

    /// The `Gpu`, if it was made.
    pub(crate) fn current(&self) -> Option<Arc<Gpu>> {
        self.gpu.lock().unwrap().clone()
    }
}
