//! A served stream after its handshake: its reader and writer are sources of the engine's
//! reactor, so a fixed set of I/O workers serves every initiator. Every remote range is
//! checked against this engine's registry before a byte is read into it or written from it;
//! a refused frame is answered with PARAM_INVALID and its bulk is discarded, so the stream
//! stays usable. WRITE bytes go from the socket straight into registered memory and READ
//! bytes straight from it, across as many wake-ups as they take.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::auth::{self, FrameMac, MAC_LEN};
use crate::cuda::driver::owned::PinnedBytes;
use crate::error::Status;
use crate::registry::Abort;
use crate::transport::io::nbio::{FrameReader, IoJob, Outbox, Step};
use crate::transport::io::ranges::{OwnedRanges, PinnedFrame};
use crate::transport::io::{self, Received};
use crate::transport::reactor::{Interest, Source};
use crate::transport::target_side::{Served, Server};
use crate::transport::StagedWrite;
use crate::wire::{self, Frame, Header};

/// Bytes a served reader takes per run before the other streams get a turn (many initiators
/// writing at once share the target's workers fairly).
const READ_BUDGET: u64 = 16 << 20;
/// The reader stops taking frames while this many answers wait to be sent (an initiator
/// that sends READs and never reads the answers holds them back, not the target's memory).
const MAX_QUEUED_JOBS: usize = 256;
/// Likewise, in bytes queued.
const MAX_QUEUED_BYTES: u64 = 64 << 20;

/// The sending half of a served stream, behind one lock: frames are sealed in the order they
/// are queued, and that is the order they are sent in.
pub(crate) struct SendState {
    /// Seals outgoing frames (on an authenticated stream).
    pub(crate) mac: FrameMac,
    /// What waits to be sent.
    pub(crate) out: Outbox,
}

impl SendState {
    pub(crate) fn new() -> SendState {
        SendState { mac: FrameMac::default(), out: Outbox::default() }
    }

    /// Seals a frame and queues it.
    pub(crate) fn queue_sealed(&mut self, b: &mut Vec<u8>) {
        self.mac.seal(b);
        self.out.push_frame(std::mem::take(b));
    }

    /// Everything queued went out: an update sent no longer counts as owed.
    pub(crate) fn flushed(&mut self, s: &Served) {
        if s.sent.load(Ordering::Acquire) >= s.due.load(Ordering::Acquire) {
            *s.due_since.lock().unwrap() = None;
        }
    }

    /// Queues the newest region table (or the changes since what the peer has) when an update
    /// is due: the changes since the version this peer has, or (when the journal no longer
    /// reaches back that far) the whole table.
    pub(crate) fn queue_update(&mut self, s: &Served, ctx: &crate::transport::target_side::ServerCtx) {
        let due = s.due.load(Ordering::Acquire);
        let sent = s.sent.load(Ordering::Acquire);
        if due <= sent || !s.welcomed.load(Ordering::Acquire) {
            return;
        }
        let (version, frame) = match ctx.registry.changes_since(sent) {
            Some(d) if d.version <= sent => {
                s.sent.fetch_max(due, Ordering::AcqRel);
                return;
            }
            Some(d) => (
                d.version,
                Frame::RegionsDelta { from: sent, version: d.version, added: d.added, removed: d.removed },
            ),
            None => {
                let (version, regions) = ctx.registry.table();
                (version, Frame::RegionsUpdate { version, regions })
            }
        };
        let mut frame = wire::encode(&frame, 0, 0);
        let before = self.out.bytes;
        self.queue_sealed(&mut frame);
        s.update_bytes.fetch_add(self.out.bytes - before, Ordering::Relaxed);
        s.sent.fetch_max(version, Ordering::AcqRel);
    }
}

/// Where the receiving side of a served stream is.
pub(crate) enum RxState {
    /// Between frames (or inside a frame's header and payload).
    Frames,
    /// A WRITE's bytes under way into registered memory, then their data MAC.
    Bulk(Box<WriteBulk>),
    /// A refused frame's bytes being skipped; then `ack` answers it.
    Discard { tag: u64, left: u64, ack: Frame },
    /// A WRITE into device memory, received through the target's staging hook
    /// (`ServerCtx::staging`).
    Staged(Box<dyn StagedWrite>),
}

/// A WRITE being received.
pub(crate) struct WriteBulk {
    tag: u64,
    bulk: u64,
    /// Receives into the frame's ranges, and keeps the frame (its pins keep the regions the
    /// bytes go into registered) until they are in.
    job: IoJob<PinnedFrame>,
    hasher: Option<blake3::Hasher>,
    mac: [u8; MAC_LEN],
    mac_got: usize,
}

/// The receiving side of a served stream.
pub(crate) struct ServedRx {
    pub(crate) mac: FrameMac,
    pub(crate) frames: FrameReader,
    pub(crate) state: RxState,
}

impl ServedRx {
    pub(crate) fn new(mac: FrameMac) -> ServedRx {
        ServedRx { mac, frames: FrameReader::after_handshake(true), state: RxState::Frames }
    }
}

/// A served stream's reader, as the reactor runs it.
pub(crate) struct Reader {
    pub(crate) srv: Arc<Server>,
    pub(crate) served: Arc<Served>,
}

/// A served stream's writer, as the reactor runs it.
pub(crate) struct Writer {
    pub(crate) srv: Arc<Server>,
    pub(crate) served: Arc<Served>,
}

impl Source for Reader {
    fn run(&self, _events: u32) -> Interest {
        let res = read_some(&self.srv, &self.served);
        match res {
            Ok(i) => i,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    tracing::info!(from = %self.served.peer_addr, error = %e, "served stream ended");
                }
                self.srv.end_stream(&self.served);
                Interest::Gone
            }
        }
    }
}

impl Source for Writer {
    fn run(&self, _events: u32) -> Interest {
        let s = &self.served;
        match flush(&self.srv, s) {
            Ok(Step::WouldBlock) => Interest::Write,
            Ok(Step::Done) => {
                if s.paused.load(Ordering::Acquire) && !backlogged(s) {
                    s.paused.store(false, Ordering::Release);
                    self.srv.ctx.reactor.schedule(s.reader_token.load(Ordering::Acquire));
                }
                Interest::Idle
            }
            Err(_) => {
                // The reader sees the stream end and cleans up.
                io::shutdown(s.sock.as_raw_fd());
                Interest::Gone
            }
        }
    }
}

/// Sends a due region update and whatever is queued, as far as the socket takes it now.
fn flush(srv: &Server, s: &Served) -> std::io::Result<Step> {
    let mut tx = s.send.lock().unwrap();
    tx.queue_update(s, &srv.ctx);
    let mut budget = u64::MAX;
    let step = tx.out.flush(s.sock.as_raw_fd(), &mut budget)?;
    if step == Step::Done {
        tx.flushed(s);
    }
    Ok(step)
}

/// Sends what each of `streams` has queued (the Acks of stored notifications among it) and
/// waits until the peer's kernel has taken it (its send queue is empty), until `deadline` at
/// most: a finalize closes its streams only after this, so every answer it owes is in the
/// initiator's receive queue before the first stream ends. A stream that ended or whose
/// socket fails is left as it is.
pub(crate) fn drain(srv: &Server, streams: &[Arc<Served>], deadline: std::time::Instant) {
    for s in streams {
        if s.writer_token.load(Ordering::Acquire) == 0 {
            continue; // Still in its handshake: nothing queued here.
        }
        while !s.ended.load(Ordering::Acquire) {
            let sent = match flush(srv, s) {
                Ok(step) => step == Step::Done,
                Err(_) => break,
            };
            let taken = io::queued_bytes(s.sock.as_raw_fd()).is_none_or(|n| n == 0);
            if (sent && taken) || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(DRAIN_POLL);
        }
    }
}

/// How often `drain` looks at a stream's send queue again.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(1);

fn backlogged(s: &Served) -> bool {
    let tx = s.send.lock().unwrap();
    tx.out.len() >= MAX_QUEUED_JOBS || tx.out.bytes >= MAX_QUEUED_BYTES
}

/// Queues an answer (sealed now, so queue order is sequence order) and sends what it can at
/// once; the writer sends the rest when the socket has room.
fn answer(srv: &Server, s: &Served, f: &Frame, tag: u64) -> std::io::Result<()> {
    let mut b = wire::encode(f, tag, 0);
    s.send.lock().unwrap().queue_sealed(&mut b);
    send_now(srv, s)
}

fn send_now(srv: &Server, s: &Served) -> std::io::Result<()> {
    if flush(srv, s)? == Step::WouldBlock {
        srv.ctx.reactor.schedule(s.writer_token.load(Ordering::Acquire));
    }
    Ok(())
}

fn read_some(srv: &Server, s: &Arc<Served>) -> std::io::Result<Interest> {
    let mut rx = s.rx.lock().unwrap();
    rx.frames.begin_run();
    let next = read_frames(srv, s, &mut rx)?;
    Ok(rx.frames.end_run(next))
}

fn read_frames(srv: &Server, s: &Arc<Served>, rx: &mut ServedRx) -> std::io::Result<Interest> {
    let fd = s.sock.as_raw_fd();
    let mut budget = READ_BUDGET;
    loop {
        match std::mem::replace(&mut rx.state, RxState::Frames) {
            RxState::Frames => {}
            RxState::Discard { tag, mut left, ack } => {
                if rx.frames.discard(fd, &mut left, &mut budget)? == Step::WouldBlock {
                    rx.state = RxState::Discard { tag, left, ack };
                    return Ok(Interest::Read);
                }
                answer(srv, s, &ack, tag)?;
            }
            RxState::Staged(mut w) => {
                if w.recv(fd, &mut rx.frames, &mut budget)? == Step::WouldBlock {
                    rx.state = RxState::Staged(w);
                    return Ok(Interest::Read);
                }
                let tag = w.tag();
                let (ack, close) = w.finish();
                answer(srv, s, &ack, tag)?;
                if let Some(e) = close {
                    return Err(e);
                }
            }
            RxState::Bulk(mut w) => {
                let got = rx.frames.recv_job(fd, &mut w.job, &mut budget);
                match got {
                    Ok(Step::WouldBlock) => {
                        rx.state = RxState::Bulk(w);
                        return Ok(Interest::Read);
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                        // Registered memory unmapped or protected since: fail this request,
                        // skip the rest of its bytes, keep the stream.
                        let got = w.job.moved;
                        let message = format!(
                            "the target cannot write its registered memory after byte {got} of this \
                             request (EFAULT: unmapped or write-protected since it was registered)"
                        );
                        let mac_len = if w.hasher.is_some() { MAC_LEN as u64 } else { 0 };
                        let left = w.bulk.saturating_sub(got) + mac_len;
                        let ack = Frame::Ack { status: Status::ParamInvalid.code(), message };
                        rx.state = RxState::Discard { tag: w.tag, left, ack };
                        continue;
                    }
                    Err(e) => return Err(e),
                    Ok(Step::Done) => {}
                }
                if let Some(h) = w.hasher.clone() {
                    let WriteBulk { mac, mac_got, .. } = &mut *w;
                    if rx.frames.fill(fd, mac, mac_got)? == Step::WouldBlock {
                        rx.state = RxState::Bulk(w);
                        return Ok(Interest::Read);
                    }
                    let mut h = h;
                    w.job.owner().hash(&mut h);
                    if !auth::constant_eq(&auth::data_mac(&h), &w.mac) {
                        let message = "the written bytes do not match their data MAC (altered on the way); \
                                       closing the stream";
                        let f = Frame::Ack { status: Status::Failed.code(), message: message.into() };
                        let _ = answer(srv, s, &f, w.tag);
                        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, message));
                    }
                }
                let tag = w.tag;
                drop(w);
                answer(srv, s, &Frame::Ack { status: 0, message: String::new() }, tag)?;
            }
        }
        if budget == 0 {
            return Ok(Interest::Read);
        }
        if backlogged(s) {
            s.paused.store(true, Ordering::Release);
            srv.ctx.reactor.schedule(s.writer_token.load(Ordering::Acquire));
            return Ok(Interest::Idle);
        }
        let ServedRx { frames, mac, .. } = rx;
        let got = match frames.poll(fd, mac) {
            Ok(Some(r)) => r,
            Ok(None) => return Ok(Interest::Read),
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                let err = Frame::Error { status: Status::ParamInvalid.code(), message: e.to_string() };
                let _ = answer(srv, s, &err, 0);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        budget = budget.saturating_sub(4096);
        let data_mac = rx.mac.data();
        if let Some(next) = on_frame(srv, s, got, data_mac, &rx.mac)? {
            rx.state = next;
        }
    }
}

/// Acts on one frame; returns the state that receives its bulk, if it has one.
fn on_frame(
    srv: &Server,
    s: &Arc<Served>,
    got: Received,
    data_mac: bool,
    rx_mac: &FrameMac,
) -> std::io::Result<Option<RxState>> {
    let ctx = &*srv.ctx;
    let Received { header: h, frame, seq } = got;
    match frame {
        Frame::Write { segs } => {
            return Ok(Some(start_write(ctx, s, &h, OwnedRanges::List(segs), data_mac, rx_mac, seq)))
        }
        Frame::WriteStrided { seg } => {
            return Ok(Some(start_write(ctx, s, &h, OwnedRanges::Strided(seg), data_mac, rx_mac, seq)))
        }
        Frame::Read { segs } => serve_read(srv, s, &h, OwnedRanges::List(segs))?,
        Frame::ReadStrided { seg } => serve_read(srv, s, &h, OwnedRanges::Strided(seg))?,
        Frame::Notify { name, msg } => {
            // Stored and its Ack queued under the send lock, which a finalize takes before it
            // drains the stream (`drain`): the Ack of a notification the application may
            // already hold always goes out before the stream closes. Once the engine is
            // stopping, a notification is refused rather than stored where nobody takes it.
            let sender = s.sender.get().map_or("", String::as_str);
            {
                let mut tx = s.send.lock().unwrap();
                let ack = if srv.stopping() {
                    let message = "the target is finalizing: the notification was not delivered";
                    Frame::Ack { status: Status::Failed.code(), message: message.into() }
                } else {
                    match ctx.notifies.push(s.id, sender, name, msg) {
                        Ok(()) => Frame::Ack { status: 0, message: String::new() },
                        Err(e) => Frame::Ack { status: e.code(), message: e.message },
                    }
                };
                tx.queue_sealed(&mut wire::encode(&ack, h.tag, 0));
            }
            send_now(srv, s)?;
        }
        Frame::Heartbeat => answer(srv, s, &Frame::HeartbeatAck, h.tag)?,
        Frame::BackendOpen { backend, payload } => {
            let head = s.link_head.load(Ordering::Acquire);
            let from = s.peer_addr.parse::<std::net::SocketAddr>().map(|a| a.ip());
            let from = from.unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
            let ans = crate::transport::backend::answer_open(
                &ctx.backends,
                head,
                from,
                &backend,
                &payload,
                &mut s.accepted.lock().unwrap(),
            );
            answer(srv, s, &ans, h.tag)?
        }
        Frame::RegionsAck { version } => {
            s.acked.fetch_max(version, Ordering::AcqRel);
            let _g = srv.live.lock().unwrap();
            srv.acks.notify_all();
        }
        Frame::RegionsQuery if s.data_path.load(Ordering::Acquire) => {
            let message = "a data-path stream gets no region table: ask on the control channel";
            let err = Frame::Error { status: Status::ParamInvalid.code(), message: message.into() };
            let _ = answer(srv, s, &err, h.tag);
            return Err(std::io::Error::other(message));
        }
        Frame::RegionsQuery => {
            let (version, regions) = ctx.registry.table();
            answer(srv, s, &Frame::RegionsTable { version, regions }, h.tag)?
        }
        Frame::Bye => {
            let _ = answer(srv, s, &Frame::Ack { status: 0, message: String::new() }, h.tag);
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the initiator said goodbye"));
        }
        other => {
            let message = format!("unexpected {:?} frame from an initiator", other.kind());
            let err = Frame::Error { status: Status::ParamInvalid.code(), message: message.clone() };
            let _ = answer(srv, s, &err, h.tag);
            return Err(std::io::Error::other(message));
        }
    }
    Ok(None)
}

/// Checks a WRITE's ranges and pins them: its bytes then go straight into them; a refused
/// WRITE's bytes are skipped.
fn start_write(
    ctx: &crate::transport::target_side::ServerCtx,
    s: &Arc<Served>,
    h: &Header,
    ranges: OwnedRanges,
    data_mac: bool,
    rx_mac: &FrameMac,
    seq: u64,
) -> RxState {
    let mac_len = if data_mac { MAC_LEN as u64 } else { 0 };
    let holder: Arc<dyn Abort> = s.clone();
    match PinnedFrame::pin(ranges, &ctx.registry, &holder, true) {
        Ok(frame) if ctx.staging.stages(&frame) => {
            let hasher = rx_mac.data_hasher(seq);
            match ctx.staging.start_write(h.tag, h.bulk_len, frame, hasher, &s.peer_addr) {
                Ok(w) => RxState::Staged(w),
                Err(e) => RxState::Discard {
                    tag: h.tag,
                    left: h.bulk_len.saturating_add(mac_len),
                    ack: Frame::Ack { status: e.code(), message: e.message },
                },
            }
        }
        Ok(frame) => RxState::Bulk(Box::new(WriteBulk {
            tag: h.tag,
            bulk: h.bulk_len,
            job: IoJob::with_owner(frame),
            hasher: rx_mac.data_hasher(seq),
            mac: [0u8; MAC_LEN],
            mac_got: 0,
        })),
        Err(e) => RxState::Discard {
            tag: h.tag,
            left: h.bulk_len.saturating_add(mac_len),
            ack: Frame::Ack { status: e.code(), message: e.message },
        },
    }
}

fn serve_read(srv: &Server, s: &Arc<Served>, h: &Header, ranges: OwnedRanges) -> std::io::Result<()> {
    let Some(total) = ranges.bytes() else {
        let resp = Frame::ReadResp { status: Status::ParamInvalid.code(), message: "ranges overflow".into() };
        return answer(srv, s, &resp, h.tag);
    };
    let holder: Arc<dyn Abort> = s.clone();
    let frame = match PinnedFrame::pin(ranges, &srv.ctx.registry, &holder, false) {
        Ok(f) => f,
        Err(e) => return answer(srv, s, &Frame::ReadResp { status: e.code(), message: e.message }, h.tag),
    };
    // Device memory: its bytes are copied where a socket can send them from (the target's
    // staging hook), and sent from there.
    let source = if srv.ctx.staging.stages(&frame) {
        match srv.ctx.staging.stage_read(frame, total, &s.peer_addr) {
            Ok(bytes) => ReadSource::Staged(bytes),
            Err(e) => {
                return answer(srv, s, &Frame::ReadResp { status: e.code(), message: e.message }, h.tag)
            }
        }
    } else {
        // Registered memory unmapped since: refuse before the reply promises its bytes. (A
        // page made PROT_NONE is still mapped; sending from it fails mid-reply and closes the
        // stream.)
        if let Some(p) = frame.pins().iter().find(|p| !io::is_mapped(p.region().addr, p.region().len)) {
            let message = format!(
                "the target's registered region 0x{:x}+{} is no longer mapped (unmapped since it was \
                 registered)",
                p.region().addr,
                p.region().len
            );
            drop(frame);
            return answer(srv, s, &Frame::ReadResp { status: Status::ParamInvalid.code(), message }, h.tag);
        }
        ReadSource::Host(frame)
    };
    {
        let mut tx = s.send.lock().unwrap();
        let mut head = wire::encode(&Frame::ReadResp { status: 0, message: String::new() }, h.tag, total);
        let seq = tx.mac.seal(&mut head);
        let mut job = IoJob::default();
        job.push_owned(head);
        let mut hasher = tx.mac.data_hasher(seq);
        // The job keeps what it sends from: the frame (its pins), or the staged bytes.
        match source {
            ReadSource::Staged(bytes) => {
                if let Some(h) = &mut hasher {
                    crate::sys::mem::for_each_slice(&bytes, |b| {
                        h.update(b);
                    });
                }
                job.push_pinned(bytes);
            }
            ReadSource::Host(frame) => {
                if let Some(h) = &mut hasher {
                    frame.hash(h);
                }
                job.push_pinned(frame);
            }
        }
        if let Some(hasher) = hasher {
            job.push_owned(auth::data_mac(&hasher).to_vec());
        }
        tx.out.push(job);
    }
    send_now(srv, s)
}

/// Where a served READ's bytes are sent from.
enum ReadSource {
    /// The registered ranges themselves.
    Host(PinnedFrame),
    /// A copy the target's staging hook made (device memory), which keeps the frame.
    Staged(PinnedBytes),
}
