//! The initiator's side of staging: the engine's [`Stager`] runs requests over `tcp` that
//! touch device memory (handed over by [`super::StagedPath`]), chunk by chunk, as ordinary
//! host transfers on the link's inner path.
//!
//! A job is the parts of one request, whose segments are put back together first (the
//! engine's split cut some of them where one part ends and the next begins), so that the
//! chunks are those of the whole request however it was split. Each chunk is a *child*
//! request of one part whose local side is a pinned slot (or, when only the peer's memory is
//! on a device, the caller's host memory). Children are counted as accounted from birth, so
//! the link's completer settles them without counting them in the peer's stats; the caller's
//! request is counted once, when the stager finishes its last part, after the last chunk's
//! copy ended. A slot is used again only when its child's part was reported by the link (its
//! bytes left the socket or the link closed), and the caller's parts are finished only after
//! every child and every copy ended (each part keeps the request's pins), so the caller's
//! regions stay pinned for as long as anything touches them.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{device_of, unsupported_here, CopyStream, PinnedBuf};
use crate::complete::Completer;
use crate::cuda::stage_plan::{chunks, Act, Chunk, Flow, Pipeline};
use crate::error::{Error, Result};
use crate::queue::{Part, PartBody, PinSet, Request, SegPair, TransferOp, TransferStatus};
use crate::sys::mem::PinnedMemory;
use crate::transport::control::channel::ControlChannel;
use crate::transport::DataPath;
use crate::wire::MAX_DESCS;

/// Worker threads of an engine's stager (`hixl-stage<i>`), made at the first staged request:
/// each runs one request at a time with its own ring per device, so this many staged
/// requests overlap. Fixed: the pipeline inside a request is what keeps the link busy.
const WORKERS: usize = 2;

/// One staged request.
struct Job {
    /// The path the chunks go over (the inner path of a `StagedPath`).
    link: Arc<dyn DataPath>,
    /// The link's control channel: the notification after the data goes over it.
    control: Arc<dyn ControlChannel>,
    req: Arc<Request>,
    /// The request's parts (those this job runs), finished together when it ends.
    parts: Vec<Part>,
    /// The request's pins (its parts hold them too): where its copies' local ranges must lie.
    pins: Option<Arc<PinSet>>,
    segs: Vec<SegPair>,
    /// The device of the local memory; None: local memory is host memory (the peer stages).
    device: Option<u8>,
}

/// The engine's staging workers and their settings.
pub(crate) struct Stager {
    chunk: u64,
    depth: usize,
    tx: Mutex<Option<Sender<Job>>>,
    rx: Arc<Mutex<Receiver<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Stager {
    /// A stager with slots of `chunk` bytes, `depth` per request (no thread yet).
    pub(crate) fn new(chunk: u64, depth: usize) -> Stager {
        let (tx, rx) = channel();
        Stager {
            chunk: chunk.max(1),
            depth: depth.max(1),
            tx: Mutex::new(Some(tx)),
            rx: Arc::new(Mutex::new(rx)),
            workers: Mutex::new(Vec::new()),
        }
    }

    /// Takes `parts` (at least one), parts of one request that touches device memory, to run
    /// over `link`; the device of the request's local memory is that of its first pinned
    /// device region, if any. Err, with the parts back (nothing queued): UNSUPPORTED when CUDA
    /// is needed here and not found, or the stager cannot run.
    pub(crate) fn submit(
        &self,
        link: Arc<dyn DataPath>,
        control: Arc<dyn ControlChannel>,
        parts: Vec<Part>,
    ) -> std::result::Result<(), (Error, Vec<Part>)> {
        let req = parts[0].req.clone();
        let pins = req.pin_set();
        let device = pins.as_deref().and_then(|p| device_of(p.pins()));
        if device.is_some() {
            if let Some(e) = unsupported_here("staging device memory over TCP") {
                return Err((e, parts));
            }
        }
        if let Err(e) = self.start() {
            return Err((e, parts));
        }
        let in_one_region = |s: &SegPair| {
            let local =
                pins.as_deref().is_some_and(|p| p.pins().iter().any(|p| p.region().contains(s.local, s.len)));
            local && control.table().contains(s.remote, s.len)
        };
        let segs = request_segs(&parts, in_one_region);
        let tx = self.tx.lock().unwrap();
        let Some(tx) = tx.as_ref() else {
            return Err((Error::not_connected("the engine is finalizing"), parts));
        };
        tx.send(Job { link, control, req, parts, pins, segs, device })
            .map_err(|e| (Error::not_connected("the stager has stopped"), e.0.parts))
    }

    fn start(&self) -> Result<()> {
        let mut w = self.workers.lock().unwrap();
        while w.len() < WORKERS {
            let (rx, chunk, depth) = (self.rx.clone(), self.chunk, self.depth);
            let h = crate::place::spawn(format!("hixl-stage{}", w.len()), move || work(&rx, chunk, depth))
                .map_err(|e| Error::failed(format!("cannot start a staging thread: {e}")))?;
            w.push(h);
        }
        Ok(())
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        self.tx.lock().unwrap().take();
        let me = std::thread::current().id();
        for h in self.workers.lock().unwrap().drain(..) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}

/// The segments of a request, in order, from the bodies of `parts`. Where the engine's split
/// cut a segment, the piece that ends one part continues the piece that starts the next on
/// both sides and the two lie in one region on each side (`in_one_region`): they are joined
/// again. Two segments that validation left apart never are: it merged every such pair that
/// lies in one region on each side.
fn request_segs(parts: &[Part], in_one_region: impl Fn(&SegPair) -> bool) -> Vec<SegPair> {
    let mut segs: Vec<SegPair> = Vec::new();
    for p in parts {
        let mut first = true;
        let mut add = |chunk: &[SegPair]| {
            let mut rest = chunk;
            if let (true, Some((s, tail)), Some(last)) = (first, chunk.split_first(), segs.last_mut()) {
                let joined = SegPair { local: last.local, remote: last.remote, len: last.len + s.len };
                if last.local + last.len == s.local
                    && last.remote + last.len == s.remote
                    && in_one_region(&joined)
                {
                    *last = joined;
                    rest = tail;
                }
            }
            first &= chunk.is_empty();
            segs.extend_from_slice(rest);
        };
        match &p.body {
            PartBody::Data(s) => add(s),
            PartBody::Strided(st) => {
                let _ = st.for_each_chunk(4096, |c| {
                    add(c);
                    Ok::<(), ()>(())
                });
            }
            PartBody::Notify(_) => {}
        }
    }
    segs
}

/// A worker's bounce slots and copy stream on one device.
struct Ring {
    /// Shared with the child parts in flight, which keep it while they may touch a slot.
    buf: Arc<PinnedBuf>,
    stream: CopyStream,
    chunk: u64,
    depth: usize,
}

impl Ring {
    /// Where chunk `k`'s slot starts in the buffer.
    fn slot_offset(&self, k: usize) -> u64 {
        (k % self.depth) as u64 * self.chunk
    }

    /// The address of chunk `k`'s slot.
    fn slot(&self, k: usize) -> u64 {
        self.buf.addr() + self.slot_offset(k)
    }
}

fn work(rx: &Mutex<Receiver<Job>>, chunk: u64, depth: usize) {
    let mut rings: Vec<Ring> = Vec::new();
    loop {
        let job = match rx.lock().unwrap().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let res = run(&mut rings, &job, chunk, depth);
        finish(job, res);
    }
}

/// The ring of `ordinal`, made on first use.
fn ring(rings: &mut Vec<Ring>, ordinal: u8, chunk: u64, depth: usize) -> Result<&Ring> {
    if let Some(i) = rings.iter().position(|r| r.stream.ordinal() == ordinal) {
        return Ok(&rings[i]);
    }
    let buf = PinnedBuf::new(chunk * depth as u64)?;
    let stream = CopyStream::new(ordinal, depth)?;
    rings.push(Ring { buf: Arc::new(buf), stream, chunk, depth });
    Ok(rings.last().expect("just pushed"))
}

/// Runs one staged request's pipeline; Err: the first failure. Returns only after every copy
/// and every child transfer it started has ended.
fn run(rings: &mut Vec<Ring>, job: &Job, chunk: u64, depth: usize) -> Result<()> {
    let plan = chunks(&job.segs, chunk, MAX_DESCS);
    let flow = match (job.device, job.req.op) {
        (None, _) => Flow::NetOnly,
        (Some(_), TransferOp::Write) => Flow::CopyThenNet,
        (Some(_), TransferOp::Read) => Flow::NetThenCopy,
    };
    let ring = match job.device {
        Some(o) => Some(ring(rings, o, chunk, depth)?),
        None => None,
    };
    let _ctx = ring.map(|r| r.stream.enter()).transpose()?;
    let mut pipe = Pipeline::new(plan.len(), depth, flow);
    let mut children: Vec<Option<Arc<Request>>> = vec![None; plan.len()];
    let mut failed: Option<Error> = None;
    loop {
        if job.req.status() != TransferStatus::Waiting {
            failed = Some(job.req.error().unwrap_or_else(|| Error::timeout("the request ended")));
            break;
        }
        let act = pipe.next();
        let step = match act {
            Act::Done => break,
            Act::Copy(k) => copy(ring, job.pins.as_ref(), &plan[k], k, job.req.op),
            Act::WaitCopy(k) => ring.map_or(Ok(()), |r| r.stream.wait(k % r.depth)),
            Act::Net(k) => {
                let (segs, memory) = match ring {
                    Some(r) => (plan[k].net_segs(r.slot(k)), Some(r.buf.clone() as Arc<dyn PinnedMemory>)),
                    None => (plan[k].direct_segs(), job.req.pin_set().map(|p| p as Arc<dyn PinnedMemory>)),
                };
                send(job, &plan[k], segs, memory).map(|c| children[k] = Some(c))
            }
            Act::WaitNet(k) => wait_child(children[k].as_ref().expect("sent before waited for")),
        };
        match step {
            Ok(()) => pipe.did(act),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    // Nothing may still touch the slots or the caller's memory when this returns.
    if let Some(r) = ring {
        if let Err(e) = r.stream.sync() {
            failed.get_or_insert(e);
        }
    }
    drain(&children);
    failed.map_or(Ok(()), Err)
}

/// Issues the copies of chunk `k` between the caller's device memory (in the request's
/// `pins`) and its slot, then records the slot's event. The stream keeps the ring's buffer and
/// the pins until `run` synchronises it; the slot is used again only after its event
/// (`Act::WaitCopy`) and its chunk's transfer ended.
fn copy(ring: Option<&Ring>, pins: Option<&Arc<PinSet>>, c: &Chunk, k: usize, op: TransferOp) -> Result<()> {
    let Some(r) = ring else { return Ok(()) };
    let Some(pins) = pins else { return Err(Error::failed("a staged request has no pinned regions")) };
    let slot = r.slot_offset(k);
    for (local, off, len) in c.copies() {
        r.stream.copy_kept(&r.buf, slot + off, pins, local, len, op == TransferOp::Read)?;
    }
    r.stream.record(k % r.depth)
}

/// Hands one chunk to the link as a child request.
/// `memory`: what keeps the chunk's local ranges valid (the ring's buffer, or the caller's
/// pins); a child without it is refused by the link.
fn send(
    job: &Job,
    c: &Chunk,
    segs: Vec<SegPair>,
    memory: Option<Arc<dyn PinnedMemory>>,
) -> Result<Arc<Request>> {
    let req = &job.req;
    let left = req.deadline().saturating_duration_since(Instant::now());
    let child = Arc::new(Request::new(
        req.id,
        req.op,
        req.peer.clone(),
        c.bytes,
        c.pieces.len(),
        1,
        left,
        Vec::new(),
        None,
    ));
    // Counted with the caller's request, not on its own.
    child.account(job.link.backend());
    let body = PartBody::Data(segs);
    let part = match memory {
        Some(m) => Part::in_memory(child.clone(), body, m),
        None => Part::new(child.clone(), body),
    };
    job.link.submit(vec![part])?;
    Ok(child)
}

fn wait_child(child: &Request) -> Result<()> {
    match child.wait(None) {
        TransferStatus::Completed => Ok(()),
        _ => Err(child.error().unwrap_or_else(|| Error::timeout("a staged chunk did not finish in time"))),
    }
}

/// Waits until the link reported every child's part (a child settled by its deadline may
/// still be on the wire, reading from or writing into memory the caller or the ring owns).
/// The link reports every part it took, at the latest when it closes.
fn drain(children: &[Option<Arc<Request>>]) {
    let start = Instant::now();
    let mut warned = false;
    for c in children.iter().flatten() {
        while c.parts_outstanding() > 0 {
            if !warned && start.elapsed() > Duration::from_secs(10) {
                warned = true;
                tracing::warn!(peer = %c.peer, "a staged chunk is still on its link after 10 s; waiting for it");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Finishes the caller's parts: the last settles the request, or sends the notification
/// after the data.
fn finish(job: Job, res: Result<()>) {
    let done = Completer::new(job.link.backend(), &job.req.peer, job.link.stats());
    for part in job.parts {
        job.control.finish_after(&done, part, res.clone());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::split;
    use crate::queue::Strided;

    fn sp(local: u64, remote: u64, len: u64) -> SegPair {
        SegPair { local, remote, len }
    }

    fn parts(bodies: Vec<PartBody>) -> Vec<Part> {
        let bytes = bodies.iter().map(PartBody::bytes).sum();
        let req = Arc::new(Request::new(
            1,
            TransferOp::Write,
            "p",
            bytes,
            1,
            bodies.len(),
            Duration::from_secs(5),
            Vec::new(),
            None,
        ));
        bodies.into_iter().map(|b| Part::new(req.clone(), b)).collect()
    }

    /// Whether `s` lies in one of `local` and one of `remote` (regions as (start, end)).
    fn within(local: &[(u64, u64)], remote: &[(u64, u64)], s: &SegPair) -> bool {
        let inside = |rs: &[(u64, u64)], a: u64| rs.iter().any(|(b, e)| *b <= a && a + s.len <= *e);
        inside(local, s.local) && inside(remote, s.remote)
    }

    #[test]
    fn a_split_request_is_staged_as_the_segments_it_had_before_the_split() {
        // Local regions [0, 30) and [30, 200), one remote region: the second segment continues
        // the first on both sides but lies in another local region (validation kept it apart).
        let (local, remote) = ([(0, 30), (30, 200)], [(1000, 3000)]);
        let segs = vec![sp(0, 1000, 30), sp(30, 1030, 10), sp(100, 2000, 10)];
        let split_parts = split(segs.clone(), 50, 2, 16);
        assert_eq!(split_parts.len(), 2, "cut inside the first segment");
        let p = parts(split_parts.into_iter().map(PartBody::Data).collect());
        assert_eq!(request_segs(&p, |s| within(&local, &remote, s)), segs);

        // A part boundary that falls between two such segments does not join them.
        let (local, remote) = ([(0, 20), (20, 40)], [(1000, 1040)]);
        let segs = vec![sp(0, 1000, 20), sp(20, 1020, 20)];
        let p = parts(split(segs.clone(), 40, 2, 16).into_iter().map(PartBody::Data).collect());
        assert_eq!(p.len(), 2);
        assert_eq!(request_segs(&p, |s| within(&local, &remote, s)), segs);

        // Unsplit, the segments stay as they are.
        let p = parts(vec![PartBody::Data(segs.clone())]);
        assert_eq!(request_segs(&p, |_| true), segs);
    }

    struct Holder(u64);

    impl crate::registry::Abort for Holder {
        fn abort(&self, _: &str) {}

        fn holder_id(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn a_staged_copy_must_lie_in_the_requests_pinned_regions() {
        // Two adjacent device regions (never touched: only their bounds count) and one apart.
        let reg = crate::registry::Registry::new();
        let holder: Arc<dyn crate::registry::Abort> = Arc::new(Holder(crate::registry::new_holder_id()));
        let pins: Vec<_> = [(0x10000, 0x100), (0x10100, 0x100), (0x20000, 0x100)]
            .iter()
            .map(|&(a, n)| reg.register(a, n, crate::MemType::Cuda(0)).unwrap().pin(&holder).unwrap())
            .collect();
        let set = PinSet::new(pins);
        assert!(set.in_regions(0x10000, 0x100));
        assert!(set.in_regions(0x10080, 0x100), "joined across two adjacent regions");
        assert!(set.in_regions(0x20000, 0x100));
        assert!(!set.in_regions(0x10100, 0x101), "past the second region");
        assert!(!set.in_regions(0xff00, 0x200), "before the first");
        assert!(!set.in_regions(0x10180, 0xfe80 + 0x100), "across the gap");
        assert!(!set.in_regions(u64::MAX, 2));
    }

    #[test]
    fn a_split_strided_request_is_staged_as_its_whole_expansion() {
        let whole = |st: Strided| {
            let mut segs = Vec::new();
            let _ = st.for_each_chunk(4096, |c| {
                segs.extend_from_slice(c);
                Ok::<(), ()>(())
            });
            segs
        };
        let contiguous = Strided { local: 0, remote: 1000, count: 8, size: 16, lstride: 16, rstride: 16 };
        let gapped = Strided { lstride: 32, ..contiguous };
        for st in [contiguous, gapped] {
            let p = parts(st.split(3).into_iter().map(PartBody::Strided).collect());
            assert_eq!(p.len(), 3);
            assert_eq!(request_segs(&p, |_| true), whole(st), "{st:?}");
        }
        assert_eq!(whole(contiguous), vec![sp(0, 1000, 128)]);
    }
}
