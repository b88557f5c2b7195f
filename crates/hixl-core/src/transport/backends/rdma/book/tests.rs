use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::queue::{PartBody, Request, SegPair, TransferOp};
use crate::transport::backends::rdma::verbs::{Sge, WrOp};

fn request() -> Arc<Request> {
    Arc::new(Request::new(1, TransferOp::Write, "p", 8, 1, 1, Duration::from_secs(30), vec![], None))
}

fn job(n: usize) -> (Arc<Request>, Part, Vec<SendWr>) {
    let req = request();
    let part = Part::new(req.clone(), PartBody::Data(vec![SegPair { local: 1, remote: 2, len: 8 }]));
    let wr = |i: usize| SendWr {
        wr_id: 0,
        op: WrOp::Write,
        sges: vec![Sge { addr: 0x1000 + i as u64, length: 1, lkey: 7 }],
        signaled: false,
        remote_addr: 0x2000 + i as u64,
        rkey: 9,
        inline: false,
    };
    (req, part, (0..n).map(wr).collect())
}

fn seqs(b: &[SendWr]) -> Vec<u32> {
    b.iter().map(|w| w.wr_id as u32).collect()
}

fn signaled(b: &[SendWr]) -> Vec<usize> {
    b.iter().enumerate().filter(|(_, w)| w.signaled).map(|(i, _)| i).collect()
}

#[test]
fn every_nth_and_the_last_of_a_part_are_signaled_and_one_completion_ends_it() {
    let mut b = QpBook::new(0xAB, 256, "qp".into());
    let (_, p, wrs) = job(40);
    b.add(p, wrs);
    let batch = b.next_batch();
    assert_eq!(batch.len(), 40, "one doorbell for the whole part");
    assert_eq!(signaled(&batch), vec![15, 31, 39]);
    assert!(batch.iter().all(|w| w.wr_id >> 32 == 0xAB), "the tag names the link and QP");
    assert!(b.on_wc(seqs(&batch)[15], wc::SUCCESS).is_empty(), "an intermediate signal ends nothing");
    let done = b.on_wc(seqs(&batch)[39], wc::SUCCESS);
    assert_eq!(done.len(), 1);
    assert!(done[0].1.is_ok());
    assert!(b.drained() && b.parts() == 0);
}

#[test]
fn the_send_queue_depth_bounds_a_batch_and_the_batch_end_is_signaled() {
    let mut b = QpBook::new(1, 8, "qp".into());
    let (_, p, wrs) = job(20);
    b.add(p, wrs);
    let first = b.next_batch();
    assert_eq!(first.len(), 8);
    assert_eq!(signaled(&first), vec![7], "the last of a batch is signaled, so its slots come back");
    assert!(b.next_batch().is_empty(), "no room until a signaled completion");
    assert!(b.on_wc(seqs(&first)[7], wc::SUCCESS).is_empty());
    let second = b.next_batch();
    assert_eq!(second.len(), 8);
    b.on_wc(seqs(&second)[7], wc::SUCCESS);
    let third = b.next_batch();
    assert_eq!(third.len(), 4);
    let done = b.on_wc(seqs(&third)[3], wc::SUCCESS);
    assert_eq!(done.len(), 1);
    assert!(done[0].1.is_ok());
}

#[test]
fn a_remote_access_error_fails_its_part_and_reposts_the_flushed_ones_once() {
    let mut b = QpBook::new(1, 64, "qp 5".into());
    let (ra, a, wa) = job(3);
    let (_, pb, wb) = job(2);
    let (_, pc, wc_) = job(2);
    b.add(a, wa);
    b.add(pb, wb);
    b.add(pc, wc_);
    let batch = b.next_batch();
    let s = seqs(&batch);
    assert_eq!(batch.len(), 7);
    // A's second request is refused: its first succeeded, everything after it flushes.
    assert!(b.on_wc(s[1], wc::REM_ACCESS_ERR).is_empty(), "A still has a request outstanding");
    let failed = b.on_wc(s[2], wc::WR_FLUSH_ERR);
    assert_eq!(failed.len(), 1);
    assert!(Arc::ptr_eq(&failed[0].0.req, &ra));
    let e = failed[0].1.as_ref().unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
    assert!(e.message.contains("remote access error") && e.message.contains("qp 5"), "{e}");
    for q in &s[3..] {
        assert!(b.on_wc(*q, wc::WR_FLUSH_ERR).is_empty(), "flushed bystanders wait to be re-posted");
    }
    assert!(b.dead().is_some() && b.drained());
    assert!(b.next_batch().is_empty(), "nothing is posted on a dead QP");
    b.revive("qp 6".into());
    let again = b.next_batch();
    assert_eq!(again.len(), 4, "B and C, from their first request");
    assert_eq!(signaled(&again), vec![1, 3]);
    let s = seqs(&again);
    assert_eq!(b.on_wc(s[3], wc::SUCCESS).iter().filter(|(_, r)| r.is_ok()).count(), 2);
    assert_eq!(b.parts(), 0);
}

#[test]
fn a_second_error_fails_a_reposted_part_and_retries_exceeded_fail_everything() {
    let mut b = QpBook::new(1, 64, "qp".into());
    let (_, a, wa) = job(1);
    let (_, pb, wb) = job(1);
    b.add(a, wa);
    b.add(pb, wb);
    let s = seqs(&b.next_batch());
    b.on_wc(s[0], wc::REM_ACCESS_ERR);
    assert!(b.on_wc(s[1], wc::WR_FLUSH_ERR).is_empty());
    b.revive("qp".into());
    let (_, pc, wc_) = job(1);
    b.add(pc, wc_);
    let s = seqs(&b.next_batch());
    assert_eq!(s.len(), 2, "the re-posted B, then C");
    // The peer is gone now: no re-post for anyone, NOT_CONNECTED for all.
    let mut ended = b.on_wc(s[0], wc::RETRY_EXC_ERR);
    ended.append(&mut b.on_wc(s[1], wc::WR_FLUSH_ERR));
    assert_eq!(ended.len(), 2);
    for (_, r) in &ended {
        assert_eq!(r.as_ref().unwrap_err().status, Status::NotConnected);
    }
}

#[test]
fn stale_completions_are_ignored_and_unposted_requests_flush() {
    let mut b = QpBook::new(1, 64, "qp".into());
    assert!(b.on_wc(77, wc::SUCCESS).is_empty());
    let (_, a, wa) = job(4);
    b.add(a, wa);
    let batch = b.next_batch();
    // The provider took the first two and refused the rest.
    let ended = b.unposted(&batch, 2, Error::failed("post_send: EINVAL"));
    assert!(ended.is_empty(), "two requests are still out");
    let s = seqs(&batch);
    b.on_wc(s[0], wc::WR_FLUSH_ERR);
    let ended = b.on_wc(s[1], wc::WR_FLUSH_ERR);
    assert_eq!(ended.len(), 1);
    assert!(ended[0].1.as_ref().unwrap_err().message.contains("EINVAL"));
}

#[test]
fn closing_fails_what_is_held() {
    let mut b = QpBook::new(1, 2, "qp".into());
    for _ in 0..3 {
        let (_, p, w) = job(2);
        b.add(p, w);
    }
    b.next_batch();
    let ended = b.fail_all(&Error::not_connected("closed"));
    assert_eq!(ended.len(), 3);
    assert!(ended.iter().all(|(_, r)| r.as_ref().unwrap_err().message == "closed"));
}

/// With failover, a rail's failure (the peer unreachable) fails nothing: the failed part and
/// the flushed ones are held until the QP drained, then all leave for another rail in
/// submission order; without it they fail as before.
#[test]
fn with_failover_a_retry_failure_holds_every_part_for_another_rail() {
    for failover in [true, false] {
        let mut b = QpBook::new(1, 64, "qp".into()).with_failover(failover);
        let parts: Vec<_> = (0..3).map(|_| job(2)).collect();
        let reqs: Vec<_> = parts.iter().map(|(r, _, _)| r.clone()).collect();
        for (_, p, w) in parts {
            b.add(p, w);
        }
        let batch = b.next_batch();
        assert_eq!(batch.len(), 6);
        let mut done = b.on_wc(seqs(&batch)[1], wc::SUCCESS);
        assert_eq!(done.len(), 1, "the first part completed before the failure");
        done.clear();
        done.append(&mut b.on_wc(seqs(&batch)[2], wc::RETRY_EXC_ERR));
        for w in &batch[3..] {
            done.append(&mut b.on_wc(w.wr_id as u32, wc::WR_FLUSH_ERR));
        }
        assert!(b.drained());
        if !failover {
            assert_eq!(done.len(), 2, "both fail");
            assert!(done.iter().all(|(_, r)| r.as_ref().unwrap_err().status == Status::NotConnected));
            continue;
        }
        assert!(done.is_empty(), "nothing fails on a rail that can fail over: {} ended", done.len());
        assert_eq!(b.parts(), 2);
        let (again, ended) = b.evacuate();
        assert!(ended.is_empty());
        assert_eq!(again.len(), 2);
        assert!(Arc::ptr_eq(&again[0].req, &reqs[1]) && Arc::ptr_eq(&again[1].req, &reqs[2]), "in order");
        assert_eq!(b.parts(), 0);
    }
}

/// A held part on a rail that is kept (no other rail up) is posted again by the replacement.
#[test]
fn held_parts_are_posted_by_the_qp_that_replaces_a_failed_one() {
    let mut b = QpBook::new(1, 64, "qp".into()).with_failover(true);
    let (_, p, w) = job(2);
    b.add(p, w);
    let batch = b.next_batch();
    assert!(b.on_wc(seqs(&batch)[0], wc::REM_OP_ERR).is_empty());
    assert!(b.on_wc(seqs(&batch)[1], wc::WR_FLUSH_ERR).is_empty());
    b.revive("qp2".into());
    let again = b.next_batch();
    assert_eq!(again.len(), 2, "posted from its first request");
    let done = b.on_wc(seqs(&again)[1], wc::SUCCESS);
    assert!(done.len() == 1 && done[0].1.is_ok());
}

/// A QP moved to the error state on purpose (its rail left out) after it carried out
/// unsignaled requests: those never complete on their own, the flush of the next one stands
/// for them, and the QP drains (else its parts would never leave it).
#[test]
fn a_flush_after_unsignaled_requests_that_ran_drains_the_qp() {
    let mut b = QpBook::new(1, 256, "qp".into()).with_failover(true);
    let (_, p, w) = job(40);
    b.add(p, w);
    let batch = b.next_batch();
    let s = seqs(&batch);
    assert!(b.on_wc(s[15], wc::SUCCESS).is_empty());
    // Requests 16..19 ran (unsignaled: no completion), then the QP went to the error state.
    b.kill(Error::not_connected("rail out"));
    for q in &s[20..] {
        assert!(b.on_wc(*q, wc::WR_FLUSH_ERR).is_empty());
    }
    assert!(b.drained(), "requests 16..19 are accounted for");
    let (again, ended) = b.evacuate();
    assert_eq!((again.len(), ended.len()), (1, 0));
}
