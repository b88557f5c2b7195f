//! The target's side of staging: a served WRITE or READ frame whose ranges lie in device
//! regions of this engine's registry. The served streams ask the engine's [`DeviceStaging`]
//! (their [`TargetStaging`] hook) after they checked and pinned a frame's ranges; only then
//! does anything here run.
//!
//! - WRITE: the frame's bytes are received into a pinned buffer (across as many wake-ups as
//!   they take, like host bytes), their data MAC is checked there, then they are copied to
//!   the device and the frame is answered once that copy ended.
//! - READ: the ranges are copied from the device into a pinned buffer, and the answer's bytes
//!   are sent from it (the buffer is held by the send job until its bytes left).
//!
//! A frame here carries at most [`MAX_FRAME`] bytes (a staging initiator sends chunks of
//! `hixl.cuda.stage_chunk` bytes, at most that much). The copies run on the I/O worker that
//! handles the frame, so they overlap with the other streams and with the socket buffers
//! filling; within one stream a frame's copy waits for its bytes and the next frame's bytes
//! wait in the socket for that copy.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use super::budget::{StageBudget, Ticket};
use super::{CopyStream, PinnedBuf};
use crate::auth::{self, MAC_LEN};
use crate::cuda::driver::owned::{PinnedBytes, PinnedPrefix};
pub(crate) use crate::cuda::stage_plan::MAX_FRAME;
use crate::error::{Error, Result, Status};
use crate::registry::Pin;
use crate::transport::io::nbio::{FrameReader, IoJob, Step};
use crate::transport::io::ranges::PinnedFrame;
use crate::transport::{StagedWrite, TargetStaging};
use crate::wire::Frame;

/// Idle buffers kept for later frames (per process); more are freed when returned.
const KEEP: usize = 8;

/// Whether any of a frame's pinned regions is device memory (then it is staged here).
fn touches_device(pins: &[Pin]) -> bool {
    pins.iter().any(|p| p.region().mem_type.is_device())
}

/// A pinned buffer and a copy stream of one device, lent to one frame.
struct Lease {
    /// Shared with the socket job that receives into it ([`PinnedPrefix`]); whole again
    /// when that job has dropped, and then kept for later frames.
    buf: Option<Arc<PinnedBuf>>,
    stream: Option<CopyStream>,
    /// Its bytes in the engine's and the peer's staging budget, given back with it.
    _ticket: Ticket,
}

/// Whose budget a frame's lease counts against: the engine's, for the stream's peer.
struct Lender<'a> {
    /// The engine's budget.
    pub(crate) budget: &'a Arc<StageBudget>,
    /// The peer (see [`super::budget::peer_key`]).
    pub(crate) peer: &'a str,
}

static IDLE: Mutex<Vec<(PinnedBuf, CopyStream)>> = Mutex::new(Vec::new());

impl Lease {
    /// At least `len` bytes with a stream of device `ordinal`, counted against `lender`'s
    /// caps (RESOURCE_EXHAUSTED over one).
    fn take(ordinal: u8, len: u64, lender: &Lender) -> Result<Lease> {
        let idle = {
            let mut idle = IDLE.lock().unwrap();
            let i = idle.iter().position(|(b, s)| b.len() >= len && s.ordinal() == ordinal);
            i.map(|i| idle.swap_remove(i))
        };
        let size = match &idle {
            Some((b, _)) => b.len(),
            None => len.max(4 << 20).next_power_of_two().min(MAX_FRAME.max(len)),
        };
        let ticket = match lender.budget.take(lender.peer, size) {
            Ok(t) => t,
            Err(e) => {
                if let Some(x) = idle {
                    IDLE.lock().unwrap().push(x);
                }
                return Err(e);
            }
        };
        let (b, s) = match idle {
            Some(x) => x,
            None => (PinnedBuf::new(size)?, CopyStream::new(ordinal, 1)?),
        };
        Ok(Lease { buf: Some(Arc::new(b)), stream: Some(s), _ticket: ticket })
    }

    /// The buffer's first `len` bytes, as ranges a socket job or a hash may take.
    fn prefix(&self, len: u64) -> Result<PinnedPrefix> {
        self.buf
            .clone()
            .and_then(|b| PinnedPrefix::new(b, len))
            .ok_or_else(|| Error::failed(format!("a staging buffer holds fewer than {len} bytes")))
    }

    /// Copies between the buffer (from offset 0, in order) and the frame's ranges (walked
    /// lazily, a strided frame's touching elements as one copy), and waits for it.
    fn copy(&self, frame: &PinnedFrame, to_device: bool) -> Result<()> {
        let s = self.stream.as_ref().expect("a lent stream");
        let buf = self.buf.as_ref().expect("a lent buffer");
        let _ctx = s.enter()?;
        // The frame's ranges lie in registered regions its pins keep for the whole call; the
        // buffer holds at least the frame's bytes (`take`, after `check_size`).
        s.copy_pinned(buf, frame, to_device)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let (Some(b), Some(s)) = (self.buf.take(), self.stream.take()) {
            // Still shared (a job that outlived the lease): freed with its last share.
            let Ok(b) = Arc::try_unwrap(b) else { return };
            let mut idle = IDLE.lock().unwrap();
            if idle.len() < KEEP {
                idle.push((b, s));
            }
        }
    }
}

fn device(pins: &[Pin]) -> u8 {
    super::device_of(pins).unwrap_or(0)
}

fn check_size(bytes: u64) -> Result<()> {
    if bytes > MAX_FRAME {
        return Err(Error::param(format!(
            "a frame into or out of device memory carries at most {MAX_FRAME} bytes here, this one {bytes} \
             (staging initiators send chunks of hixl.cuda.stage_chunk bytes)"
        )));
    }
    if let Some(e) = super::unsupported_here("the target stages device memory over TCP") {
        return Err(e);
    }
    Ok(())
}

/// A WRITE into device memory being received.
pub(crate) struct DeviceWrite {
    /// The frame's tag (its answer's).
    tag: u64,
    bulk: u64,
    /// Receives into the lease's buffer, a share of which it keeps. Declared before `lease`,
    /// so that it drops first and the lease gets its buffer back whole.
    job: IoJob,
    /// The frame's device ranges and the pins that keep them registered.
    frame: PinnedFrame,
    lease: Lease,
    hasher: Option<blake3::Hasher>,
    mac: [u8; MAC_LEN],
    mac_got: usize,
}

/// Starts receiving a WRITE of `bulk` bytes into the device ranges of `frame` (checked and
/// pinned); Err: refuse it (the caller skips its bytes and answers with the error).
fn start_write(
    tag: u64,
    bulk: u64,
    frame: PinnedFrame,
    hasher: Option<blake3::Hasher>,
    lender: &Lender,
) -> Result<DeviceWrite> {
    // Sizes first (nothing here expands the ranges into memory: they are walked in `copy`).
    match frame.ranges().bytes() {
        Some(sum) if sum == bulk => {}
        sum => {
            let sum = sum.map_or("more than 2^64".into(), |s| s.to_string());
            return Err(Error::param(format!("the frame's ranges hold {sum} bytes, its bulk {bulk}")));
        }
    }
    check_size(bulk)?;
    let lease = Lease::take(device(frame.pins()), bulk, lender)?;
    let mut job = IoJob::default();
    // The job receives into the buffer's first `bulk` bytes and keeps that share of it.
    job.push_pinned(lease.prefix(bulk)?);
    Ok(DeviceWrite { tag, bulk, job, frame, lease, hasher, mac: [0; MAC_LEN], mac_got: 0 })
}

impl StagedWrite for DeviceWrite {
    fn tag(&self) -> u64 {
        self.tag
    }

    /// Receives what has arrived (bytes, then their data MAC) through the stream's frame
    /// reader (which hands out what it read ahead first), at most about `budget` bytes.
    fn recv(&mut self, fd: RawFd, frames: &mut FrameReader, budget: &mut u64) -> std::io::Result<Step> {
        if frames.recv_job(fd, &mut self.job, budget)? == Step::WouldBlock {
            return Ok(Step::WouldBlock);
        }
        if self.hasher.is_some() {
            return frames.fill(fd, &mut self.mac, &mut self.mac_got);
        }
        Ok(Step::Done)
    }

    /// After `recv` is done: checks the data MAC, copies the bytes to the device and says how
    /// to answer. Some(error): the stream must close after the answer (altered bytes).
    fn finish(self: Box<Self>) -> (Frame, Option<std::io::Error>) {
        if let Some(mut h) = self.hasher.clone() {
            // The `bulk` bytes just received.
            match self.lease.prefix(self.bulk) {
                Ok(bytes) => crate::sys::mem::for_each_slice(&bytes, |b| {
                    h.update(b);
                }),
                Err(e) => return (Frame::Ack { status: e.code(), message: e.message }, None),
            }
            if !auth::constant_eq(&auth::data_mac(&h), &self.mac) {
                let message =
                    "the written bytes do not match their data MAC (altered on the way); closing the stream";
                let f = Frame::Ack { status: Status::Failed.code(), message: message.into() };
                return (f, Some(std::io::Error::new(std::io::ErrorKind::InvalidData, message)));
            }
        }
        match self.lease.copy(&self.frame, true) {
            Ok(()) => (Frame::Ack { status: 0, message: String::new() }, None),
            Err(e) => (Frame::Ack { status: e.code(), message: e.message }, None),
        }
    }
}

/// The bytes of a READ from the device ranges of `frame` (checked and pinned), copied into a
/// pinned buffer: its first `total` bytes, which keep the lease and the frame until the
/// answer's bytes were sent.
fn stage_read(frame: PinnedFrame, total: u64, lender: &Lender) -> Result<PinnedBytes> {
    check_size(total)?;
    let lease = Lease::take(device(frame.pins()), total, lender)?;
    lease.copy(&frame, false)?;
    let bytes = lease.prefix(total)?;
    Ok(PinnedBytes::new(bytes, Box::new((lease, frame))))
}

/// The engine's [`TargetStaging`]: device frames through pinned buffers, lent against the
/// engine's staging budget.
#[derive(Default)]
pub(crate) struct DeviceStaging {
    /// The pinned staging memory the served streams may hold at once.
    budget: Arc<StageBudget>,
}

impl DeviceStaging {
    fn lender<'a>(&'a self, peer_addr: &'a str) -> Lender<'a> {
        Lender { budget: &self.budget, peer: super::budget::peer_key(peer_addr) }
    }
}

impl TargetStaging for DeviceStaging {
    fn stages(&self, frame: &PinnedFrame) -> bool {
        touches_device(frame.pins())
    }

    fn start_write(
        &self,
        tag: u64,
        bulk: u64,
        frame: PinnedFrame,
        hasher: Option<blake3::Hasher>,
        peer_addr: &str,
    ) -> Result<Box<dyn StagedWrite>> {
        Ok(Box::new(start_write(tag, bulk, frame, hasher, &self.lender(peer_addr))?))
    }

    fn stage_read(&self, frame: PinnedFrame, total: u64, peer_addr: &str) -> Result<PinnedBytes> {
        stage_read(frame, total, &self.lender(peer_addr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{new_holder_id, Abort, Registry};
    use crate::transport::io::ranges::OwnedRanges;
    use crate::wire::{Domain, Seg};

    /// A pin holder that is never aborted in these tests.
    struct Holder(u64);

    impl Abort for Holder {
        fn abort(&self, _why: &str) {}

        fn holder_id(&self) -> u64 {
            self.0
        }
    }

    /// `segs` checked against a registry holding 0x1000+0x100 and pinned (no byte is touched:
    /// the frames below are refused before anything moves).
    fn frame(segs: Vec<Seg>) -> (Registry, PinnedFrame) {
        let reg = Registry::new();
        reg.register(0x1000, 0x100, Domain::Host).unwrap();
        let holder: Arc<dyn Abort> = Arc::new(Holder(new_holder_id()));
        let f = PinnedFrame::pin(OwnedRanges::List(segs), &reg, &holder, true).unwrap();
        (reg, f)
    }

    #[test]
    fn device_frames_are_bounded_and_need_cuda() {
        let e = check_size(MAX_FRAME + 1).unwrap_err();
        assert_eq!(e.status, Status::ParamInvalid);
        assert!(e.message.contains("hixl.cuda.stage_chunk"), "{}", e.message);
        if !crate::cuda::info().available {
            let e = check_size(4096).unwrap_err();
            assert_eq!(e.status, Status::Unsupported);
            assert!(e.message.contains("CUDA was"), "{}", e.message);
        }
        assert!(!touches_device(&[]));
        let (_reg, f) = frame(vec![Seg { addr: 0x1001, len: 2 }]);
        let budget = Arc::new(StageBudget::default());
        let lender = Lender { budget: &budget, peer: "p" };
        assert!(stage_read(f, MAX_FRAME + 1, &lender).is_err());
    }

    #[test]
    fn a_write_whose_ranges_disagree_with_its_bulk_is_refused() {
        let (_reg, f) = frame(vec![Seg { addr: 0x1000, len: 4 }]);
        let budget = Arc::new(StageBudget::default());
        let lender = Lender { budget: &budget, peer: "p" };
        let e = start_write(1, 10, f, None, &lender).err().expect("4 != 10");
        assert_eq!(e.status, Status::ParamInvalid);
    }
}
