//! The receiving half of a TCP link: each stream's reader thread matches every answer to the
//! request it belongs to (by tag and kind), reads READ bytes straight into registered memory,
//! and installs the region tables the peer sends (on a control channel).

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{Pending, Stream, TcpLink};
use crate::auth::{self, MAC_LEN};
use crate::error::{Error, Status};
use crate::queue::{Part, PartBody, TransferOp};
use crate::transport::io::{self, iov};
use crate::transport::DataPath;
use crate::wire::{Frame, Kind};

impl TcpLink {
    pub(super) fn reader(self: &Arc<Self>, s: &Stream) {
        let fd = s.sock.as_raw_fd();
        let mut payload = Vec::new();
        let mut rx = s.rx.lock().unwrap().take().unwrap_or_default();
        loop {
            let (h, f, seq) = match io::recv_frame(fd, &mut payload, &mut rx, None) {
                Ok(r) => (r.header, r.frame, r.seq),
                Err(e) => {
                    self.close(Error::not_connected(format!("stream to {} failed: {e}", self.peer)));
                    break;
                }
            };
            let status_of = |status: u32, message: String| {
                if status == 0 {
                    Ok(())
                } else {
                    Err(Error::new(Status::from_code(status), format!("{} refused: {message}", self.peer)))
                }
            };
            match f {
                Frame::Ack { status, message } => match self.pop_pending(s, h.tag, Kind::Ack) {
                    Some(p) => self.finish_part(p.part, status_of(status, message)),
                    None => break,
                },
                Frame::ReadResp { status, message } => {
                    let Some(p) = self.pop_pending(s, h.tag, Kind::ReadResp) else { break };
                    let res = status_of(status, message);
                    if res.is_ok() {
                        if let Err(e) = self.recv_read_bulk(fd, &p.part, h.bulk_len, rx.data_hasher(seq)) {
                            let err = Error::not_connected(format!(
                                "stream to {} failed in a read: {e}",
                                self.peer
                            ));
                            self.finish_part(p.part, Err(err.clone()));
                            self.close(err);
                            break;
                        }
                    }
                    self.finish_part(p.part, res);
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
                    if let Err(e) = self.apply_delta(from, version, added, &removed) {
                        self.close(e);
                        break;
                    }
                    self.confirm_table(s, version);
                }
                Frame::Error { status, message } => {
                    self.close(Error::new(
                        Status::from_code(status),
                        format!("{} closed the link: {message}", self.peer),
                    ));
                    break;
                }
                other => {
                    self.close(Error::not_connected(format!(
                        "{} sent an unexpected {:?} frame",
                        self.peer,
                        other.kind()
                    )));
                    break;
                }
            }
        }
        self.fail_pending(s);
    }

    /// Receives a read response's bytes into the part's local segments, then checks their data
    /// MAC when the stream has them.
    fn recv_read_bulk(
        &self,
        fd: i32,
        part: &Part,
        bulk: u64,
        hasher: Option<blake3::Hasher>,
    ) -> std::io::Result<()> {
        let want = part.body.bytes();
        if want != bulk || matches!(part.body, PartBody::Notify(_)) {
            return Err(std::io::Error::other(format!(
                "read response carries {bulk} bytes, expected {want}"
            )));
        }
        let recv = |segs: &[crate::queue::SegPair]| {
            let mut iovs: Vec<_> = segs.iter().map(|p| iov(p.local, p.len)).collect();
            // SAFETY: the local segments lie in regions pinned by the request until it completes.
            unsafe { io::recv_all(fd, &mut iovs) }
        };
        match &part.body {
            PartBody::Data(segs) => recv(segs)?,
            PartBody::Strided(st) => st.for_each_chunk(io::IOV_MAX, recv)?,
            PartBody::Notify(_) => {}
        }
        if let Some(mut h) = hasher {
            let mut tag = [0u8; MAC_LEN];
            io::recv_exact(fd, &mut tag)?;
            // SAFETY: as above: pinned local memory.
            unsafe { part.body.hash_local(&mut h) };
            if !auth::constant_eq(&auth::data_mac(&h), &tag) {
                return Err(std::io::Error::other(
                    "the bytes read do not match their data MAC (altered on the way)",
                ));
            }
        }
        Ok(())
    }

    /// The request that an answer of kind `kind` with `tag` belongs to. Answers come in order
    /// and must match their request's kind (an Ack for a write or notify, a ReadResp for a
    /// read); anything else closes the link without moving a byte.
    fn pop_pending(&self, s: &Stream, tag: u64, kind: Kind) -> Option<Pending> {
        let p = s.pending.lock().unwrap().pop_front();
        let expects = |p: &Pending| match (&p.part.body, p.part.req.op) {
            (PartBody::Notify(_), _) | (_, TransferOp::Write) => Kind::Ack,
            (_, TransferOp::Read) => Kind::ReadResp,
        };
        match p {
            Some(p) if p.tag == tag && expects(&p) != kind => {
                let err = Error::not_connected(format!(
                    "{} answered request {tag} with a {kind:?}, expected a {:?}; closing the link",
                    self.peer,
                    expects(&p)
                ));
                self.finish_part(p.part, Err(err.clone()));
                self.close(err);
                None
            }
            Some(p) if p.tag == tag => Some(p),
            Some(p) => {
                let err =
                    Error::not_connected(format!("{} answered tag {tag}, expected {}", self.peer, p.tag));
                self.finish_part(p.part, Err(err.clone()));
                self.close(err);
                None
            }
            None => {
                self.close(Error::not_connected(format!(
                    "{} answered tag {tag} that was never sent",
                    self.peer
                )));
                None
            }
        }
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
