//! Two engines in one process over TCP loopback: real sockets, bytes compared exactly.

use std::collections::HashMap;
use std::time::Duration;

use hixl_core::{
    ConnectStatus, Engine, MemDesc, MemType, NotifyDesc, Status, TransferOp, TransferOpDesc, TransferStatus,
};

const T: Duration = Duration::from_secs(10);

fn engine(listen: &str, opts: &[(&str, &str)]) -> Engine {
    let e = Engine::new();
    let o: HashMap<String, String> = opts.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    e.initialize(listen, &o).unwrap();
    e
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

struct Pair {
    a: Engine,
    b: Engine,
    peer: String,
    abuf: Vec<u8>,
    bbuf: Vec<u8>,
    /// `b`'s registration of `bbuf` (deregistering needs its own handle: another id is stale).
    bh: hixl_core::MemHandle,
}

/// Two engines; the TCP data path unless `opts` names other `hixl.backends`.
fn pair(size: usize, opts: &[(&str, &str)]) -> Pair {
    let mut opts = opts.to_vec();
    if !opts.iter().any(|(k, _)| *k == "hixl.backends") {
        opts.push(("hixl.backends", "tcp"));
    }
    let opts = &opts[..];
    let a = engine("127.0.0.1", opts);
    let b = engine("127.0.0.1:0", opts);
    let mut abuf = vec![0u8; size];
    let mut bbuf = vec![0u8; size];
    unsafe { a.register_mem(MemDesc { addr: abuf.as_mut_ptr() as u64, len: size as u64 }, MemType::Host) }
        .unwrap();
    let bh = unsafe {
        b.register_mem(MemDesc { addr: bbuf.as_mut_ptr() as u64, len: size as u64 }, MemType::Host)
    }
    .unwrap();
    let peer = b.local_engine().unwrap();
    a.connect(&peer, T).unwrap();
    Pair { a, b, peer, abuf, bbuf, bh }
}

#[test]
fn write_then_read_back_large_and_scattered() {
    for (size, streams) in [(64usize << 20, "2"), (3 << 20, "1"), (1, "4")] {
        let mut p = pair(size.max(1 << 16), &[("hixl.tcp.streams", streams)]);
        fill(&mut p.abuf[..size], size as u64);
        let la = p.abuf.as_ptr() as u64;
        let rb = p.bbuf.as_ptr() as u64;
        p.a.put(&p.peer, la, rb, size as u64, T).unwrap();
        assert!(p.bbuf[..size] == p.abuf[..size], "write of {size} B");
        // Read back into a zeroed local buffer.
        let want = p.abuf[..size].to_vec();
        p.abuf.fill(0);
        p.a.get(&p.peer, la, rb, size as u64, T).unwrap();
        assert!(p.abuf[..size] == want[..], "read of {size} B");
        drop(p.a);
        drop(p.b);
    }

    // 4096 scattered 512-byte blocks in a permuted order, in one call.
    let n = 4096usize;
    let mut p = pair(n * 512 * 2, &[]);
    fill(&mut p.abuf, 99);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let descs: Vec<_> = (0..n)
        .map(|i| TransferOpDesc {
            local_addr: la + (i * 1024) as u64,
            remote_addr: rb + (((i * 7919) % n) * 1024) as u64,
            len: 512,
        })
        .collect();
    p.a.transfer_sync(&p.peer, TransferOp::Write, &descs, T).unwrap();
    for i in 0..n {
        let r = ((i * 7919) % n) * 1024;
        assert_eq!(&p.bbuf[r..r + 512], &p.abuf[i * 1024..i * 1024 + 512]);
        assert!(p.bbuf[r + 512..r + 1024].iter().all(|&b| b == 0), "gap bytes untouched");
    }
    let stats = p.a.stats().unwrap();
    assert_eq!(stats[0].bytes_write, (n * 512) as u64);
    assert_eq!(stats[0].backend, "tcp");
}

#[test]
fn bad_ranges_are_refused_and_nothing_is_written() {
    let mut p = pair(4096, &[]);
    fill(&mut p.abuf, 1);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let e = p.a.put(&p.peer, la, rb + 4000, 100, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid);
    assert!(e.message.contains("remote range"), "{e}");
    let e = p.a.put(&p.peer, la - 1, rb, 10, T).unwrap_err();
    assert!(e.message.contains("local range"), "{e}");
    // A good descriptor followed by a bad one: the whole batch is refused.
    let e =
        p.a.transfer_sync(
            &p.peer,
            TransferOp::Write,
            &[
                TransferOpDesc { local_addr: la, remote_addr: rb, len: 10 },
                TransferOpDesc { local_addr: la, remote_addr: rb, len: 0 },
            ],
            T,
        )
        .unwrap_err();
    assert!(e.message.contains("descriptor 1"), "{e}");
    assert!(p.bbuf.iter().all(|&b| b == 0), "nothing was written");
    let e = p.a.transfer_sync("127.0.0.1:1", TransferOp::Write, &[], T).unwrap_err();
    assert_eq!(e.status, Status::NotConnected);
    let _ = &mut p.bbuf;
}

#[test]
fn target_refuses_ranges_it_no_longer_has() {
    // The initiator's table is from connect time; the target checks again and refuses.
    let mut p = pair(8192, &[]);
    let rb = p.bbuf.as_ptr() as u64;
    p.b.deregister_mem(&p.bh).unwrap();
    fill(&mut p.abuf, 3);
    let la = p.abuf.as_ptr() as u64;
    let e = p.a.put(&p.peer, la, rb, 8192, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
    assert!(p.bbuf.iter().all(|&b| b == 0));
    // The link is still usable afterwards, and a region registered later becomes reachable
    // once the target's table update arrives.
    let mut other = vec![0u8; 64];
    unsafe { p.b.register_mem(MemDesc { addr: other.as_mut_ptr() as u64, len: 64 }, MemType::Host) }.unwrap();
    let d = [TransferOpDesc { local_addr: la, remote_addr: other.as_ptr() as u64, len: 64 }];
    let t0 = std::time::Instant::now();
    while let Err(e) = p.a.transfer_sync(&p.peer, TransferOp::Write, &d, T) {
        assert_eq!(e.status, Status::ParamInvalid, "{e}");
        assert!(t0.elapsed() < T, "the table update never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(&other[..], &p.abuf[..64]);
}

#[test]
fn connect_rules_and_async_status() {
    let a = engine("127.0.0.1", &[]);
    let b = engine("[::1]:0", &[]);
    let peer = b.local_engine().unwrap();
    assert!(peer.starts_with("[::1]:"), "{peer}");
    a.connect(&peer, T).unwrap();
    assert_eq!(a.connect(&peer, T).unwrap_err().status, Status::AlreadyConnected);
    assert_eq!(a.get_async_connect_status(&peer).unwrap(), ConnectStatus::Connected);
    a.disconnect(&peer, T).unwrap();
    assert_eq!(a.get_async_connect_status(&peer).unwrap(), ConnectStatus::NotConnect);
    a.connect_async(&peer).unwrap();
    let t0 = std::time::Instant::now();
    while a.get_async_connect_status(&peer).unwrap() == ConnectStatus::Connecting {
        assert!(t0.elapsed() < T);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.get_async_connect_status(&peer).unwrap(), ConnectStatus::Connected);

    // Nobody listening: TIMEOUT within the deadline.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap().to_string();
    drop(l);
    let t0 = std::time::Instant::now();
    let e = a.connect(&dead, Duration::from_millis(200)).unwrap_err();
    assert_eq!(e.status, Status::Timeout, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(a.connect("nonsense", T).unwrap_err().status, Status::ParamInvalid);
}

#[test]
fn notify_follows_data_and_finalize_fails_everything() {
    let mut p = pair(1 << 20, &[]);
    fill(&mut p.abuf, 5);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let req =
        p.a.transfer_async(
            &p.peer,
            TransferOp::Write,
            &[TransferOpDesc { local_addr: la, remote_addr: rb, len: 1 << 20 }],
            Some(NotifyDesc::new("layer", "0")),
            None,
        )
        .unwrap();
    // Poll the target: when the notify is there, the bytes must be there.
    let t0 = std::time::Instant::now();
    let got = loop {
        let n = p.b.get_notifies().unwrap();
        if !n.is_empty() {
            break n;
        }
        assert!(t0.elapsed() < T, "notify never arrived");
        std::thread::yield_now();
    };
    assert!(p.bbuf == p.abuf, "data visible before the notify");
    assert_eq!(got, vec![NotifyDesc::new("layer", "0")]);
    assert_eq!(got[0].peer, p.a.local_engine().unwrap(), "it names the engine it came from");
    assert_eq!(req.wait(Some(T)), TransferStatus::Completed);
    p.a.send_notify(&p.peer, NotifyDesc::new("n", "m"), T).unwrap();
    assert_eq!(p.b.get_notifies().unwrap().len(), 1);
    assert!(p.b.get_notifies().unwrap().is_empty(), "get_notifies clears");

    p.a.finalize().unwrap();
    p.a.finalize().unwrap();
    let e = unsafe { p.a.register_mem(MemDesc { addr: la, len: 1 }, MemType::Host) }.unwrap_err();
    assert_eq!(e.status, Status::Failed);
    assert!(e.message.contains("finalized"), "{e}");
}

#[test]
fn notify_cap_per_peer() {
    let p = pair(64, &[("hixl.max_notifies", "3")]);
    for i in 0..3 {
        p.a.send_notify(&p.peer, NotifyDesc::new(format!("{i}"), ""), T).unwrap();
    }
    let e = p.a.send_notify(&p.peer, NotifyDesc::default(), T).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted, "{e}");
    assert_eq!(p.b.get_notifies().unwrap().len(), 3);
    p.a.send_notify(&p.peer, NotifyDesc::default(), T).unwrap();
}

#[test]
fn full_queue_is_resource_exhausted() {
    let mut p = pair(1 << 20, &[("hixl.queue_depth", "2"), ("hixl.tcp.streams", "1")]);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let d = [TransferOpDesc { local_addr: la, remote_addr: rb, len: 1 << 20 }];
    let mut reqs = vec![];
    let mut exhausted = None;
    for _ in 0..200 {
        match p.a.transfer_async(&p.peer, TransferOp::Write, &d, None, None) {
            Ok(r) => reqs.push(r),
            Err(e) => {
                exhausted = Some(e);
                break;
            }
        }
    }
    let e = exhausted.expect("a 2-slot queue must fill up");
    assert_eq!(e.status, Status::ResourceExhausted);
    for r in reqs {
        assert_eq!(r.wait(Some(T)), TransferStatus::Completed);
    }
    let _ = &mut p.bbuf;
}

#[test]
fn peer_finalize_fails_pending_requests() {
    let mut p = pair(64 << 20, &[("hixl.tcp.streams", "1")]);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let d = [TransferOpDesc { local_addr: la, remote_addr: rb, len: 64 << 20 }];
    let reqs: Vec<_> =
        (0..8).map(|_| p.a.transfer_async(&p.peer, TransferOp::Write, &d, None, None).unwrap()).collect();
    p.b.finalize().unwrap();
    for r in reqs {
        let s = r.wait(Some(T));
        assert!(s == TransferStatus::Completed || s == TransferStatus::Failed, "{s:?}");
    }
    // Once the initiator noticed (it first receives the peer's emptied table, then EOF):
    let t0 = std::time::Instant::now();
    while p.a.get_async_connect_status(&p.peer).unwrap() != ConnectStatus::ConnectFailed {
        assert!(t0.elapsed() < T, "the link never died");
        std::thread::sleep(Duration::from_millis(1));
    }
    let e = p.a.transfer_sync(&p.peer, TransferOp::Write, &d, T).unwrap_err();
    assert_eq!(e.status, Status::NotConnected, "{e}");
    let _ = &mut p.bbuf;
}

#[test]
fn forced_shm_moves_bytes_and_names_the_backend() {
    // Two engines of one process: auto picks the `self` backend (memcpy) over shm.
    for (transport, backend) in [("shm", "shm"), ("auto", "self")] {
        let size = 8 << 20;
        let mut p = pair(size, &[("hixl.backends", transport)]);
        fill(&mut p.abuf, 77);
        let la = p.abuf.as_ptr() as u64;
        let rb = p.bbuf.as_ptr() as u64;
        // Large (split over the copy threads), scattered small, and a READ back.
        p.a.put(&p.peer, la, rb, size as u64, T).unwrap();
        assert!(p.bbuf == p.abuf);
        let descs: Vec<_> = (0..3000u64)
            .map(|i| TransferOpDesc {
                local_addr: la + i * 1024,
                remote_addr: rb + ((i * 7) % 3000) * 1024 + 8,
                len: 100,
            })
            .collect();
        p.bbuf.fill(0);
        p.a.transfer_sync(&p.peer, TransferOp::Write, &descs, T).unwrap();
        for i in 0..3000usize {
            let r = ((i * 7) % 3000) * 1024 + 8;
            assert_eq!(&p.bbuf[r..r + 100], &p.abuf[i * 1024..i * 1024 + 100]);
            assert_eq!(p.bbuf[r - 1], 0);
            assert_eq!(p.bbuf[r + 100], 0);
        }
        let want = p.bbuf.clone();
        p.abuf.fill(0);
        p.a.get(&p.peer, la, rb, size as u64, T).unwrap();
        assert!(p.abuf == want);
        let st = p.a.stats().unwrap();
        assert_eq!(st[0].backend, backend, "{transport}");
        assert_eq!(st[0].bytes_read, size as u64);
        // Notify after data over the control link.
        let req =
            p.a.transfer_async(
                &p.peer,
                TransferOp::Write,
                &[TransferOpDesc { local_addr: la, remote_addr: rb, len: 4096 }],
                Some(NotifyDesc::new("n", "m")),
                None,
            )
            .unwrap();
        assert_eq!(req.wait(Some(T)), TransferStatus::Completed);
        assert_eq!(p.b.get_notifies().unwrap().len(), 1);
    }
}

#[test]
fn self_backend_checks_the_target_registry_itself() {
    // The `self` path copies without a frame, so the target's own registry must refuse what its
    // server would: ranges outside regions, writes into read-only regions, removed regions.
    let mut p = pair(1 << 16, &[("hixl.backends", "auto")]);
    assert_eq!(p.a.stats().unwrap()[0].backend, "self");
    let la = p.abuf.as_ptr() as u64;
    let mut ro = vec![7u8; 4096];
    let h = unsafe {
        p.b.register_mem_access(
            MemDesc { addr: ro.as_mut_ptr() as u64, len: 4096 },
            MemType::Host,
            hixl_core::Access::ReadOnly,
        )
    };
    let h = h.unwrap();
    let e = p.a.put(&p.peer, la, h.addr, 64, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
    assert!(ro.iter().all(|&b| b == 7), "a read-only region was written");
    p.b.deregister_mem(&h).unwrap();
    let e = p.a.get(&p.peer, la, h.addr, 64, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
    let _ = &mut p.bbuf;
}

#[test]
fn deregistered_target_region_is_dropped_from_shm_tables() {
    let mut p = pair(1 << 16, &[("hixl.backends", "shm")]);
    let la = p.abuf.as_ptr() as u64;
    let rb = p.bbuf.as_ptr() as u64;
    let d = [TransferOpDesc { local_addr: la, remote_addr: rb, len: 4096 }];
    p.a.transfer_sync(&p.peer, TransferOp::Write, &d, T).unwrap();
    // The target deregisters: it returns only after the initiator confirmed the new table.
    p.b.deregister_mem(&p.bh).unwrap();
    p.bbuf.fill(0);
    let e = p.a.transfer_sync(&p.peer, TransferOp::Write, &d, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
    assert!(p.bbuf.iter().all(|&b| b == 0), "nothing written into the deregistered region");
    // And a newly registered region becomes usable without reconnecting.
    let mut fresh = vec![0u8; 4096];
    unsafe { p.b.register_mem(MemDesc { addr: fresh.as_mut_ptr() as u64, len: 4096 }, MemType::Host) }
        .unwrap();
    let d2 = [TransferOpDesc { local_addr: la, remote_addr: fresh.as_ptr() as u64, len: 4096 }];
    let t0 = std::time::Instant::now();
    loop {
        match p.a.transfer_sync(&p.peer, TransferOp::Write, &d2, T) {
            Ok(()) => break,
            Err(e) if t0.elapsed() < T => assert_eq!(e.status, Status::ParamInvalid),
            Err(e) => panic!("update never arrived: {e}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(&fresh[..], &p.abuf[..4096]);
}

#[test]
fn engine_allocated_peer_memory_is_copied_through_a_mapping() {
    let a = engine("127.0.0.1", &[("hixl.backends", "shm")]);
    let b = engine("127.0.0.1:0", &[]);
    let peer = b.local_engine().unwrap();
    let (bh, bmem) = b.alloc(3 << 20).unwrap();
    assert_eq!(bh.addr % (2 << 20), 0);
    assert_eq!(bh.len, 4 << 20);
    let mut src = vec![0u8; 1 << 20];
    fill(&mut src, 9);
    unsafe {
        a.register_mem(MemDesc { addr: src.as_mut_ptr() as u64, len: src.len() as u64 }, MemType::Host)
    }
    .unwrap();
    a.connect(&peer, T).unwrap();
    let d = [TransferOpDesc { local_addr: src.as_ptr() as u64, remote_addr: bh.addr + 100, len: 1 << 20 }];
    a.transfer_sync(&peer, TransferOp::Write, &d, T).unwrap();
    // SAFETY: the allocation is alive (we hold `bmem`) and 4 MiB long.
    let target = unsafe { std::slice::from_raw_parts(bmem.addr() as *const u8, bmem.len() as usize) };
    assert_eq!(&target[100..100 + (1 << 20)], &src[..]);
    assert!(target[..100].iter().all(|&x| x == 0) && target[100 + (1 << 20)..].iter().all(|&x| x == 0));
    src.fill(0);
    a.transfer_sync(&peer, TransferOp::Read, &d, T).unwrap();
    assert_eq!(&target[100..100 + (1 << 20)], &src[..]);
    assert!(a.stats().unwrap()[0].direct_parts >= 2, "copied through the mapping, not CMA");
    // Deregistered at the target: refused, nothing written.
    b.deregister_mem(&bh).unwrap();
    let e = a.transfer_sync(&peer, TransferOp::Write, &d, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid, "{e}");
}

#[test]
fn strided_put_get_repacks_and_leaves_padding_alone() {
    use hixl_core::StridedDesc;
    for transport in ["tcp", "shm"] {
        // Force splitting over the streams/threads too.
        let mut p = pair(1 << 20, &[("hixl.backends", transport), ("hixl.split_bytes", "4096")]);
        fill(&mut p.abuf, 21);
        let (la, rb) = (p.abuf.as_ptr() as u64, p.bbuf.as_ptr() as u64);
        let la = la.div_ceil(64) * 64;
        let rb = rb.div_ceil(64) * 64;
        let (lo, ro) = ((la - p.abuf.as_ptr() as u64) as usize, (rb - p.bbuf.as_ptr() as u64) as usize);
        // 300 elements of 192 bytes: 256-byte stride here, re-packed at a 320-byte stride there.
        let d = StridedDesc { count: 300, size: 192, stride: 256, remote_stride: Some(320) };
        p.a.put_strided(&p.peer, la, rb, &d, T).unwrap();
        for i in 0..300usize {
            let (l, r) = (lo + i * 256, ro + i * 320);
            assert_eq!(&p.bbuf[r..r + 192], &p.abuf[l..l + 192], "element {i} ({transport})");
            assert!(p.bbuf[r + 192..r + 320].iter().all(|&x| x == 0), "padding after {i} untouched");
        }
        assert!(p.bbuf[..ro].iter().all(|&x| x == 0) && p.bbuf[ro + 300 * 320..].iter().all(|&x| x == 0));
        // Read it back into a zeroed local layout with the local stride.
        let want: Vec<u8> = p.abuf.clone();
        p.abuf.fill(0);
        p.a.get_strided(&p.peer, la, rb, &d, T).unwrap();
        for i in 0..300usize {
            let l = lo + i * 256;
            assert_eq!(&p.abuf[l..l + 192], &want[l..l + 192]);
            assert!(p.abuf[l + 192..l + 256].iter().all(|&x| x == 0));
        }
        let st = p.a.stats().unwrap();
        assert_eq!(st[0].backend, transport);
        assert_eq!(st[0].bytes_write, 300 * 192);
    }
}

#[test]
fn strided_validation_names_field_and_value() {
    use hixl_core::StridedDesc;
    let p = pair(1 << 16, &[]);
    let la = (p.abuf.as_ptr() as u64).div_ceil(64) * 64;
    let rb = (p.bbuf.as_ptr() as u64).div_ceil(64) * 64;
    let d = |count, size, stride, rs| StridedDesc { count, size, stride, remote_stride: rs };
    let cases = [
        (la, rb, d(0, 64, 64, None), "count=0"),
        (la, rb, d(4, 0, 64, None), "size=0"),
        (la, rb, d(4, 128, 64, None), "stride=64 is smaller than size=128"),
        (la, rb, d(4, 64, 64, Some(32)), "remote_stride=32"),
        (la + 8, rb, d(4, 64, 64, None), "local_base="),
        (la, rb + 8, d(4, 64, 64, None), "remote_base="),
        (la, rb, d(4, 64, 96, None), "stride=0x60 (96) is not a multiple of 64"),
        (la, rb, d(1 << 20, 64, 64, None), "one region"),
        (la, rb, d(2, 64, 1 << 40, None), "local strided range"),
    ];
    for (l, r, desc, words) in cases {
        let e = p.a.put_strided(&p.peer, l, r, &desc, T).unwrap_err();
        assert_eq!(e.status, Status::ParamInvalid, "{e}");
        assert!(e.message.contains(words), "{words:?} not in {e}");
    }
    // Relaxed alignment accepts odd bases and strides.
    let q = pair(1 << 16, &[("hixl.strict_alignment", "0")]);
    let la = q.abuf.as_ptr() as u64 + 3;
    let rb = q.bbuf.as_ptr() as u64 + 5;
    q.a.put_strided(&q.peer, la, rb, &d(10, 7, 13, Some(11)), T).unwrap();
    for i in 0..10usize {
        assert_eq!(&q.bbuf[5 + i * 11..5 + i * 11 + 7], &q.abuf[3 + i * 13..3 + i * 13 + 7]);
    }
}

#[test]
fn coalesced_small_requests_complete_individually() {
    let mut p = pair(1 << 20, &[("hixl.tcp.coalesce_us", "200"), ("hixl.tcp.streams", "1")]);
    fill(&mut p.abuf, 8);
    let (la, rb) = (p.abuf.as_ptr() as u64, p.bbuf.as_ptr() as u64);
    let reqs: Vec<_> = (0..256u64)
        .map(|i| {
            let d = [TransferOpDesc { local_addr: la + i * 4096, remote_addr: rb + i * 4096, len: 4096 }];
            let n = (i % 64 == 0).then(|| NotifyDesc::new(format!("n{i}"), ""));
            p.a.transfer_async(&p.peer, TransferOp::Write, &d, n, None).unwrap()
        })
        .collect();
    for r in &reqs {
        assert_eq!(r.wait(Some(T)), TransferStatus::Completed);
    }
    assert!(p.bbuf == p.abuf);
    assert_eq!(p.b.get_notifies().unwrap().len(), 4);
    assert_eq!(p.a.stats().unwrap()[0].ops_write, 256);
}

#[test]
fn remote_mems_follows_registrations_after_connect() {
    let p = pair(4096, &[]);
    assert_eq!(p.a.remote_mems(&p.peer).unwrap().len(), 1);
    let mut late = vec![0u8; 8192];
    let h = unsafe { p.b.register_mem(MemDesc { addr: late.as_mut_ptr() as u64, len: 8192 }, MemType::Host) }
        .unwrap();
    let has = |want: bool| {
        let deadline = std::time::Instant::now() + T;
        loop {
            let now = p.a.remote_mems(&p.peer).unwrap().iter().any(|m| m.addr == h.addr && m.len == 8192);
            if now == want {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "remote_mems never showed want={want}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    has(true);
    p.b.deregister_mem(&h).unwrap();
    has(false);
    drop(late);
}

/// Connects an initiator with `mine` to a target with `theirs` (secrets; None = none).
fn connect_with_secrets(
    mine: Option<&str>,
    theirs: Option<&str>,
) -> (Engine, Engine, String, hixl_core::Result<()>) {
    fn opt(s: Option<&str>) -> Vec<(&str, &str)> {
        let mut v = vec![("hixl.backends", "tcp")];
        if let Some(s) = s {
            v.push(("hixl.secret", s));
        }
        v
    }
    let a = engine("127.0.0.1", &opt(mine));
    let b = engine("127.0.0.1:0", &opt(theirs));
    let peer = b.local_engine().unwrap();
    let res = a.connect(&peer, T);
    (a, b, peer, res)
}

#[test]
fn cluster_secret_is_mutual_and_never_shown() {
    let (a, b, peer, res) = connect_with_secrets(
        Some("0e4080cdd1c8866ef98f22bde1b479b8"),
        Some("0e4080cdd1c8866ef98f22bde1b479b8"),
    );
    res.unwrap();
    let mut src = vec![9u8; 4096];
    let mut dst = vec![0u8; 4096];
    let hs = unsafe { a.register_mem(MemDesc { addr: src.as_mut_ptr() as u64, len: 4096 }, MemType::Host) }
        .unwrap();
    let hd = unsafe { b.register_mem(MemDesc { addr: dst.as_mut_ptr() as u64, len: 4096 }, MemType::Host) }
        .unwrap();
    // The table update of `hd` may still be on its way.
    let deadline = std::time::Instant::now() + T;
    while !a.remote_mems(&peer).unwrap().iter().any(|m| m.addr == hd.addr) {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    a.put(&peer, hs.addr, hd.addr, 4096, T).unwrap();
    assert!(dst.iter().all(|&x| x == 9));

    for (mine, theirs, says) in [
        (None, Some("0e4080cdd1c8866ef98f22bde1b479b8"), "requires a cluster secret"),
        (
            Some("f6a1c0e83b2d49577e1f0a9c5d3b8e26"),
            Some("0e4080cdd1c8866ef98f22bde1b479b8"),
            "does not know this cluster's secret",
        ),
        (Some("0e4080cdd1c8866ef98f22bde1b479b8"), None, "did not authenticate"),
    ] {
        let (_a, _b, _peer, res) = connect_with_secrets(mine, theirs);
        let e = res.unwrap_err();
        assert_eq!(e.status, Status::NotConnected, "{e}");
        assert!(e.message.contains(says), "{e}");
        assert!(!e.message.contains("0e4080"), "the secret leaked into: {e}");
    }
    // A misspelt option key never echoes its value.
    let e = Engine::new()
        .initialize(
            "127.0.0.1",
            &[("hixl.secrte".to_string(), "0e4080cdd1c8866ef98f22bde1b479b8".to_string())].into(),
        )
        .unwrap_err();
    assert!(!e.message.contains("0e4080") && e.message.contains("hixl.secrte"), "{e}");
}

#[test]
fn read_only_regions_can_be_read_not_written() {
    let a = engine("127.0.0.1", &[("hixl.backends", "tcp")]);
    let b = engine("127.0.0.1:0", &[]);
    let mut ro = vec![5u8; 8192];
    let mut local = vec![0u8; 8192];
    let h = unsafe {
        b.register_mem_access(
            MemDesc { addr: ro.as_mut_ptr() as u64, len: 8192 },
            MemType::Host,
            hixl_core::Access::ReadOnly,
        )
    }
    .unwrap();
    let l = unsafe { a.register_mem(MemDesc { addr: local.as_mut_ptr() as u64, len: 8192 }, MemType::Host) }
        .unwrap();
    let peer = b.local_engine().unwrap();
    a.connect(&peer, T).unwrap();
    a.get(&peer, l.addr, h.addr, 8192, T).unwrap();
    assert!(local.iter().all(|&x| x == 5));
    local.fill(1);
    let e = a.put(&peer, l.addr, h.addr + 100, 64, T).unwrap_err();
    assert_eq!(e.status, Status::ParamInvalid);
    assert!(e.message.contains("read-only"), "{e}");
    assert!(ro.iter().all(|&x| x == 5));
    // Registering the same range read-write while it is read-only is refused.
    let e = unsafe { b.register_mem(MemDesc { addr: ro.as_mut_ptr() as u64, len: 8192 }, MemType::Host) }
        .unwrap_err();
    assert!(e.message.contains("access=\"r\""), "{e}");
}

// Lifecycle: the tests named `lifecycle_*` also run under valgrind in CI (.ci/run), which
// would report any use of freed memory or a read of memory the engine no longer owns.

#[test]
fn lifecycle_deregister_while_a_transfer_uses_the_region() {
    for transport in ["tcp", "shm"] {
        let mut p = pair(32 << 20, &[("hixl.backends", transport), ("hixl.deregister_timeout_ms", "50")]);
        let mut local = vec![3u8; 32 << 20];
        let h = unsafe {
            p.a.register_mem(MemDesc { addr: local.as_mut_ptr() as u64, len: 32 << 20 }, MemType::Host)
        }
        .unwrap();
        let d = [TransferOpDesc { local_addr: h.addr, remote_addr: p.bbuf.as_ptr() as u64, len: 32 << 20 }];
        let reqs: Vec<_> = (0..16)
            .map(|_| p.a.transfer_async(&p.peer, TransferOp::Write, &d, None, None).unwrap())
            .collect();
        let _ = p.a.deregister_mem(&h); // waits 50 ms for the transfers, then aborts them
        for r in &reqs {
            let s = r.wait(Some(T));
            assert!(s == TransferStatus::Completed || s == TransferStatus::Failed, "{transport}: {s:?}");
        }
        drop(local); // freed only now that nothing can touch it
        let e = p.a.transfer_sync(&p.peer, TransferOp::Write, &d, T).unwrap_err();
        assert!(matches!(e.status, Status::ParamInvalid | Status::NotConnected), "{e}");
        let _ = &mut p.abuf;
    }
}

#[test]
fn lifecycle_finalize_with_requests_in_flight_twice_and_after() {
    for transport in ["tcp", "shm"] {
        let p = pair(32 << 20, &[("hixl.backends", transport)]);
        let d = [TransferOpDesc {
            local_addr: p.abuf.as_ptr() as u64,
            remote_addr: p.bbuf.as_ptr() as u64,
            len: 32 << 20,
        }];
        let reqs: Vec<_> =
            (0..16).map(|_| p.a.transfer_async(&p.peer, TransferOp::Read, &d, None, None).unwrap()).collect();
        // Dropping a request handle while it is pending is fine too.
        drop(p.a.transfer_async(&p.peer, TransferOp::Write, &d, None, None).unwrap());
        p.a.finalize().unwrap();
        for r in &reqs {
            let s = r.wait(Some(T));
            assert!(s == TransferStatus::Completed || s == TransferStatus::Failed, "{transport}: {s:?}");
        }
        p.a.finalize().unwrap(); // twice
        let e = p.a.transfer_sync(&p.peer, TransferOp::Read, &d, T).unwrap_err();
        assert_eq!(e.status, Status::Failed, "{e}");
        assert!(unsafe { p.a.register_mem(MemDesc { addr: 4096, len: 1 }, MemType::Host) }.is_err());
        assert!(p.a.connect(&p.peer, T).is_err());
        p.b.finalize().unwrap();
        drop(p);
    }
}

#[test]
fn a_range_the_peer_registered_a_moment_ago_is_found() {
    // The initiator learns of the range "out of band" (here: directly) before the peer's
    // table update can have arrived; the engine asks the peer for its table on the miss.
    for transport in ["tcp", "shm"] {
        let mut p = pair(4096, &[("hixl.backends", transport)]);
        fill(&mut p.abuf[..64], 11);
        let la = p.abuf.as_ptr() as u64;
        for _ in 0..50 {
            let mut fresh = vec![0u8; 4096];
            let h = unsafe {
                p.b.register_mem(MemDesc { addr: fresh.as_mut_ptr() as u64, len: 4096 }, MemType::Host)
            }
            .unwrap();
            p.a.put(&p.peer, la, h.addr, 64, T).unwrap();
            assert_eq!(&fresh[..64], &p.abuf[..64], "{transport}");
            p.b.deregister_mem(&h).unwrap();
        }
        // A range that is registered nowhere still fails.
        let e = p.a.put(&p.peer, la, 0x10, 64, T).unwrap_err();
        assert_eq!(e.status, Status::ParamInvalid, "{e}");
    }
}
