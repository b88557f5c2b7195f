//! Unit tests of requests (states, deadlines, waiters), strided descriptors and the work queue.

use super::*;
use std::sync::Arc;

#[test]
fn strided_expands_in_chunks_and_splits_evenly() {
    let s = Strided { local: 1000, remote: 5000, count: 10, size: 8, lstride: 64, rstride: 128 };
    assert_eq!(s.bytes(), 80);
    let mut seen = vec![];
    s.for_each_chunk(4, |c| {
        assert!(c.len() <= 4);
        seen.extend_from_slice(c);
        Ok::<(), ()>(())
    })
    .unwrap();
    assert_eq!(seen.len(), 10);
    assert_eq!(seen[9], SegPair { local: 1000 + 9 * 64, remote: 5000 + 9 * 128, len: 8 });
    let parts = s.split(3);
    assert_eq!(parts.iter().map(|p| p.count).collect::<Vec<_>>(), vec![4, 4, 2]);
    assert_eq!(parts[1].seg(0), s.seg(4));
    assert_eq!(s.split(100).len(), 10, "never more parts than elements");
}

#[test]
fn touching_strided_elements_are_one_segment_and_wide_ones_need_more_frames() {
    let cap = crate::wire::MAX_STRIDED_ELEMS;
    let s = Strided { local: 0, remote: 1 << 20, count: 3 * cap, size: 8, lstride: 8, rstride: 8 };
    let mut n = 0;
    s.for_each_chunk(4, |c| {
        assert_eq!(c, [SegPair { local: 0, remote: 1 << 20, len: 24 * cap }]);
        n += 1;
        Ok::<(), ()>(())
    })
    .unwrap();
    assert_eq!((n, s.frames_needed()), (1, 1), "one range, one frame");
    let wide = Strided { rstride: 64, ..s };
    assert_eq!(wide.frames_needed(), 3, "separate at the target: split by the cap");
    assert!(wide.split(wide.frames_needed()).iter().all(|p| p.count <= cap));
    let gappy_here = Strided { lstride: 64, ..s };
    assert_eq!(gappy_here.frames_needed(), 1, "touching at the target: one frame");
    assert_eq!(gappy_here.local_ranges().remaining(), 3 * cap, "walked lazily here");
}

#[test]
fn full_queue_refuses_at_once() {
    let q = WorkQueue::<u32>::new(4);
    q.reserve(3).unwrap();
    let e = q.reserve(2).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted);
    assert!(e.message.contains("3 of 4"), "{e}");
    q.reserve(1).unwrap();
    for i in 0..4 {
        q.push_reserved(i);
    }
    let mut out = vec![];
    assert!(q.pop_batch(&mut out, 16, Duration::from_millis(1)));
    assert_eq!(out, vec![0, 1, 2, 3], "one wake-up drains the batch in order");
    q.reserve(4).unwrap();
}

#[test]
fn lanes_go_to_their_worker_and_share_the_bound() {
    let q = WorkQueue::<u32>::with_lanes(3, 2);
    q.reserve(3).unwrap();
    assert!(q.reserve(1).is_err(), "lanes count against the same bound");
    q.push_reserved_lane(0, 10);
    q.push_reserved_lane(1, 11);
    q.push_reserved(12);
    let mut out = vec![];
    assert!(q.pop_weighted(Some(1), &mut out, 1, u64::MAX, |_| 0, Duration::ZERO));
    assert_eq!(out, vec![11], "a worker takes its own lane first");
    out.clear();
    assert!(q.pop_weighted(Some(1), &mut out, 8, u64::MAX, |_| 0, Duration::ZERO));
    assert_eq!(out, vec![12], "then shared items, never another lane");
    assert_eq!(q.pop(), Some(10));
    assert!(q.is_empty());
    q.reserve(3).unwrap();
}

#[test]
fn workers_wake_on_push_and_stop_on_close() {
    let q = Arc::new(WorkQueue::<u64>::new(1024));
    let total = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..3)
        .map(|_| {
            let q = q.clone();
            let total = total.clone();
            std::thread::spawn(move || {
                let mut out = vec![];
                while q.pop_batch(&mut out, 64, Duration::from_secs(5)) {
                    total.fetch_add(out.iter().sum::<u64>() as usize, Ordering::SeqCst);
                    out.clear();
                }
            })
        })
        .collect();
    let producers: Vec<_> = (0..4)
        .map(|_| {
            let q = q.clone();
            std::thread::spawn(move || {
                for i in 1..=1000u64 {
                    while q.reserve(1).is_err() {
                        std::thread::yield_now();
                    }
                    q.push_reserved(i);
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    q.close();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(total.load(Ordering::SeqCst), 4 * 500500);
}

#[test]
fn request_settles_once_and_times_out() {
    let r = Request::new(1, TransferOp::Write, "p", 8, 1, 2, Duration::from_millis(30), vec![], None);
    assert_eq!(r.status(), TransferStatus::Waiting);
    assert!(!r.part_done(&Ok(())));
    assert!(r.part_done(&Ok(())));
    assert!(r.settle(TransferStatus::Completed, None));
    assert!(!r.settle(TransferStatus::Failed, Some(Error::failed("late"))));
    assert_eq!(r.wait(None), TransferStatus::Completed);
    assert!(r.error().is_none());

    let t = Request::new(2, TransferOp::Read, "p", 8, 1, 1, Duration::from_millis(30), vec![], None);
    let t0 = Instant::now();
    assert_eq!(t.wait(Some(Duration::from_millis(5))), TransferStatus::Waiting);
    assert_eq!(t.wait(None), TransferStatus::Timeout);
    assert!(t0.elapsed() >= Duration::from_millis(30));
    assert_eq!(t.result().unwrap_err().status, Status::Timeout);
}

#[test]
fn waiter_wakes_on_settle() {
    let r = Arc::new(Request::new(3, TransferOp::Write, "p", 1, 1, 1, Duration::from_secs(10), vec![], None));
    let r2 = r.clone();
    let t = std::thread::spawn(move || r2.wait(None));
    std::thread::sleep(Duration::from_millis(20));
    r.settle(TransferStatus::Failed, Some(Error::not_connected("gone")));
    assert_eq!(t.join().unwrap(), TransferStatus::Failed);
    assert_eq!(r.error().unwrap().status, Status::NotConnected);
}

fn waiting(id: u64) -> Arc<Request> {
    Arc::new(Request::new(id, TransferOp::Write, "p", 8, 1, 1, Duration::from_secs(5), vec![], None))
}

fn readable(fd: std::os::fd::RawFd) -> bool {
    crate::sys::poll_one(fd, libc::POLLIN, 0).is_ok_and(|n| n == 1)
}

#[test]
fn settled_requests_report_their_token_once_and_wake_the_descriptor() {
    let q = Arc::new(CompletionQueue::new().unwrap());
    assert!(!readable(q.fd()));
    let (a, b) = (waiting(1), waiting(2));
    assert_eq!((a.report_to(&q, 101), b.report_to(&q, 102)), (Some(101), Some(102)));
    assert_eq!(b.report_to(&q, 999), Some(102), "a second call gets the first token");
    b.settle(TransferStatus::Completed, None);
    a.settle(TransferStatus::Failed, Some(Error::failed("x")));
    a.settle(TransferStatus::Completed, None); // lost race: reported already
    assert!(readable(q.fd()));
    assert_eq!(q.drain(), vec![102, 101]);
    assert!(!readable(q.fd()), "drained: nothing left to read");
    let late = waiting(3);
    late.settle(TransferStatus::Completed, None);
    assert_eq!(late.report_to(&q, 103), None, "already settled: the caller must not wait");
}

#[test]
fn a_hook_racing_the_settle_is_never_lost() {
    // Either the token arrives or report_to says the request had settled: never neither.
    let q = Arc::new(CompletionQueue::new().unwrap());
    for round in 0..2000u64 {
        let r = waiting(round);
        let r2 = r.clone();
        let t = std::thread::spawn(move || r2.settle(TransferStatus::Completed, None));
        let waiting_for_it = r.report_to(&q, round).is_some();
        t.join().unwrap();
        let got = q.drain();
        assert!(got.len() <= 1);
        assert!(!waiting_for_it || got == vec![round], "round {round}: token lost");
    }
}

/// A minimal executor: polls `f` on this thread, parking between wake-ups (no runtime).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn an_awaited_request_wakes_on_settle_and_at_its_deadline() {
    // Settled by another thread while the task waits.
    let r = waiting(1);
    let r2 = r.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        r2.settle(TransferStatus::Completed, None);
    });
    block_on(r.completion()).unwrap();
    t.join().unwrap();
    // Failed: the future gives its error.
    let f = waiting(2);
    let f2 = f.clone();
    std::thread::spawn(move || f2.settle(TransferStatus::Failed, Some(Error::failed("boom"))));
    assert_eq!(block_on(f.completion()).unwrap_err().message, "boom");
    // Nobody settles it: the deadline wakes it with TIMEOUT, on time.
    let slow =
        Arc::new(Request::new(3, TransferOp::Read, "p", 8, 1, 1, Duration::from_millis(80), vec![], None));
    let t0 = Instant::now();
    let err = block_on(slow.completion()).unwrap_err();
    assert_eq!(err.status, Status::Timeout);
    assert!(t0.elapsed() >= Duration::from_millis(75) && t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn every_task_awaiting_one_request_is_woken() {
    // Two tasks on two threads await the same request; settling it must wake both (one waker
    // slot used to keep only the last task polled).
    let r = waiting(9);
    let (a, b) = (r.clone(), r.clone());
    let ta = std::thread::spawn(move || block_on(a.completion()));
    let tb = std::thread::spawn(move || block_on(b.completion()));
    std::thread::sleep(Duration::from_millis(50)); // both are parked on it now
    r.settle(TransferStatus::Completed, None);
    assert!(ta.join().unwrap().is_ok() && tb.join().unwrap().is_ok());
}

#[test]
fn settled_awaited_requests_do_not_stay_with_the_deadline_thread() {
    for i in 0..3000 {
        let r = Arc::new(Request::new(
            i,
            TransferOp::Write,
            "p",
            8,
            1,
            1,
            Duration::from_secs(3600),
            vec![],
            None,
        ));
        let r2 = r.clone();
        let t = std::thread::spawn(move || r2.settle(TransferStatus::Completed, None));
        block_on(r.completion()).unwrap();
        t.join().unwrap();
    }
    let (due, watched) = super::future::watched_counts();
    // Other tests of this process may have a request watched at this moment: a few at most.
    assert!(watched <= 4 && due <= 2 * watched + 64, "due {due}, watched {watched}");
}

struct NoAbort(u64);
impl crate::registry::Abort for NoAbort {
    fn abort(&self, _: &str) {}

    fn holder_id(&self) -> u64 {
        self.0
    }
}

#[test]
fn a_part_proves_only_ranges_in_its_host_pins_and_keeps_them_after_the_request_lets_go() {
    use crate::registry::{new_holder_id, Abort, MemType, Registry};
    // Addresses only: nothing here touches the memory.
    let reg = Registry::new();
    let host = reg.register(0x10000, 0x1000, MemType::Host).unwrap();
    let dev = reg.register(0x20000, 0x1000, MemType::Device).unwrap();
    let holder: Arc<dyn Abort> = Arc::new(NoAbort(new_holder_id()));
    let pins = vec![host.pin(&holder).unwrap(), dev.pin(&holder).unwrap()];
    let req = Arc::new(Request::new(1, TransferOp::Write, "p", 16, 1, 1, Duration::from_secs(5), pins, None));
    let seg = |local| PartBody::Data(vec![SegPair { local, remote: 0, len: 16 }]);
    assert!(Part::new(req.clone(), seg(0x10010)).local().is_some());
    assert!(Part::new(req.clone(), seg(0x10ff8)).local().is_none(), "crosses the region's end");
    assert!(Part::new(req.clone(), seg(0x20010)).local().is_none(), "device memory");
    let st = Strided { local: 0x10000, remote: 0, count: 4, size: 16, lstride: 0x400, rstride: 16 };
    assert!(Part::new(req.clone(), PartBody::Strided(st)).local().is_some());
    let past_end = Strided { lstride: 0x600, ..st };
    assert!(Part::new(req.clone(), PartBody::Strided(past_end)).local().is_none());
    assert!(Part::new(req.clone(), PartBody::Notify(NotifyDesc::new("n", "m"))).local().is_none());

    let part = Part::new(req.clone(), seg(0x10010));
    let share = part.share(seg(0x10020));
    req.release_pins();
    assert!(Part::new(req.clone(), seg(0x10010)).local().is_none(), "made after the release");
    assert!(share.local().is_some(), "a share keeps the part's pins");
    let id = reg.lookup(0x10000, 0x1000, "local").unwrap().id;
    let removed = reg.remove_exact(id, 0x10000, 0x1000).unwrap();
    assert!(removed.close_and_drain(Duration::from_millis(20)).is_err(), "the parts still pin it");
    drop((part, share));
    assert!(removed.close_and_drain(Duration::from_millis(20)).is_ok(), "released with the last part");
}
