//! Failover from `rdma` to the next backend (`tcp`) across real processes: this test binary
//! starts itself again as the peer (`child_target`, ignored as a test of its own) and talks to
//! it over stdin/stdout. The RDMA path is cut mid-transfer while the control channel (TCP on
//! 127.0.0.1) lives, so that the initiator's QPs run out of retries:
//! - on the software provider, the peer's soft NIC is told to go silent after some requests
//!   (`FAULT_ENV`: as a NIC whose link went down; its process and sockets live on);
//! - in the rxe VM (`HIXL_VM=1`, `HIXL_RDMA_DEVICE=rxe0`: scripts/rxe_check.sh), the test
//!   takes rxe0's netdev down (`ip link set v0 down`) after submitting, and up again after;
//!   on any other device these tests are skipped (they would cut a real NIC).
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
use std::time::Instant;

mod rdma_support;

use hixl_core::unstable::rdma::{FAULT_ENV, LATENCY_ENV};
use hixl_core::{Engine, MemDesc, MemType, NotifyDesc, Status, TransferOp, TransferOpDesc, TransferStatus};
use rdma_support::{commands, fill, hash, on_hardware, say, Peer, CHILD, T};

/// The netdev under rxe0 in the VM of scripts/rxe_vm.sh.
const VM_NETDEV: &str = "v0";

/// Whether the tests can cut the RDMA path here: the soft provider, or rxe in the VM.
fn can_cut() -> bool {
    if on_hardware() && std::env::var("HIXL_VM").as_deref() != Ok("1") {
        eprintln!(
            "skipped on this device: cutting its link is done only on the soft provider and in the rxe VM"
        );
        return false;
    }
    true
}

/// Takes rxe0's netdev down (in the VM; the soft NIC cuts itself, see `target`); up again
/// when dropped.
struct Cut(bool);

fn cut() -> Cut {
    if !on_hardware() {
        return Cut(false);
    }
    let ok = std::process::Command::new("ip").args(["link", "set", VM_NETDEV, "down"]).status().unwrap();
    assert!(ok.success(), "ip link set {VM_NETDEV} down: {ok}");
    Cut(true)
}

impl Drop for Cut {
    fn drop(&mut self) {
        if self.0 {
            let _ = std::process::Command::new("ip").args(["link", "set", VM_NETDEV, "up"]).status();
        }
    }
}

/// One test at a time: each starts a peer process and moves megabytes.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Size and pattern seed of the target's one region.
const X: (usize, u64) = (4 << 20, 11);

fn engine(listen: &str, backends: &str) -> Engine {
    let mut o: HashMap<String, String> = HashMap::new();
    match std::env::var("HIXL_RDMA_DEVICE") {
        Ok(d) if !d.is_empty() => {
            o.insert("hixl.rdma.provider".into(), "verbs".into());
            o.insert("hixl.rdma.device".into(), d);
            let gid = std::env::var("HIXL_RDMA_GID_INDEX").unwrap_or_else(|_| "0".into());
            o.insert("hixl.rdma.gid_index".into(), gid);
        }
        _ => {
            o.insert("hixl.rdma.provider".into(), "soft".into());
        }
    }
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

/// A peer whose soft NIC answers `answers` requests (2 ms each), then goes silent (on a real
/// device: an ordinary peer, cut by `cut`).
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

/// How many requests `writes` makes: on the soft NIC (2 ms a request) a few dozen stay in
/// flight long enough; rxe moves them faster than `ip` starts, so more there.
fn requests(soft: usize) -> usize {
    if on_hardware() {
        soft * 8
    } else {
        soft
    }
}

/// `n` WRITE requests of `piece` bytes each, from `src` into the peer's x at the same offsets,
/// in `slots` places (request i goes to place i % slots: the same bytes each time); the path
/// is cut (`cut`) after the first half is submitted, and stays cut while the guard lives. A
/// request may be refused at once when the link is found dead.
fn writes(
    e: &Engine,
    t: &Target,
    src: &[u8],
    n: usize,
    slots: usize,
    piece: usize,
) -> (Vec<hixl_core::Result<hixl_core::TransferReq>>, Cut) {
    let x = e.remote_region(&t.id, "x").unwrap();
    let mut cutting = None;
    let reqs = (0..n)
        .map(|i| {
            if i == n / 2 {
                cutting = Some(cut());
            }
            let at = (i % slots * piece) as u64;
            let d = TransferOpDesc {
                local_addr: src.as_ptr() as u64 + at,
                remote_addr: x.addr + at,
                len: piece as u64,
            };
            e.transfer_async(&t.id, TransferOp::Write, &[d], None, Some(T))
        })
        .collect();
    (reqs, cutting.expect("n >= 2"))
}

/// Whether `msg` names the RDMA path's death: the soft NIC went silent (retries ran out), or
/// rxe's netdev is down (its sends fail locally while the port is down).
fn names_the_dead_path(msg: &str) -> bool {
    msg.contains("did not answer") || msg.contains("port is down")
}

#[test]
fn an_rdma_path_that_dies_mid_transfer_fails_over_to_tcp_and_every_request_completes() {
    let _serial = serial();
    if !can_cut() {
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
    let (reqs, cut) = writes(&e, &t, &src, requests(48), 48, piece);
    let reqs: Vec<_> = reqs.into_iter().map(|r| r.expect("failover: no request is refused")).collect();
    want[..48 * piece].copy_from_slice(&src[..48 * piece]);
    // One more, with a notification after its data: the peer checks its memory when it sees it.
    // Its batch is the whole region (the same bytes the others write where they overlap): a
    // notification follows the data of its own batch only, and the earlier requests' rescued
    // parts may land on another stream after it.
    writeln!(t.peer.stdin, "NOTIFY kv-ready").unwrap();
    t.peer.stdin.flush().unwrap();
    let x = e.remote_region(&t.id, "x").unwrap();
    let tail = TransferOpDesc { local_addr: src.as_ptr() as u64, remote_addr: x.addr, len: X.0 as u64 };
    let notified = e
        .transfer_async(&t.id, TransferOp::Write, &[tail], Some(NotifyDesc::new("kv-ready", "l0")), Some(T))
        .unwrap();
    want[48 * piece..].copy_from_slice(&src[48 * piece..]);
    for (i, r) in reqs.iter().chain([&notified]).enumerate() {
        assert_eq!(r.wait(None), TransferStatus::Completed, "request {i}: {:?}", r.error());
    }
    eprintln!("{} requests across the failover: {:?}", reqs.len() + 1, started.elapsed());
    drop(cut);
    assert_eq!(t.peer.line(), format!("NOTIFIED 1 {}", hash(&want)), "the notification came before its data");
    assert_eq!(t.peer.ask("HASH"), format!("HASH {}", hash(&want)));

    let snap = e.stats().unwrap().into_iter().next().unwrap();
    assert_eq!((snap.backend, snap.failovers, snap.alive), ("tcp", 1, true), "{snap:?}");
    assert!(snap.failover.starts_with("rdma -> tcp: "), "{}", snap.failover);
    assert!(names_the_dead_path(&snap.failover), "{}", snap.failover);
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

/// Runs WRITEs into a peer whose NIC goes silent after 8 (or is cut); returns the failed ones'
/// errors.
fn cut_without_failover(initiator: &str, target_backends: &str) -> Vec<hixl_core::Error> {
    let mut t = target(8, target_backends);
    let e = engine("127.0.0.1", initiator);
    e.connect(&t.id, T).unwrap();
    assert_eq!(e.stats().unwrap()[0].backend, "rdma");
    let mut src = vec![0u8; X.0];
    fill(&mut src, 7);
    register(&e, &mut src);
    let started = Instant::now();
    let (reqs, cut) = writes(&e, &t, &src, requests(32), 32, 64 << 10);
    let mut errors = Vec::new();
    for r in &reqs {
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                errors.push(e.clone());
                continue;
            }
        };
        match r.wait(None) {
            TransferStatus::Completed => {}
            TransferStatus::Failed => errors.push(r.error().unwrap()),
            s => panic!("a request ended {s:?}: {:?}", r.error()),
        }
    }
    // Every request ended FAILED or COMPLETED (none TIMEOUT), so within its timeout T.
    assert!(started.elapsed() < T, "the requests ended after {:?}", started.elapsed());
    drop(cut);
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
    if !can_cut() {
        return;
    }
    for err in cut_without_failover("rdma", "rdma,tcp") {
        assert_eq!(err.status, Status::NotConnected, "{err}");
        assert!(names_the_dead_path(&err.message), "{err}");
    }
}

#[test]
fn when_the_next_backend_cannot_open_the_error_names_both_causes() {
    let _serial = serial();
    if !can_cut() {
        return;
    }
    // The peer offers rdma only: tcp cannot take over.
    for err in cut_without_failover("rdma,tcp", "rdma") {
        assert_eq!(err.status, Status::NotConnected, "{err}");
        assert!(names_the_dead_path(&err.message), "the dead path's cause: {err}");
        assert!(err.message.contains("tcp: the peer does not offer it"), "the next backend's: {err}");
    }
}
