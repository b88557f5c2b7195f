//! Failover from `rdma` to the next backend (`tcp`) across real processes, on the software
//! provider: this test binary starts itself again as the peer (`child_target`, ignored as a
//! test of its own) and talks to it over stdin/stdout. The peer's soft NIC is told to go
//! silent after some requests (`FAULT_ENV`: as a NIC whose link went down; its process and
//! TCP sockets live on), so that the initiator's QPs run out of retries mid-transfer while the
//! control channel is fine.
//!
//! What they show: with `hixl.backends=rdma,tcp`, every request of a transfer cut by the fault
//! completes (the parts that had not landed are re-issued over tcp), the peer's memory holds
//! exactly the bytes written, a notification sent after the data finds all of it in place,
//! later requests go over tcp, and `stats()` says `tcp` and one failover with its reason. With
//! `hixl.backends=rdma` alone, or when the peer offers no next backend, the requests fail with
//! NOT_CONNECTED within their timeout, the error naming the dead path (and why no other took
//! over).

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

mod rdma_support;

use hixl_core::unstable::rdma::{FAULT_ENV, LATENCY_ENV};
use hixl_core::{Engine, MemDesc, MemType, NotifyDesc, Status, TransferOp, TransferOpDesc, TransferStatus};
use rdma_support::{commands, fill, hash, on_hardware, say, Peer, CHILD, T};

/// One test at a time: each starts a peer process and moves megabytes.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Size and pattern seed of the target's one region.
const X: (usize, u64) = (4 << 20, 11);

fn engine(listen: &str, backends: &str) -> Engine {
    let mut o: HashMap<String, String> = HashMap::new();
    o.insert("hixl.rdma.provider".into(), "soft".into());
    o.insert("hixl.backends".into(), backends.into());
    o.insert("hixl.rdma.qps".into(), "2".into());
    let e = Engine::new();
    e.initialize(listen, &o).unwrap();
    e
}

#[test]
#[ignore = "the peer process of the cross-process tests, started by them"]
fn child_target() {
    if std::env::var(CHILD).as_deref() != Ok("target") {
        return;
    }
    let backends = std::env::var("HIXL_FAILOVER_TARGET_BACKENDS").unwrap_or_else(|_| "rdma,tcp".into());
    let e = engine("127.0.0.1:0", &backends);
    let mut x = vec![0u8; X.0];
    fill(&mut x, X.1);
    let desc = MemDesc { addr: x.as_mut_ptr() as u64, len: x.len() as u64 };
    // SAFETY: the buffer lives until the process exits (it is never dropped before).
    unsafe { e.register_named(desc, MemType::Host, hixl_core::Access::ReadWrite, "x") }.unwrap();
    say(&format!("READY {}", e.local_engine().unwrap()));
    for cmd in commands() {
        let w: Vec<&str> = cmd.split_whitespace().collect();
        match w.as_slice() {
            ["HASH"] => say(&format!("HASH {}", hash(&x))),
            ["NOTIFY", name] => {
                let got = e.wait_notifies(T, Some(name)).unwrap();
                // What the memory holds when the notification is seen.
                say(&format!("NOTIFIED {} {}", got.len(), hash(&x)));
            }
            ["EXIT"] => {
                e.finalize().unwrap();
                say("BYE");
                return;
            }
            _ => say(&format!("ERR unknown command {cmd:?}")),
        }
    }
}

struct Target {
    peer: Peer,
    id: String,
}

/// A peer whose soft NIC answers `answers` requests (2 ms each), then goes silent.
fn target(answers: u32, backends: &str) -> Target {
    let mute = format!("mute_after={answers}");
    let env =
        [(FAULT_ENV, mute.as_str()), (LATENCY_ENV, "2000"), ("HIXL_FAILOVER_TARGET_BACKENDS", backends)];
    let peer = Peer::start("target", &env);
    let l = peer.line();
    let id = l.strip_prefix("READY ").unwrap_or_else(|| panic!("unexpected {l:?}")).to_string();
    Target { peer, id }
}

fn register(e: &Engine, b: &mut [u8]) {
    // SAFETY: the test keeps every registered buffer alive until its engine is finalized.
    unsafe { e.register_mem(MemDesc { addr: b.as_mut_ptr() as u64, len: b.len() as u64 }, MemType::Host) }
        .unwrap();
}

/// `n` WRITE requests of `piece` bytes each, from `src` into the peer's x at the same offsets.
fn writes(e: &Engine, t: &Target, src: &[u8], n: usize, piece: usize) -> Vec<hixl_core::TransferReq> {
    let x = e.remote_region(&t.id, "x").unwrap();
    (0..n)
        .map(|i| {
            let d = TransferOpDesc {
                local_addr: src.as_ptr() as u64 + (i * piece) as u64,
                remote_addr: x.addr + (i * piece) as u64,
                len: piece as u64,
            };
            e.transfer_async(&t.id, TransferOp::Write, &[d], None, Some(T)).unwrap()
        })
        .collect()
}

#[test]
fn an_rdma_path_that_dies_mid_transfer_fails_over_to_tcp_and_every_request_completes() {
    let _serial = serial();
    if on_hardware() {
        eprintln!("skipped on hardware: needs the software provider's fault ({FAULT_ENV})");
        return;
    }
    // 2 QPs, 2 ms per request: 48 requests of 64 KiB take about 50 ms; the NIC goes silent
    // after 16 of them, with the others posted or queued.
    let mut t = target(16, "rdma,tcp");
    let e = engine("127.0.0.1", "rdma,tcp");
    e.connect(&t.id, T).unwrap();
    let snap = e.stats().unwrap().into_iter().next().unwrap();
    assert_eq!((snap.backend, snap.failovers), ("rdma", 0), "not chosen because: {}", snap.not_chosen);
    let piece = 64 << 10;
    let mut src = vec![0u8; X.0];
    fill(&mut src, 99);
    register(&e, &mut src);
    let mut want = vec![0u8; X.0];
    fill(&mut want, X.1);
    let started = Instant::now();
    let reqs = writes(&e, &t, &src, 48, piece);
    want[..48 * piece].copy_from_slice(&src[..48 * piece]);
    // One more, with a notification after its data: the peer checks its memory when it sees it.
    writeln!(t.peer.stdin, "NOTIFY kv-ready").unwrap();
    t.peer.stdin.flush().unwrap();
    let x = e.remote_region(&t.id, "x").unwrap();
    let tail = TransferOpDesc {
        local_addr: src.as_ptr() as u64 + (48 * piece) as u64,
        remote_addr: x.addr + (48 * piece) as u64,
        len: (X.0 - 48 * piece) as u64,
    };
    let notified = e
        .transfer_async(&t.id, TransferOp::Write, &[tail], Some(NotifyDesc::new("kv-ready", "l0")), Some(T))
        .unwrap();
    want[48 * piece..].copy_from_slice(&src[48 * piece..]);
    for (i, r) in reqs.iter().chain([&notified]).enumerate() {
        assert_eq!(r.wait(None), TransferStatus::Completed, "request {i}: {:?}", r.error());
    }
    eprintln!("49 requests across the failover: {:?}", started.elapsed());
    assert_eq!(t.peer.line(), format!("NOTIFIED 1 {}", hash(&want)), "the notification came before its data");
    assert_eq!(t.peer.ask("HASH"), format!("HASH {}", hash(&want)));

    let snap = e.stats().unwrap().into_iter().next().unwrap();
    assert_eq!((snap.backend, snap.failovers, snap.alive), ("tcp", 1, true), "{snap:?}");
    assert!(snap.failover.starts_with("rdma -> tcp: "), "{}", snap.failover);
    assert!(snap.failover.contains("did not answer"), "{}", snap.failover);
    assert_eq!(snap.errors, 0, "{snap:?}");
    let m = hixl_core::metrics::render(&[hixl_core::metrics::EngineMetrics::of(&e).unwrap()], 8);
    assert!(
        m.contains(&format!(
            "hixl_failovers_total{{engine=\"{}\",peer=\"{}\",backend=\"tcp\"}} 1",
            e.local_engine().unwrap(),
            t.id
        )),
        "{m}"
    );

    // Later requests go over tcp: a WRITE and a READ of the whole region.
    fill(&mut src, 100);
    e.put(&t.id, src.as_ptr() as u64, x.addr, X.0 as u64, T).unwrap();
    assert_eq!(t.peer.ask("HASH"), format!("HASH {}", hash(&src)));
    let mut back = vec![0u8; X.0];
    register(&e, &mut back);
    e.get(&t.id, back.as_ptr() as u64, x.addr, X.0 as u64, T).unwrap();
    assert!(back == src, "READ after the failover returned other bytes");
    let snap = e.stats().unwrap().into_iter().next().unwrap();
    assert_eq!((snap.backend, snap.failovers), ("tcp", 1), "{snap:?}");
    e.finalize().unwrap();
    assert_eq!(t.peer.ask("EXIT"), "BYE");
}

/// Runs 32 WRITEs into a peer whose NIC goes silent after 8; returns the failed ones' errors.
fn cut_without_failover(initiator: &str, target_backends: &str) -> Vec<hixl_core::Error> {
    let mut t = target(8, target_backends);
    let e = engine("127.0.0.1", initiator);
    e.connect(&t.id, T).unwrap();
    assert_eq!(e.stats().unwrap()[0].backend, "rdma");
    let mut src = vec![0u8; X.0];
    fill(&mut src, 7);
    register(&e, &mut src);
    let timeout = Duration::from_secs(8);
    let reqs = writes(&e, &t, &src, 32, 64 << 10);
    let started = Instant::now();
    let mut errors = Vec::new();
    for r in &reqs {
        match r.wait(None) {
            TransferStatus::Completed => {}
            TransferStatus::Failed => errors.push(r.error().unwrap()),
            s => panic!("a request ended {s:?}: {:?}", r.error()),
        }
    }
    assert!(started.elapsed() < timeout, "the requests ended after {:?}", started.elapsed());
    assert!(!errors.is_empty(), "no request failed although the NIC went silent");
    let snap = e.stats().unwrap();
    assert!(snap.is_empty() || (snap[0].failovers == 0 && !snap[0].alive), "{snap:?}");
    e.finalize().unwrap();
    assert_eq!(t.peer.ask("EXIT"), "BYE");
    errors
}

#[test]
fn with_rdma_alone_a_dead_path_fails_its_requests_within_their_timeout() {
    let _serial = serial();
    if on_hardware() {
        eprintln!("skipped on hardware: needs the software provider's fault ({FAULT_ENV})");
        return;
    }
    for err in cut_without_failover("rdma", "rdma,tcp") {
        assert_eq!(err.status, Status::NotConnected, "{err}");
        assert!(err.message.contains("did not answer"), "{err}");
    }
}

#[test]
fn when_the_next_backend_cannot_open_the_error_names_both_causes() {
    let _serial = serial();
    if on_hardware() {
        eprintln!("skipped on hardware: needs the software provider's fault ({FAULT_ENV})");
        return;
    }
    // The peer offers rdma only: tcp cannot take over.
    for err in cut_without_failover("rdma,tcp", "rdma") {
        assert_eq!(err.status, Status::NotConnected, "{err}");
        assert!(err.message.contains("did not answer"), "the dead path's cause: {err}");
        assert!(err.message.contains("tcp: the peer does not offer it"), "the next backend's: {err}");
    }
}
