//! The dma-buf registration path (`ibv_reg_dmabuf_mr`) across real processes, on the SOFT
//! provider's stand-in: a memfd takes the place of a GPU's dma-buf (the soft NIC maps it), so
//! this shows the verbs calls, keys, iova addressing, bounds and the closing of the descriptor
//! after registration, with bytes compared. It is NOT GPU testing: no GPU memory is involved,
//! and a real NIC with a real GPU dma-buf has never run this (docs/RDMA.md, "GPU memory
//! (GPUDirect)"). This test binary starts itself again as the peer (`child_dmabuf`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

mod rdma_support;

use hixl_core::unstable::rdma::{open_provider, verbs, QpAddr};
use rdma_support::{commands, fill, hash, on_hardware, say, Peer, CHILD, T};
use verbs::{access, wc, QpCaps, QpTransition, SendWr, Sge, Verbs, WrOp};

/// The memfd's size, and the registered range in it (at `OFFSET`, `LEN` bytes).
const FILE: usize = 64 << 10;
const OFFSET: u64 = 4096;
const LEN: u64 = 32 << 10;
/// The iovas the two sides register their files at: addresses mapped in neither process, so
/// the NIC must address the region by iova, never by a pointer of ours.
const TARGET_IOVA: u64 = 0x0000_5a00_0000_0000;
const SOURCE_IOVA: u64 = 0x0000_5b00_0000_0000;
const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;

/// A memfd of `FILE` bytes filled from `seed`.
fn memfd(seed: u64) -> OwnedFd {
    // SAFETY: a NUL-terminated name and no flags beyond close-on-exec.
    let fd = unsafe { libc::memfd_create(c"hixl-dmabuf-standin".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut b = vec![0u8; FILE];
    fill(&mut b, seed);
    // SAFETY: writes `b` (live for the call) to our descriptor.
    assert_eq!(unsafe { libc::pwrite(fd.as_raw_fd(), b.as_ptr().cast(), FILE, 0) }, FILE as isize);
    fd
}

/// `len` bytes of `fd` at `at`, read through the file (not through any mapping of ours).
fn read_file(fd: &OwnedFd, at: u64, len: u64) -> Vec<u8> {
    let mut b = vec![0u8; len as usize];
    // SAFETY: reads into `b`, live for the call.
    let n = unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), b.len(), at as i64) };
    assert_eq!(n, len as isize);
    b
}

/// Registers `LEN` bytes at `OFFSET` of a duplicate of `fd` at `iova`, then closes the
/// duplicate: the region must not need it any more (as a real NIC holds the dma-buf itself).
fn register(v: &dyn Verbs, pd: verbs::Pd, fd: &OwnedFd, iova: u64) -> (u32, u32) {
    let dup = fd.try_clone().unwrap();
    // SAFETY: a file of FILE >= OFFSET + LEN bytes that only this test writes.
    let (_, lkey, rkey) = unsafe { v.reg_dmabuf_mr(pd, OFFSET, LEN, iova, dup.as_raw_fd(), ALL) }.unwrap();
    drop(dup);
    (lkey, rkey)
}

struct Side {
    v: std::sync::Arc<dyn Verbs>,
    pd: verbs::Pd,
    cq: verbs::Cq,
    gid: [u8; 16],
}

fn side() -> Side {
    let v = open_provider("soft").unwrap();
    let ctx = v.open_device("soft0").unwrap();
    let gid = v.query_gid(ctx, 1, 0).unwrap();
    let pd = v.alloc_pd(ctx).unwrap();
    let cq = v.create_cq(ctx, 64, None).unwrap();
    Side { v, pd, cq, gid }
}

impl Side {
    fn qp(&self, remote_access: u32) -> (verbs::Qp, QpAddr) {
        let caps =
            QpCaps { max_send_wr: 8, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let q = self.v.create_qp(self.pd, self.cq, caps).unwrap();
        self.v.modify_qp(q.qp, &QpTransition::Init { port: 1, access: remote_access }).unwrap();
        (
            q.qp,
            QpAddr {
                gid: self.gid,
                lid: 0,
                qpn: q.qpn,
                psn: 0x100 + q.qpn % 4096,
                mtu: 5,
                rail: 0,
                reads_out: 16,
                reads_in: 16,
            },
        )
    }

    fn connect(&self, qp: verbs::Qp, ours: &QpAddr, theirs: &QpAddr) {
        let rtr = QpTransition::Rtr {
            remote: *theirs,
            mtu: 5,
            port: 1,
            gid_index: 0,
            traffic_class: 0,
            sl: 0,
            rd_atomic: 4,
        };
        self.v.modify_qp(qp, &rtr).unwrap();
        let rts = QpTransition::Rts { psn: ours.psn, timeout: 16, retry_cnt: 7, rd_atomic: 4 };
        self.v.modify_qp(qp, &rts).unwrap();
    }

    fn wait(&self) -> verbs::Wc {
        let until = std::time::Instant::now() + T;
        let mut buf = [verbs::Wc::default(); 1];
        while std::time::Instant::now() < until {
            if self.v.poll_cq(self.cq, &mut buf).unwrap() == 1 {
                return buf[0];
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("no completion in {T:?}");
    }
}

fn qp_line(a: &QpAddr) -> String {
    format!("{} {} {}", a.gid.iter().map(|b| format!("{b:02x}")).collect::<String>(), a.qpn, a.psn)
}

fn parse_qp(w: &[&str]) -> QpAddr {
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&w[0][2 * i..2 * i + 2], 16).unwrap();
    }
    QpAddr {
        gid,
        lid: 0,
        qpn: w[1].parse().unwrap(),
        psn: w[2].parse().unwrap(),
        mtu: 5,
        rail: 0,
        reads_out: 16,
        reads_in: 16,
    }
}

#[test]
#[ignore = "the peer process of the cross-process test, started by it"]
fn child_dmabuf() {
    if std::env::var(CHILD).as_deref() != Ok("dmabuf") {
        return;
    }
    let s = side();
    let file = memfd(31);
    let (_, rkey) = register(&*s.v, s.pd, &file, TARGET_IOVA);
    let (q, a) = s.qp(access::REMOTE_READ | access::REMOTE_WRITE);
    say(&format!("READY {rkey} {}", qp_line(&a)));
    for cmd in commands() {
        let w: Vec<&str> = cmd.split_whitespace().collect();
        match w.as_slice() {
            ["PEER", rest @ ..] => {
                s.connect(q, &a, &parse_qp(rest));
                say("OK");
            }
            ["HASH"] => say(&format!("HASH {}", hash(&read_file(&file, 0, FILE as u64)))),
            ["EXIT"] => {
                say("BYE");
                return;
            }
            _ => say(&format!("ERR {cmd:?}")),
        }
    }
}

fn wr(id: u64, op: WrOp, local: u64, len: u32, lkey: u32, remote: u64, rkey: u32) -> SendWr {
    SendWr {
        wr_id: id,
        op,
        sges: vec![Sge { addr: local, length: len, lkey }],
        signaled: true,
        remote_addr: remote,
        rkey,
        inline: false,
    }
}

/// Soft provider's stand-in only (a memfd for the dma-buf): WRITE from a dma-buf region into
/// the peer's dma-buf region, READ it back, and a WRITE past the region's end refused.
#[test]
fn a_dmabuf_region_is_written_and_read_by_iova_across_processes_soft_standin() {
    if on_hardware() {
        eprintln!("skipped: the memfd stand-in is the soft provider's; a real NIC needs a GPU's dma-buf");
        return;
    }
    let mut peer = Peer::start("dmabuf", &[]);
    let l = peer.line();
    let w: Vec<&str> = l.split_whitespace().collect();
    assert_eq!(w[0], "READY", "{l}");
    let rkey: u32 = w[1].parse().unwrap();
    let theirs = parse_qp(&w[2..]);
    let s = side();
    let src = memfd(77);
    let (lkey, _) = register(&*s.v, s.pd, &src, SOURCE_IOVA);
    let (q, a) = s.qp(0);
    assert_eq!(peer.ask(&format!("PEER {}", qp_line(&a))), "OK");
    s.connect(q, &a, &theirs);
    let post = |w: SendWr| {
        // SAFETY: the SGE lies in our registered stand-in region, alive for the whole test.
        unsafe { s.v.post_send(q, &[w]) }.unwrap()
    };

    // 4096 bytes from 512 into our region land 100 bytes into theirs.
    post(wr(1, WrOp::Write, SOURCE_IOVA + 512, 4096, lkey, TARGET_IOVA + 100, rkey));
    let c = s.wait();
    assert_eq!((c.wr_id, c.status), (1, wc::SUCCESS));
    let mut want = vec![0u8; FILE];
    fill(&mut want, 31);
    let sent = read_file(&src, OFFSET + 512, 4096);
    let at = (OFFSET + 100) as usize;
    want[at..at + 4096].copy_from_slice(&sent);
    assert_eq!(
        peer.ask("HASH"),
        format!("HASH {}", hash(&want)),
        "the bytes landed at OFFSET + 100 of the file"
    );

    // READ their first 8 KiB into our region at 16 KiB: the file shows what theirs holds.
    post(wr(2, WrOp::Read, SOURCE_IOVA + 16384, 8192, lkey, TARGET_IOVA, rkey));
    let c = s.wait();
    assert_eq!((c.wr_id, c.status), (2, wc::SUCCESS));
    assert_eq!(read_file(&src, OFFSET + 16384, 8192), want[OFFSET as usize..OFFSET as usize + 8192]);

    // Past the region's end (LEN bytes from the iova): the responder refuses it.
    post(wr(3, WrOp::Write, SOURCE_IOVA, 64, lkey, TARGET_IOVA + LEN - 32, rkey));
    assert_eq!(s.wait().status, wc::REM_ACCESS_ERR);
    assert_eq!(peer.ask("HASH"), format!("HASH {}", hash(&want)), "nothing else landed");
    assert_eq!(peer.ask("EXIT"), "BYE");
}
