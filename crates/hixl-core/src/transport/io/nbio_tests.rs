//! Tests of `nbio`: frames, jobs and the read-ahead over real socket pairs.
use super::reader::{writable_prefix, zero_source, READ_AHEAD};
use super::*;
use crate::auth::FrameMac;
use crate::sys::mem::RawIov;
use crate::wire;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The tests' way in: raw addresses (the transports push proof values).
impl IoJob {
    /// Adds `len` bytes at `addr` (the tests' way in; the transports push [`PinnedRanges`]
    /// values).
    ///
    /// # Safety
    /// As for `RawIov::new`, until the job is dropped: the memory must stay valid (readable
    /// for a job that sends, writable for one that receives) while the job lives.
    unsafe fn push_raw(&mut self, addr: u64, len: u64) {
        // SAFETY: the caller's contract, which is the queue's.
        unsafe { self.q.push_raw(addr, len) }
    }

    /// Adds the ranges of a strided range, walked into iovecs only as the job gets to them
    /// (the tests' way in; the transports push a [`PinnedRanges`] value's strided shape).
    ///
    /// # Safety
    /// As for [`IoJob::push_raw`], for every range of `ranges`.
    unsafe fn push_strided(&mut self, ranges: StridedRanges) {
        // SAFETY: the caller's contract, which is the queue's.
        unsafe { self.q.push_strided(ranges) }
    }
}

#[test]
fn frames_arrive_across_many_reads_and_jobs_resume() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    let frame = wire::encode(&wire::Frame::Notify { name: "n".into(), msg: "x".repeat(300) }, 9, 0);
    let mut r = FrameReader::default();
    let mut mac = FrameMac::default();
    // Byte by byte: nothing until the last byte.
    for byte in &frame {
        r.begin_run();
        assert!(r.poll(a.as_raw_fd(), &mut mac).unwrap().is_none());
        assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &[*byte]).unwrap(), 1);
    }
    r.begin_run();
    let got = r.poll(a.as_raw_fd(), &mut mac).unwrap().expect("a whole frame");
    assert_eq!(got.header.tag, 9);
    assert!(matches!(got.frame, wire::Frame::Notify { ref msg, .. } if msg.len() == 300));

    // A job larger than the socket buffer goes out across several steps, in order.
    let src: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    let mut out = Outbox::default();
    let mut job = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(src.as_ptr() as u64, src.len() as u64) };
    out.push(job);
    let mut dst = vec![0u8; src.len()];
    let mut rj = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { rj.push_raw(dst.as_mut_ptr() as u64, dst.len() as u64) };
    let (mut steps, mut sent_done, mut recv_done) = (0, false, false);
    while !(sent_done && recv_done) {
        steps += 1;
        let mut budget = 1 << 20;
        sent_done = sent_done || out.flush(b.as_raw_fd(), &mut budget).unwrap() == Step::Done;
        let mut budget = 1 << 20;
        recv_done = recv_done || rj.recv(a.as_raw_fd(), &mut budget).unwrap() == Step::Done;
    }
    assert!(steps > 2, "the buffer is bigger than the socket's");
    assert_eq!(out.bytes, 0);
    assert!(src == dst);
}

#[test]
fn bytes_read_ahead_go_to_whoever_reads_next() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let note = |tag| wire::encode(&wire::Frame::Notify { name: "n".into(), msg: "m".into() }, tag, 0);
    // Frame, 5000 bulk bytes, frame, 300 bytes to drop, frame: all in the socket at once.
    let bulk: Vec<u8> = (0..5000).map(|i| (i % 241) as u8).collect();
    let mut all = note(1);
    all.extend_from_slice(&bulk);
    all.extend(note(2));
    all.extend(std::iter::repeat_n(7u8, 300));
    all.extend(note(3));
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &all).unwrap(), all.len());
    let (fd, mut mac, mut r) = (a.as_raw_fd(), FrameMac::default(), FrameReader::default());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 1);
    assert!(r.has_buffered(), "one read took the bulk after the first frame too");
    let mut dst = vec![0u8; bulk.len()];
    let mut job = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(dst.as_mut_ptr() as u64, 1000) };
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(dst.as_mut_ptr() as u64 + 1000, 4000) };
    let mut budget = u64::MAX;
    assert_eq!(r.recv_job(fd, &mut job, &mut budget).unwrap(), Step::Done);
    assert!(dst == bulk);
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 2);
    let (mut left, mut budget) = (300, u64::MAX);
    assert_eq!(r.discard(fd, &mut left, &mut budget).unwrap(), Step::Done);
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 3);
    assert!(!r.has_buffered());
    // The socket was found empty in this run: what arrives now waits for the next run
    // (the re-armed registration reports it) instead of costing a read here.
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &note(4)).unwrap(), note(4).len());
    assert!(r.poll(fd, &mut mac).unwrap().is_none());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 4);
    // A bulk larger than the read-ahead: the first part from the buffer, the rest straight
    // from the socket.
    let big: Vec<u8> = (0..3 * READ_AHEAD).map(|i| (i % 253) as u8).collect();
    let mut all = note(5);
    all.extend_from_slice(&big);
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &all).unwrap(), all.len());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 5);
    let mut dst = vec![0u8; big.len()];
    let mut job = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(dst.as_mut_ptr() as u64, dst.len() as u64) };
    assert_eq!(r.recv_job(fd, &mut job, &mut budget).unwrap(), Step::Done);
    assert!(dst == big);
    // Many small iovecs (more than one copy call takes), as a strided WRITE has.
    let small: Vec<u8> = (0..3000).map(|i| (i % 239) as u8).collect();
    let mut all = note(6);
    all.extend_from_slice(&small);
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &all).unwrap(), all.len());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 6);
    let mut dst = vec![0u8; 2 * small.len()];
    let mut job = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { (0..60).for_each(|i| job.push_raw(dst.as_mut_ptr() as u64 + i * 100, 50)) };
    assert_eq!(r.recv_job(fd, &mut job, &mut budget).unwrap(), Step::Done);
    let got: Vec<u8> = dst.chunks(100).flat_map(|c| c[..50].to_vec()).collect();
    assert!(got == small && dst.chunks(100).all(|c| c[50..].iter().all(|&x| x == 0)));
    // EOF is an error, also when the reader looks through its buffer first.
    drop(b);
    r.begin_run();
    assert!(matches!(r.poll(fd, &mut mac), Err(e) if e.kind() == io::ErrorKind::UnexpectedEof));
}

#[test]
fn bytes_read_ahead_into_memory_that_refuses_them_fail_with_efault() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let note = |tag| wire::encode(&wire::Frame::Notify { name: "n".into(), msg: "m".into() }, tag, 0);
    let mut all = note(1);
    all.extend(std::iter::repeat_n(9u8, 100));
    all.extend(note(2));
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &all).unwrap(), all.len());
    // SAFETY: a fresh anonymous page that nothing else uses, unmapped below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    let (fd, mut mac, mut r) = (a.as_raw_fd(), FrameMac::default(), FrameReader::default());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 1);
    let mut job = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(page as u64, 100) };
    let mut budget = u64::MAX;
    let err = r.recv_job(fd, &mut job, &mut budget).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    assert_eq!(job.moved, 0);
    // The refused bytes are still there to be skipped; the stream goes on.
    let (mut left, mut budget) = (100, u64::MAX);
    assert_eq!(r.discard(fd, &mut left, &mut budget).unwrap(), Step::Done);
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 2);
    // SAFETY: the page mapped above.
    unsafe { libc::munmap(page, 4096) };
}

#[test]
fn a_refused_bulk_is_skipped_within_the_budget_of_a_run() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let note = wire::encode(&wire::Frame::Notify { name: "n".into(), msg: "m".into() }, 1, 0);
    let mut all = note;
    all.extend(std::iter::repeat_n(5u8, 40_000));
    assert_eq!(crate::transport::io::send_some(b.as_raw_fd(), &all).unwrap(), all.len());
    let (fd, mut mac, mut r) = (a.as_raw_fd(), FrameMac::default(), FrameReader::default());
    r.begin_run();
    assert_eq!(r.poll(fd, &mut mac).unwrap().unwrap().header.tag, 1);
    let mut left = 40_000;
    let mut budget = 10_000;
    assert_eq!(r.discard(fd, &mut left, &mut budget).unwrap(), Step::WouldBlock);
    assert_eq!((left, budget), (30_000, 0), "no more than the budget in one run");
    r.begin_run();
    let mut budget = u64::MAX;
    assert_eq!(r.discard(fd, &mut left, &mut budget).unwrap(), Step::Done);
    assert_eq!(left, 0);
}

#[test]
fn the_writable_prefix_stops_at_memory_that_refuses_writes() {
    // SAFETY: two fresh anonymous pages; the second is made PROT_NONE, both unmapped below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    // SAFETY: the second page of the mapping above.
    assert_eq!(unsafe { libc::mprotect(page.cast::<u8>().add(4096).cast(), 4096, libc::PROT_NONE) }, 0);
    // SAFETY: the first page is ours and writable.
    unsafe { std::ptr::write_bytes(page.cast::<u8>(), 7, 4096) };
    let zero = zero_source().expect("/dev/zero");
    // SAFETY: the kernel checks the ranges (both in the mapping above, which outlives them);
    // the test expects it to stop at the second page.
    let dst = unsafe { [RawIov::new(page as u64 + 100, 1000), RawIov::new(page as u64 + 3000, 2000)] };
    assert_eq!(writable_prefix(zero, &dst), 1000 + 1096);
    // SAFETY: the first page is readable.
    let first = unsafe { std::slice::from_raw_parts(page.cast::<u8>(), 4096) };
    assert!(first[100..1100].iter().all(|&x| x == 0) && first[..100].iter().all(|&x| x == 7));
    // SAFETY: the mapping above.
    unsafe { libc::munmap(page, 8192) };
}

#[test]
fn a_strided_job_walks_its_ranges_lazily_with_a_bounded_window() {
    use crate::transport::io::IOV_MAX;
    use crate::wire::StridedRanges;
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    // 5000 elements of 3 bytes, 8 apart, between a head and a tail: more iovecs than IOV_MAX.
    let (count, size, stride) = (5000u64, 3u64, 8u64);
    let src: Vec<u8> = (0..count * stride).map(|i| (i % 251) as u8).collect();
    let mut job = IoJob::default();
    job.push_owned(b"head".to_vec());
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_strided(StridedRanges::new(src.as_ptr() as u64, count, size, stride).unwrap()) };
    // SAFETY: the buffer outlives the job.
    unsafe { job.push_raw(src.as_ptr() as u64, 5) };
    assert_eq!(job.left(), 4 + count * size + 5);
    assert_eq!(job.in_hand(), 1, "nothing of the strided range is expanded when it is pushed");
    let mut dst = vec![0u8; (count * stride) as usize];
    let mut head_tail = [0u8; 9];
    let mut rj = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { rj.push_raw(head_tail.as_mut_ptr() as u64, 4) };
    // SAFETY: the buffer outlives the job.
    unsafe { rj.push_strided(StridedRanges::new(dst.as_mut_ptr() as u64, count, size, stride).unwrap()) };
    // SAFETY: the buffer outlives the job.
    unsafe { rj.push_raw(head_tail.as_mut_ptr() as u64 + 4, 5) };
    let (mut sent, mut got) = (false, false);
    while !(sent && got) {
        let mut budget = 4096;
        sent = sent || job.send(b.as_raw_fd(), &mut budget).unwrap() == Step::Done;
        let mut budget = 4096;
        got = got || rj.recv(a.as_raw_fd(), &mut budget).unwrap() == Step::Done;
        assert!(job.in_hand() <= IOV_MAX + 1 && rj.in_hand() <= IOV_MAX + 1, "bounded window");
    }
    assert_eq!((job.left(), rj.left()), (0, 0));
    assert_eq!(&head_tail[..4], b"head");
    assert_eq!(&head_tail[4..], &src[..5]);
    for k in 0..count as usize {
        let at = k * stride as usize;
        assert_eq!(&dst[at..at + size as usize], &src[at..at + size as usize], "element {k}");
        assert!(dst[at + size as usize..at + stride as usize].iter().all(|&x| x == 0), "gap {k}");
    }
    // Touching elements are one iovec, however many there are.
    let mut one = IoJob::default();
    // SAFETY: the buffer outlives the job.
    unsafe { one.push_strided(StridedRanges::new(src.as_ptr() as u64, src.len() as u64, 1, 1).unwrap()) };
    assert_eq!((one.refill().len(), one.left()), (1, src.len() as u64));
}

#[test]
fn a_header_is_checked_before_its_payload_is_set_aside() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    b.set_nonblocking(true).unwrap();
    let (fd, mut mac) = (a.as_raw_fd(), FrameMac::default());
    // A kind that never travels to a target, declaring 16 MiB: refused on its header.
    let mut r = FrameReader::after_handshake(true);
    let h =
        wire::Header { kind: wire::Kind::Welcome, payload_len: wire::MAX_TABLE_PAYLOAD, tag: 0, bulk_len: 0 };
    crate::transport::io::send_some(b.as_raw_fd(), &wire::encode_header(&h)).unwrap();
    r.begin_run();
    let e = r.poll(fd, &mut mac).err().expect("refused");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("unexpected Welcome frame from an initiator"), "{e}");
    assert_eq!(r.payload_capacity(), 0, "nothing set aside for it");
    // An initiator's reader refuses what only initiators send.
    let (c, d) = UnixStream::pair().unwrap();
    c.set_nonblocking(true).unwrap();
    let mut r = FrameReader::after_handshake(false);
    let h = wire::Header { kind: wire::Kind::Write, payload_len: 20, tag: 0, bulk_len: 0 };
    crate::transport::io::send_some(d.as_raw_fd(), &wire::encode_header(&h)).unwrap();
    r.begin_run();
    assert!(r.poll(c.as_raw_fd(), &mut mac).is_err());

    // An allowed kind: its buffer grows with the bytes that came, not with the header.
    let segs = (0..wire::MAX_DESCS as u64).map(|i| wire::Seg { addr: 0x1000 + 64 * i, len: 1 }).collect();
    let frame = wire::encode(&wire::Frame::Read { segs }, 4, 0);
    let mut r = FrameReader::after_handshake(true);
    crate::transport::io::send_some(b.as_raw_fd(), &frame[..wire::HEADER_LEN + 100]).unwrap();
    r.begin_run();
    assert!(r.poll(fd, &mut mac).unwrap().is_none());
    assert!(
        r.payload_capacity() <= crate::transport::io::PAYLOAD_START,
        "{} set aside for 100 bytes",
        r.payload_capacity()
    );
    let mut off = wire::HEADER_LEN + 100;
    let got = loop {
        off += crate::transport::io::send_some(b.as_raw_fd(), &frame[off..]).unwrap();
        r.begin_run();
        if let Some(g) = r.poll(fd, &mut mac).unwrap() {
            break g;
        }
        assert!(
            r.payload_capacity() <= 2 * off + crate::transport::io::PAYLOAD_START,
            "at most twice what arrived"
        );
    };
    assert!(matches!(got.frame, wire::Frame::Read { ref segs } if segs.len() == wire::MAX_DESCS));
}
