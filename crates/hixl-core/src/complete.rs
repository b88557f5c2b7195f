//! The one completer: what happens when a part of a request ends, for every backend.
//!
//! A request is cut into parts that backends carry in any order, on any worker. When the last
//! part ends, the request either settles (the first error wins; otherwise COMPLETED) or, when
//! the caller asked for a notification after the data and every part succeeded, the completer
//! hands back that notification as one more part of the same request: the request settles when
//! the notification has been delivered too. Settling counts the request in the peer's stats,
//! logs it (DEBUG), wakes waiters and releases its pinned regions. Backends only report
//! `finish(part, result)` and act on the answer; they decide nothing here. No I/O happens here,
//! so the logic is tested without sockets.

use std::sync::Arc;
use std::time::Instant;

use crate::error::Error;
use crate::queue::{Part, PartBody, Request, TransferOp, TransferStatus};
use crate::stats::PeerStats;

/// What the backend must do after reporting a part.
pub(crate) enum Next {
    /// Other parts of the request are still in flight.
    Pending,
    /// The request is settled (a notification it had to send after the data, if any, is
    /// dropped: a part failed).
    Settled,
    /// Every data part succeeded: send this notification part (already counted in the
    /// request) to the peer, and report it with `finish` like any other part.
    Notify(Part),
}

/// Settles requests for one peer link.
pub(crate) struct Completer {
    backend: &'static str,
    peer: String,
    stats: Arc<PeerStats>,
}

impl Completer {
    /// A completer that counts into `stats` and names `backend` and `peer` in its logs.
    pub(crate) fn new(backend: &'static str, peer: &str, stats: Arc<PeerStats>) -> Completer {
        Completer { backend, peer: peer.to_string(), stats }
    }

    /// The peer's counters.
    pub(crate) fn stats(&self) -> &Arc<PeerStats> {
        &self.stats
    }

    /// Records the end of one part with its result; says what the backend must do next.
    pub(crate) fn finish(&self, part: Part, res: Result<(), Error>) -> Next {
        let req = part.req;
        if !req.part_done(&res) {
            return Next::Pending;
        }
        let notify = req.take_notify_after();
        if let Some(err) = req.part_error() {
            self.settle(&req, TransferStatus::Failed, Some(err));
            return Next::Settled;
        }
        match notify {
            Some(n) => {
                // The data is at the target: now the notification may go (over the control
                // channel, whose completer settles it; the request stays this backend's).
                req.carried_by(self.backend);
                req.add_parts(1);
                Next::Notify(Part::new(req, PartBody::Notify(n)))
            }
            None => {
                self.settle(&req, TransferStatus::Completed, None);
                Next::Settled
            }
        }
    }

    /// Fails a request whose notification part could not even be handed to a backend.
    pub(crate) fn abandon(&self, req: &Arc<Request>, err: Error) {
        req.part_done(&Err(err.clone()));
        self.settle(req, TransferStatus::Failed, Some(err));
    }

    /// Settles a request once all its I/O has stopped: logs it (DEBUG), settles it (which
    /// counts it in its peer's stats, see `Request::settle`), wakes waiters and releases its
    /// pinned regions.
    pub(crate) fn settle(&self, req: &Arc<Request>, to: TransferStatus, err: Option<Error>) {
        // Records the end of its I/O first: the latency the settling counts it with.
        if req.account(self.backend) {
            self.log(req, to);
        }
        req.settle(to, err);
        req.release_pins();
    }

    /// Logs the end of a request's I/O (DEBUG), once.
    fn log(&self, req: &Request, to: TransferStatus) {
        let backend = req.carrier().unwrap_or(self.backend);
        let latency = req.ended_at().unwrap_or_else(Instant::now).saturating_duration_since(req.started);
        // Source and destination of the first segment, the way the data flowed.
        let (local, remote) = req.first_addrs;
        let (src, dst) = if req.op == TransferOp::Write { (local, remote) } else { (remote, local) };
        tracing::debug!(
            peer = %self.peer, backend = backend, op = ?req.op, descs = req.descs, bytes = req.bytes,
            src = %format_args!("0x{src:x}"), dst = %format_args!("0x{dst:x}"),
            latency_us = latency.as_micros() as u64, status = ?to, "transfer done"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::*;
    use crate::queue::{NotifyDesc, SegPair, TransferOp};

    /// A request submitted on `c`'s link (counted in its stats).
    fn request(c: &Completer, parts: usize, notify: bool) -> Arc<Request> {
        let n = notify.then(|| NotifyDesc::new("n", "m"));
        let req =
            Arc::new(Request::new(1, TransferOp::Write, "p", 8, 2, parts, Duration::from_secs(5), vec![], n));
        req.track(c.stats());
        req
    }

    fn part(req: &Arc<Request>) -> Part {
        Part::new(req.clone(), PartBody::Data(vec![SegPair { local: 1, remote: 2, len: 4 }]))
    }

    fn completer() -> Completer {
        Completer::new("test", "peer", Arc::new(PeerStats::default()))
    }

    #[test]
    fn the_last_part_settles_and_counts_once() {
        let c = completer();
        let req = request(&c, 2, false);
        assert!(matches!(c.finish(part(&req), Ok(())), Next::Pending));
        assert_eq!(req.status(), TransferStatus::Waiting);
        assert!(matches!(c.finish(part(&req), Ok(())), Next::Settled));
        assert_eq!(req.status(), TransferStatus::Completed);
        assert_eq!(c.stats().ops_write.load(Ordering::Relaxed), 1);
        assert_eq!(c.stats().bytes_write.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn a_notification_follows_the_data_and_the_request_waits_for_it() {
        let c = completer();
        let req = request(&c, 2, true);
        assert!(matches!(c.finish(part(&req), Ok(())), Next::Pending));
        let Next::Notify(n) = c.finish(part(&req), Ok(())) else { panic!("expected the notify") };
        assert!(matches!(n.body, PartBody::Notify(_)));
        assert_eq!(req.status(), TransferStatus::Waiting, "settles only once the notify is delivered");
        assert!(matches!(c.finish(n, Ok(())), Next::Settled));
        assert_eq!(req.status(), TransferStatus::Completed);
        assert_eq!(c.stats().notifies.load(Ordering::Relaxed), 1, "the notification is counted");
        assert_eq!(c.stats().ops_write.load(Ordering::Relaxed), 1, "and so is the transfer");
    }

    #[test]
    fn the_first_error_wins_and_the_notification_is_dropped() {
        let c = completer();
        let req = request(&c, 2, true);
        assert!(matches!(c.finish(part(&req), Err(Error::param("first"))), Next::Pending));
        assert!(matches!(c.finish(part(&req), Err(Error::failed("second"))), Next::Settled));
        assert_eq!(req.status(), TransferStatus::Failed);
        assert_eq!(req.error().unwrap().message, "first");
        assert_eq!(c.stats().errors.load(Ordering::Relaxed), 1);
        assert_eq!(c.stats().notifies.load(Ordering::Relaxed), 0, "a dropped notification is not");
    }

    #[test]
    fn a_notification_that_cannot_be_sent_fails_the_request() {
        let c = completer();
        let req = request(&c, 1, true);
        let Next::Notify(n) = c.finish(part(&req), Ok(())) else { panic!("expected the notify") };
        c.abandon(&n.req, Error::not_connected("gone"));
        assert_eq!(req.status(), TransferStatus::Failed);
        assert_eq!(req.error().unwrap().message, "gone");
    }

    #[test]
    fn a_request_past_its_deadline_is_counted_as_a_timeout_at_once_and_only_then() {
        let c = completer();
        let req = Arc::new(Request::new(1, TransferOp::Write, "p", 8, 1, 1, Duration::ZERO, vec![], None));
        req.track(c.stats());
        let s = c.stats();
        assert_eq!(s.in_flight.load(Ordering::Relaxed), 1);
        assert_eq!(req.status(), TransferStatus::Timeout);
        let timeouts = &s.errors_by_status[2]; // TIMEOUT is Status::ALL[2]
        let now = || {
            (
                s.in_flight.load(Ordering::Relaxed),
                s.errors.load(Ordering::Relaxed),
                timeouts.load(Ordering::Relaxed),
            )
        };
        assert_eq!(now(), (0, 1, 1), "an error, and no longer in flight, once it timed out");
        // Its I/O ends later: the request was counted already.
        assert!(matches!(c.finish(part(&req), Ok(())), Next::Settled));
        assert_eq!(req.status(), TransferStatus::Timeout);
        assert_eq!(now(), (0, 1, 1));
        assert_eq!(s.ops_write.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_notification_sent_alone_leaves_in_flight_where_it_was() {
        let c = completer();
        let req =
            Arc::new(Request::new(2, TransferOp::Write, "p", 0, 0, 1, Duration::from_secs(5), vec![], None));
        req.track(c.stats());
        assert_eq!(c.stats().in_flight.load(Ordering::Relaxed), 1);
        let n = Part::new(req.clone(), PartBody::Notify(NotifyDesc::new("n", "m")));
        assert!(matches!(c.finish(n, Ok(())), Next::Settled));
        assert_eq!(c.stats().in_flight.load(Ordering::Relaxed), 0, "never below zero");
        assert_eq!(c.stats().notifies.load(Ordering::Relaxed), 1);
        assert_eq!(c.stats().errors.load(Ordering::Relaxed), 0);
    }
}
