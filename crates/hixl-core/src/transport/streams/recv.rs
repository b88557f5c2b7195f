//! The receiving half of a TCP link: each stream's reader is a reactor source that assembles
//! the answers as they arrive, matches each to the request it belongs to (by tag and kind),
//! reads READ bytes straight into registered memory across as many wake-ups as they take, and
//! installs the region tables the peer sends (on a control channel).

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{Pending, Rx, RxBulk, Stream, TcpLink, READ_BUDGET};
use crate::auth::{self, MAC_LEN};
use crate::error::{Error, Status};
use crate::queue::{PartBody, TransferOp};
use crate::transport::io::nbio::{IoJob, Step};
use crate::transport::io::Received;
use crate::transport::reactor::{Interest, Source};
use crate::transport::DataPath;
use crate::wire::{Frame, Kind};

/// A stream's reader, as the reactor runs it.
pub(super) struct Reader {
    pub(super) link: Arc<TcpLink>,
    pub(super) stream: Arc<Stream>,
}

impl Source for Reader {
    fn run(&self, _events: u32) -> Interest {
        let link = &self.link;
        // Errors close the link after the stream's receive state is let go (closing fails
        // the part it holds), and after what the other streams received is read.
        match link.read_some(&self.stream) {
            Ok(i) => i,
            Err(e) => {
                link.read_what_came(&self.stream);
                link.close(e);
                Interest::Gone
            }
        }
    }
}

impl TcpLink {
    /// Reads what every other stream of this link, and of a data path's control channel, has
    /// received, before one stream's end closes them all and fails what is pending: a target
    /// that ends its streams (a finalize) sends what it owes on each first, so a request it
    /// answered, such as a notification it stored, is settled by its answer, not failed with
    /// the link. (A control channel's data path reads its own in its close hook.)
    fn read_what_came(&self, ended: &Stream) {
        for s in self.streams.iter().filter(|s| !std::ptr::eq(s.as_ref(), ended)) {
            // A stream that ended too, or failed, is closed with the rest below.
            let _ = self.read_some(s);
        }
        if let Some(c) = self.control() {
            c.read_received();
        }
    }

    /// Handles what every stream has received so far (see `read_what_came`).
    pub(crate) fn read_received_all(&self) {
        for s in &self.streams {
            let _ = self.read_some(s);
        }
    }

    /// Handles what has arrived, up to a budget (then yields to other streams).
    fn read_some(&self, s: &Stream) -> Result<Interest, Error> {
        let mut rx = s.rx.lock().unwrap();
        rx.frames.begin_run();
        let next = self.read_frames(s, &mut rx)?;
        Ok(rx.frames.end_run(next))
    }

    fn read_frames(&self, s: &Stream, rx: &mut Rx) -> Result<Interest, Error> {
        let fd = s.sock.as_raw_fd();
        let mut budget = READ_BUDGET;
        let broken = |e: std::io::Error| Error::not_connected(format!("stream to {} failed: {e}", self.peer));
        loop {
            if !self.alive() {
                return Ok(Interest::Gone);
            }
            if rx.bulk.is_some() {
                match self.recv_bulk(fd, rx, &mut budget) {
                    Ok(Step::Done) => {}
                    Ok(Step::WouldBlock) => return Ok(Interest::Read),
                    Err(e) => {
                        let err =
                            Error::not_connected(format!("stream to {} failed in a read: {e}", self.peer));
                        if let Some(b) = rx.bulk.take() {
                            self.finish_part(b.part, Err(err.clone()));
                        }
                        return Err(err);
                    }
                }
            }
            if budget == 0 {
                return Ok(Interest::Read);
            }
            let Rx { frames, mac, .. } = &mut *rx;
            let got = match frames.poll(fd, mac) {
                Ok(Some(r)) => r,
                Ok(None) => return Ok(Interest::Read),
                Err(e) => return Err(broken(e)),
            };
            budget = budget.saturating_sub(4096);
            self.handle(s, rx, got)?;
        }
    }

    /// Acts on one frame; a READ response with bytes leaves them to `recv_bulk`.
    fn handle(&self, s: &Stream, rx: &mut Rx, got: Received) -> Result<(), Error> {
        let Received { header: h, frame, seq } = got;
        let status_of = |status: u32, message: String| {
            if status == 0 {
                Ok(())
            } else {
                Err(Error::new(Status::from_code(status), format!("{} refused: {message}", self.peer)))
            }
        };
        match frame {
            Frame::Ack { status, message } => {
                let p = self.pop_pending(s, h.tag, Kind::Ack)?;
                self.finish_part(p.part, status_of(status, message));
            }
            Frame::ReadResp { status, message } => {
                let p = self.pop_pending(s, h.tag, Kind::ReadResp)?;
                let res = status_of(status, message);
                if res.is_err() {
                    self.finish_part(p.part, res);
                    return Ok(());
                }
                let want = p.part.body.bytes();
                if want != h.bulk_len || matches!(p.part.body, PartBody::Notify(_)) {
                    let err = Error::not_connected(format!(
                        "{}: read response carries {} bytes, expected {want}",
                        self.peer, h.bulk_len
                    ));
                    self.finish_part(p.part, Err(err.clone()));
                    return Err(err);
                }
                let Some(local) = p.part.local() else {
                    let err = crate::queue::unpinned_part();
                    self.finish_part(p.part, Err(err.clone()));
                    return Err(err);
                };
                // The job keeps the part's pins until it drops, whenever the part settles.
                let mut job = IoJob::default();
                job.push_kept(&local);
                let hasher = rx.mac.data_hasher(seq);
                rx.bulk = Some(RxBulk { part: p.part, job, hasher, tag: [0u8; MAC_LEN], tag_got: 0 });
            }
            Frame::HeartbeatAck => {}
            Frame::BackendOpened { status, message, payload } => {
                self.backend_opened(h.tag, status_of(status, message).map(|()| payload))
            }
            Frame::RegionsTable { version, regions } => self.install_table(version, regions, Some(h.tag)),
            Frame::RegionsUpdate { version, regions } => {
                // Waits for direct copies that use the old table, then confirms.
                self.install_table(version, regions, None);
                self.confirm_table(s, version);
            }
            Frame::RegionsDelta { from, version, added, removed } => {
                self.apply_delta(from, version, added, &removed)?;
                self.confirm_table(s, version);
            }
            Frame::Error { status, message } => {
                return Err(Error::new(
                    Status::from_code(status),
                    format!("{} closed the link: {message}", self.peer),
                ));
            }
            other => {
                return Err(Error::not_connected(format!(
                    "{} sent an unexpected {:?} frame",
                    self.peer,
                    other.kind()
                )));
            }
        }
        Ok(())
    }

    /// Receives a READ response's bytes into the part's local segments, then checks their
    /// data MAC when the stream has them; finishes the part when all arrived.
    fn recv_bulk(&self, fd: i32, rx: &mut Rx, budget: &mut u64) -> std::io::Result<Step> {
        let Rx { bulk, frames, .. } = rx;
        let b = bulk.as_mut().expect("a bulk under way");
        if frames.recv_job(fd, &mut b.job, budget)? == Step::WouldBlock {
            return Ok(Step::WouldBlock);
        }
        if let Some(h) = &b.hasher {
            if frames.fill(fd, &mut b.tag, &mut b.tag_got)? == Step::WouldBlock {
                return Ok(Step::WouldBlock);
            }
            let mut h = h.clone();
            // Checked when the job was made; a part whose body never changes passes again.
            let Some(local) = b.part.local() else {
                return Err(std::io::Error::other("a READ's local memory is no longer pinned"));
            };
            local.hash_into(&mut h);
            if !auth::constant_eq(&auth::data_mac(&h), &b.tag) {
                return Err(std::io::Error::other(
                    "the bytes read do not match their data MAC (altered on the way)",
                ));
            }
        }
        let b = rx.bulk.take().expect("a bulk under way");
        self.finish_part(b.part, Ok(()));
        Ok(Step::Done)
    }

    /// The request that an answer of kind `kind` with `tag` belongs to. Answers come in order
    /// and must match their request's kind (an Ack for a write or notify, a ReadResp for a
    /// read); anything else fails that request and closes the link without moving a byte.
    fn pop_pending(&self, s: &Stream, tag: u64, kind: Kind) -> Result<Pending, Error> {
        let p = s.pending.lock().unwrap().pop_front();
        let expects = |p: &Pending| match (&p.part.body, p.part.req.op) {
            (PartBody::Notify(_), _) | (_, TransferOp::Write) => Kind::Ack,
            (_, TransferOp::Read) => Kind::ReadResp,
        };
        let err = match p {
            Some(p) if p.tag == tag && expects(&p) == kind => return Ok(p),
            Some(p) => {
                let err = if p.tag == tag {
                    Error::not_connected(format!(
                        "{} answered request {tag} with a {kind:?}, expected a {:?}; closing the link",
                        self.peer,
                        expects(&p)
                    ))
                } else {
                    Error::not_connected(format!("{} answered tag {tag}, expected {}", self.peer, p.tag))
                };
                self.finish_part(p.part, Err(err.clone()));
                err
            }
            None => Error::not_connected(format!("{} answered tag {tag} that was never sent", self.peer)),
        };
        Err(err)
    }

    pub(super) fn fail_pending(&self, s: &Stream) {
        let err = self.close_reason();
        loop {
            let p = s.pending.lock().unwrap().pop_front();
            match p {
                Some(p) => self.finish_part(p.part, Err(err.clone())),
                None => break,
            }
        }
    }

    pub(crate) fn close_reason(&self) -> Error {
        self.reason
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_else(|| Error::not_connected(format!("link to {} is closed", self.peer)))
    }
}
