//! The raw baseline of hixl's synchronous RDMA WRITE latency: one RC queue pair on a device,
//! one signaled RDMA WRITE posted at a time and the completion queue polled until it completes,
//! with no hixl engine (no request path, no Python, no completion thread): what the verbs
//! provider itself costs per WRITE on that device. `benches/rdma.py` runs it beside hixl's
//! 4 KiB `transfer_sync` WRITE on the same device, in the same run.
//!
//!     cargo run --release --example rdma_raw_lat -- --device rxe0 --gid-index 1 --size 4096
//!
//! Options: `--provider verbs|soft` (default verbs), `--device NAME` (default rxe0; soft: soft0),
//! `--gid-index N` (default 1; soft: 0), `--size BYTES` (default 4096), `--iters N` (default
//! 2000). It starts itself again as the target (`--target`), another process on the same
//! device: the two exchange their QP addresses over the target's stdin and stdout. The last
//! line is `raw_write_lat size=S iters=N median_us=M p99_us=P`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hixl_core::unstable::rdma::{open_provider, verbs, QpAddr};
use verbs::{access, wc, QpCaps, QpTransition, SendWr, Sge, Wc, WrOp};

struct Args {
    provider: String,
    device: String,
    gid_index: u8,
    size: usize,
    iters: usize,
    target: bool,
}

fn args() -> Args {
    let mut a = Args {
        provider: "verbs".into(),
        device: String::new(),
        gid_index: u8::MAX,
        size: 4096,
        iters: 2000,
        target: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--provider" => a.provider = v(),
            "--device" => a.device = v(),
            "--gid-index" => a.gid_index = v().parse().expect("--gid-index: a number"),
            "--size" => a.size = v().parse().expect("--size: a number of bytes"),
            "--iters" => a.iters = v().parse().expect("--iters: a number"),
            "--target" => a.target = true,
            other => panic!("unknown argument {other:?} (see the example's doc)"),
        }
    }
    let soft = a.provider == "soft";
    if a.device.is_empty() {
        a.device = if soft { "soft0" } else { "rxe0" }.into();
    }
    if a.gid_index == u8::MAX {
        a.gid_index = if soft { 0 } else { 1 };
    }
    a
}

/// One QP on the device, its memory registered, moved to INIT.
struct Side {
    v: Arc<dyn verbs::Verbs>,
    cq: verbs::Cq,
    qp: verbs::Qp,
    addr: QpAddr,
    buf: Vec<u8>,
    lkey: u32,
    rkey: u32,
    gid_index: u8,
}

fn side(a: &Args, remote_access: u32) -> Side {
    let v = open_provider(&a.provider).expect("the provider");
    v.get_device_list().expect("the device list");
    let ctx = v.open_device(&a.device).expect("the device");
    let port = v.query_port(ctx, 1).expect("port 1");
    let gid = v.query_gid(ctx, 1, a.gid_index).expect("the GID");
    let pd = v.alloc_pd(ctx).expect("a PD");
    let cq = v.create_cq(ctx, 64, None).expect("a CQ");
    let buf = vec![7u8; a.size.max(1)];
    let acc = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    // SAFETY: `buf` lives as long as the process (the region is never deregistered before exit).
    let (_, lkey, rkey) =
        unsafe { v.reg_mr(pd, buf.as_ptr() as u64, buf.len() as u64, acc) }.expect("a registration");
    let caps =
        QpCaps { max_send_wr: 16, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let q = v.create_qp(pd, cq, caps).expect("a QP");
    v.modify_qp(q.qp, &QpTransition::Init { port: 1, access: remote_access }).expect("INIT");
    let psn = 0x1000 + q.qpn % 4096;
    let addr = QpAddr {
        gid,
        lid: port.lid,
        qpn: q.qpn,
        psn,
        mtu: port.active_mtu,
        rail: 0,
        reads_out: 1,
        reads_in: 1,
    };
    Side { v, cq, qp: q.qp, addr, buf, lkey, rkey, gid_index: a.gid_index }
}

fn line(a: &QpAddr, buf: u64, rkey: u32) -> String {
    let gid: String = a.gid.iter().map(|b| format!("{b:02x}")).collect();
    format!("QP {gid} {} {} {} {} {buf} {rkey}", a.lid, a.qpn, a.psn, a.mtu)
}

fn parse(l: &str) -> (QpAddr, u64, u32) {
    let w: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(w.first(), Some(&"QP"), "not a QP line: {l:?}");
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&w[1][2 * i..2 * i + 2], 16).expect("a GID in hex");
    }
    let n = |i: usize| w[i].parse::<u64>().expect("a number");
    let addr = QpAddr {
        gid,
        lid: n(2) as u16,
        qpn: n(3) as u32,
        psn: n(4) as u32,
        mtu: n(5) as u8,
        rail: 0,
        reads_out: 1,
        reads_in: 1,
    };
    (addr, n(6), n(7) as u32)
}

fn rtr(s: &Side, remote: &QpAddr) {
    let t = QpTransition::Rtr {
        remote: *remote,
        mtu: s.addr.mtu.min(remote.mtu),
        port: 1,
        gid_index: s.gid_index,
        traffic_class: 0,
        sl: 0,
        rd_atomic: 1,
    };
    s.v.modify_qp(s.qp, &t).expect("RTR");
}

fn target(a: &Args) {
    let s = side(a, access::REMOTE_WRITE | access::REMOTE_READ);
    println!("{}", line(&s.addr, s.buf.as_ptr() as u64, s.rkey));
    let mut input = BufReader::new(std::io::stdin());
    let mut l = String::new();
    input.read_line(&mut l).expect("the initiator's QP");
    rtr(&s, &parse(&l).0);
    println!("READY");
    // Answers (in the NIC) until the initiator closes our stdin.
    let _ = std::io::copy(&mut input, &mut std::io::sink());
}

fn main() {
    let a = args();
    if a.target {
        return target(&a);
    }
    let me = std::env::current_exe().expect("this program's path");
    let mut child = Command::new(me)
        .args(std::env::args().skip(1))
        .arg("--target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the target process");
    let mut out = BufReader::new(child.stdout.take().expect("its stdout"));
    let mut l = String::new();
    out.read_line(&mut l).expect("the target's QP");
    let (remote, raddr, rkey) = parse(&l);
    let s = side(&a, 0);
    let mut to = child.stdin.take().expect("its stdin");
    writeln!(to, "{}", line(&s.addr, s.buf.as_ptr() as u64, s.rkey)).expect("our QP to the target");
    l.clear();
    out.read_line(&mut l).expect("READY");
    assert_eq!(l.trim(), "READY");
    rtr(&s, &remote);
    let rts = QpTransition::Rts { psn: s.addr.psn, timeout: 14, retry_cnt: 7, rd_atomic: 1 };
    s.v.modify_qp(s.qp, &rts).expect("RTS");
    let wr = SendWr {
        wr_id: 1,
        op: WrOp::Write,
        sges: vec![Sge { addr: s.buf.as_ptr() as u64, length: a.size as u32, lkey: s.lkey }],
        signaled: true,
        remote_addr: raddr,
        rkey,
        inline: false,
    };
    let mut wcs = [Wc::default(); 4];
    let mut one = || {
        let t0 = Instant::now();
        // SAFETY: the SGE lies in `s.buf`, registered under `s.lkey` and alive until exit; one
        // request at a time, completed below before the next is posted.
        unsafe { s.v.post_send(s.qp, std::slice::from_ref(&wr)) }.expect("ibv_post_send");
        let until = t0 + Duration::from_secs(10);
        loop {
            let n = s.v.poll_cq(s.cq, &mut wcs).expect("ibv_poll_cq");
            if n > 0 {
                assert_eq!(wcs[0].status, wc::SUCCESS, "the WRITE failed: {}", wc::name(wcs[0].status));
                return t0.elapsed();
            }
            assert!(Instant::now() < until, "no completion in 10 s");
        }
    };
    for _ in 0..a.iters.min(100) {
        one();
    }
    let mut lat: Vec<Duration> = (0..a.iters.max(1)).map(|_| one()).collect();
    lat.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let (median, p99) = (lat[lat.len() / 2], lat[lat.len() * 99 / 100]);
    drop(to);
    let _ = child.wait();
    println!(
        "raw_write_lat size={} iters={} median_us={:.2} p99_us={:.2}",
        a.size,
        lat.len(),
        us(median),
        us(p99)
    );
}
