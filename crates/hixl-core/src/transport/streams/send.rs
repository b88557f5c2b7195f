//! The sending half of a TCP link: each stream's writer is a reactor source that takes parts
//! from the link's queue in batches, turns each into a sealed frame followed by its bytes
//! (straight from registered memory) and sends what the socket takes now; the rest waits for
//! room. A submitter with a small request runs the writer on its own thread (no hand-off).

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use super::{Pending, Stream, TcpLink, BATCH_BYTES, BATCH_PARTS, INLINE_BYTES, WRITE_BUDGET};
use crate::auth::{self, MAC_LEN};
use crate::error::Error;
use crate::queue::{Part, PartBody, TransferOp, TransferStatus};
use crate::transport::io::nbio::{IoJob, Step};
use crate::transport::reactor::{Interest, Source};
use crate::transport::DataPath;
use crate::wire::{self, Frame, Seg, StridedSeg};

/// A stream's writer, as the reactor runs it.
pub(super) struct Writer {
    pub(super) link: Arc<TcpLink>,
    pub(super) stream: Arc<Stream>,
}

impl Source for Writer {
    fn run(&self, _events: u32) -> Interest {
        self.link.write_some(&self.stream)
    }
}

impl TcpLink {
    /// Sends queued frames, then takes more parts from the queue, until the socket is full
    /// (then waits for room), the budget is spent (then yields to other streams) or nothing
    /// is left.
    fn write_some(self: &Arc<Self>, s: &Stream) -> Interest {
        let fd = s.sock.as_raw_fd();
        let mut budget = WRITE_BUDGET;
        let failed = {
            let mut tx = s.tx.lock().unwrap();
            loop {
                match tx.out.flush(fd, &mut budget) {
                    Ok(Step::Done) => {}
                    Ok(Step::WouldBlock) => return Interest::Write,
                    Err(e) => break e,
                }
                if !self.alive() {
                    return Interest::Gone;
                }
                let mut batch = Vec::with_capacity(BATCH_PARTS);
                let bytes = |p: &Part| p.body.bytes();
                let lane = Some(s.lane);
                if !self.queue.try_pop_weighted(lane, &mut batch, BATCH_PARTS, BATCH_BYTES, bytes) {
                    return Interest::Idle;
                }
                self.coalesce_more(lane, &mut batch, bytes);
                // A request that already timed out is not sent any further.
                for p in std::mem::take(&mut batch) {
                    if p.req.status() == TransferStatus::Waiting {
                        batch.push(p);
                    } else {
                        let err = p
                            .req
                            .error()
                            .unwrap_or_else(|| Error::timeout("request ended before it was sent"));
                        self.finish_part(p, Err(err));
                    }
                }
                for (p, err) in self.queue_frames(s, &mut tx, batch) {
                    self.finish_part(p, Err(err));
                }
            }
        };
        self.close(Error::not_connected(format!("stream to {} failed while sending: {failed}", self.peer)));
        Interest::Gone
    }

    /// With `hixl.tcp.coalesce_us`, waits that long after the first small request for more,
    /// so that they go out as one send; each still completes on its own.
    fn coalesce_more(&self, lane: Option<usize>, batch: &mut Vec<Part>, bytes: impl Fn(&Part) -> u64 + Copy) {
        if self.coalesce.is_zero() || batch.is_empty() {
            return;
        }
        let until = Instant::now() + self.coalesce;
        let max = self.coalesce_max_ops.max(1);
        while batch.len() < max
            && batch.iter().map(bytes).sum::<u64>() < BATCH_BYTES
            && Instant::now() < until
        {
            if !self.queue.try_pop_weighted(lane, batch, max, BATCH_BYTES, bytes) {
                std::thread::yield_now();
            }
        }
    }

    /// Turns a batch of parts into sealed frames on the stream's outbox (the caller holds its
    /// lock): each part's frame, then its bytes (for writes), then their data MAC (with
    /// `hixl.data_mac`). The parts wait in `pending` for their answers. Returns the parts
    /// refused before any of their frame was queued (a local range outside the memory the part
    /// keeps: never one the engine built), for the caller to fail.
    fn queue_frames(&self, s: &Stream, tx: &mut super::Tx, batch: Vec<Part>) -> Vec<(Part, Error)> {
        let mut refused = Vec::new();
        if batch.is_empty() {
            return refused;
        }
        let mut job = IoJob::default();
        let mut pend = s.pending.lock().unwrap();
        for part in batch {
            // A data part's local side, checked once here (the job keeps its pins).
            let local = match part.body {
                PartBody::Notify(_) => None,
                _ => match part.local() {
                    Some(local) => Some(local),
                    None => {
                        refused.push((part, crate::queue::unpinned_part()));
                        continue;
                    }
                },
            };
            let tag = s.next_tag.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let write = part.req.op == TransferOp::Write;
            let frame = match (&part.body, part.req.op) {
                (PartBody::Data(segs), op) => {
                    let remote = segs.iter().map(|p| Seg { addr: p.remote, len: p.len }).collect();
                    match op {
                        TransferOp::Write => Frame::Write { segs: remote },
                        TransferOp::Read => Frame::Read { segs: remote },
                    }
                }
                (PartBody::Strided(st), op) => {
                    let seg =
                        StridedSeg { addr: st.remote, count: st.count, size: st.size, stride: st.rstride };
                    match op {
                        TransferOp::Write => Frame::WriteStrided { seg },
                        TransferOp::Read => Frame::ReadStrided { seg },
                    }
                }
                (PartBody::Notify(n), _) => Frame::Notify { name: n.name.clone(), msg: n.msg.clone() },
            };
            let mut head = wire::encode(&frame, tag, 0);
            let seq = tx.mac.seal(&mut head);
            let hasher = tx.mac.data_hasher(seq);
            job.push_owned(head);
            // The job keeps the part's pins until it drops, whenever the part settles.
            if let Some(local) = local.filter(|_| write) {
                job.push_kept(&local);
                if let Some(mut h) = hasher {
                    local.hash_into(&mut h);
                    let tag: [u8; MAC_LEN] = auth::data_mac(&h);
                    job.push_owned(tag.to_vec());
                }
            }
            pend.push_back(Pending { tag, part });
        }
        tx.out.push(job);
        refused
    }

    /// Has a writer send what was queued: on this thread when the request is small (and
    /// coalescing is off), else on an I/O worker. `lane`: the writer of that stream.
    ///
    /// A small request sent from this thread goes out on the same stream as this thread's
    /// earlier ones (threads are dealt to the streams in turn), so that one thread's
    /// request-answer exchanges keep one worker on the peer busy (and its cache warm) instead
    /// of alternating between them; larger ones take the streams in turn.
    pub(super) fn kick(&self, lane: Option<usize>, bytes: u64) {
        let n = self.streams.len();
        let inline = bytes <= INLINE_BYTES
            && self.coalesce.is_zero()
            && !crate::transport::reactor::on_reactor_thread();
        let k = lane.unwrap_or_else(|| {
            if inline {
                thread_lane() % n
            } else {
                self.next_lane.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n
            }
        });
        let token = self.streams[k].writer_token.load(std::sync::atomic::Ordering::Acquire);
        if inline {
            self.reactor.run_here(token);
        } else {
            self.reactor.schedule(token);
        }
    }

    /// Queues a small frame of the link's own (a confirmation, probe or query) on stream `s`
    /// and sends it at once when nothing is queued before it (no worker wake-up: an idle
    /// engine's heartbeats cost one send each); otherwise its writer sends it.
    pub(crate) fn send_own(&self, s: &Stream, f: &Frame, tag: u64) -> u64 {
        let mut b = wire::encode(f, tag, 0);
        let (len, sent) = {
            let mut tx = s.tx.lock().unwrap();
            tx.mac.seal(&mut b);
            let len = b.len() as u64;
            let alone = tx.out.is_empty();
            tx.out.push_frame(b);
            let mut budget = len;
            let sent = alone && matches!(tx.out.flush(s.sock.as_raw_fd(), &mut budget), Ok(Step::Done));
            (len, sent)
        };
        if !sent {
            self.reactor.schedule(s.writer_token.load(std::sync::atomic::Ordering::Acquire));
        }
        len
    }
}

/// This thread's place among the threads that sent small requests (dealt in turn).
fn thread_lane() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static LANE: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    LANE.with(|l| *l)
}
