//! The soft NIC's semantics, with two devices in one process (their responders are threads, as
//! they are in a peer process): the RC state machine, post errors, local checks, responder
//! checks, connection checks, CQ overrun and deregistration.

use std::time::{Duration, Instant};

use super::*;
use crate::transport::backends::rdma::verbs::{wc, Sge, WrOp};
use crate::wire::rdma::QpAddr;

const ALL: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;

struct Dev {
    v: SoftVerbs,
    pd: Pd,
    cq: Cq,
    gid: [u8; 16],
}

fn dev(cqe: u32) -> Dev {
    let v = SoftVerbs::new();
    let ctx = v.open_device(DEVICE).unwrap();
    let gid = v.query_gid(ctx, 1, 0).unwrap();
    let pd = v.alloc_pd(ctx).unwrap();
    let cq = v.create_cq(ctx, cqe, None).unwrap();
    Dev { v, pd, cq, gid }
}

impl Dev {
    fn qp(&self, depth: u32, remote: u32) -> (Qp, QpAddr) {
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: 1,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let q = self.v.create_qp(self.pd, self.cq, caps).unwrap();
        self.v.modify_qp(q.qp, &QpTransition::Init { port: 1, access: remote }).unwrap();
        (
            q.qp,
            QpAddr {
                gid: self.gid,
                lid: 0,
                qpn: q.qpn,
                psn: 100 + q.qpn,
                mtu: 5,
                rail: 0,
                reads_out: 16,
                reads_in: 16,
            },
        )
    }

    fn up(&self, q: Qp, ours: &QpAddr, theirs: &QpAddr) {
        self.up_rd(q, ours, theirs, 16, 16)
    }

    /// RTR with `max_dest_rd_atomic` = `dest`, then RTS with `max_rd_atomic` = `out`.
    fn up_rd(&self, q: Qp, ours: &QpAddr, theirs: &QpAddr, dest: u8, out: u8) {
        self.v
            .modify_qp(
                q,
                &QpTransition::Rtr {
                    rd_atomic: dest,
                    remote: *theirs,
                    mtu: 5,
                    port: 1,
                    gid_index: 0,
                    traffic_class: 0,
                    sl: 0,
                },
            )
            .unwrap();
        self.v
            .modify_qp(q, &QpTransition::Rts { psn: ours.psn, timeout: 16, retry_cnt: 7, rd_atomic: out })
            .unwrap();
    }

    fn mr(&self, buf: &mut [u8], acc: u32) -> (u32, u32) {
        // SAFETY: every test keeps its buffers alive until its devices are dropped.
        let (_, l, r) =
            unsafe { self.v.reg_mr(self.pd, buf.as_mut_ptr() as u64, buf.len() as u64, acc) }.unwrap();
        (l, r)
    }

    fn wait(&self, n: usize) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        let mut buf = [Wc::default(); 8];
        while out.len() < n && Instant::now() < until {
            let k = self.v.poll_cq(self.cq, &mut buf).unwrap();
            out.extend(buf[..k].iter().map(|w| (w.wr_id, w.status)));
            if k == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        out
    }
}

/// Posts `wrs`. Every test's SGEs name registered buffers that outlive its devices.
fn post(v: &SoftVerbs, q: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
    // SAFETY: see above; the tests never free a buffer while a request may use it.
    unsafe { v.post_send(q, wrs) }
}

fn wr(id: u64, op: WrOp, local: &[u8], lkey: u32, remote: u64, rkey: u32) -> SendWr {
    SendWr {
        wr_id: id,
        op,
        sges: vec![Sge { addr: local.as_ptr() as u64, length: local.len() as u32, lkey }],
        signaled: true,
        remote_addr: remote,
        rkey,
        inline: false,
    }
}

/// Two connected QPs: (initiator device, its QP, target device, its QP).
fn pair(remote_access: u32, depth: u32) -> (Dev, Qp, Dev, Qp) {
    let (a, b) = (dev(64), dev(64));
    let (qa, aa) = a.qp(depth, 0);
    let (qb, ab) = b.qp(depth, remote_access);
    b.up(qb, &ab, &aa);
    a.up(qa, &aa, &ab);
    (a, qa, b, qb)
}

#[test]
fn the_state_machine_refuses_skipped_steps_and_posts_before_rts() {
    let d = dev(8);
    let caps =
        QpCaps { max_send_wr: 4, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let q = d.v.create_qp(d.pd, d.cq, caps).unwrap();
    let remote = QpAddr { gid: d.gid, lid: 0, qpn: 5, psn: 1, mtu: 5, rail: 0, reads_out: 16, reads_in: 16 };
    let rtr =
        QpTransition::Rtr { remote, mtu: 5, port: 1, gid_index: 0, traffic_class: 0, sl: 0, rd_atomic: 16 };
    let e = d.v.modify_qp(q.qp, &rtr).unwrap_err();
    assert!(e.message.contains("Reset") && e.message.contains("EINVAL"), "{e}");
    let mut buf = [0u8; 8];
    let (lkey, rkey) = d.mr(&mut buf, ALL);
    let w = wr(1, WrOp::Write, &buf, lkey, buf.as_ptr() as u64, rkey);
    assert_eq!(post(&d.v, q.qp, std::slice::from_ref(&w)), Err(PostError { bad_wr: 0, errno: libc::EINVAL }));
    d.v.modify_qp(q.qp, &QpTransition::Init { port: 1, access: 0 }).unwrap();
    let e =
        d.v.modify_qp(q.qp, &QpTransition::Rts { psn: 1, timeout: 1, retry_cnt: 1, rd_atomic: 16 })
            .unwrap_err();
    assert!(e.message.contains("Init"), "{e}");
    d.v.modify_qp(q.qp, &rtr).unwrap();
    assert_eq!(
        post(&d.v, q.qp, std::slice::from_ref(&w)).unwrap_err().errno,
        libc::EINVAL,
        "RTR cannot send"
    );
    d.v.modify_qp(q.qp, &QpTransition::Rts { psn: 1, timeout: 1, retry_cnt: 1, rd_atomic: 16 }).unwrap();
    let two = SendWr { sges: vec![w.sges[0], w.sges[0]], ..w.clone() };
    assert_eq!(
        post(&d.v, q.qp, &[w.clone(), two]),
        Err(PostError { bad_wr: 1, errno: libc::EINVAL }),
        "too many SGEs"
    );
    d.v.modify_qp(q.qp, &QpTransition::Reset).unwrap();
    // SAFETY: a QP of this test, destroyed once and not used after.
    unsafe { d.v.destroy_qp(q.qp) };
}

#[test]
fn local_checks_fail_with_local_protection_errors_and_flush_the_rest() {
    let (a, qa, b, _qb) = pair(ALL, 16);
    let mut src = vec![7u8; 4096];
    let mut ro_local = vec![0u8; 4096];
    let mut dst = vec![0u8; 4096];
    let (lkey, _) = a.mr(&mut src, ALL);
    let (ro_lkey, _) = a.mr(&mut ro_local, access::REMOTE_READ);
    let (_, rkey) = b.mr(&mut dst, ALL);
    let remote = dst.as_ptr() as u64;
    let wrs = [
        wr(1, WrOp::Write, &src[..100], lkey, remote, rkey),
        // A READ into memory registered without local write.
        wr(2, WrOp::Read, &ro_local[..100], ro_lkey, remote, rkey),
        wr(3, WrOp::Write, &src[..100], lkey, remote, rkey),
    ];
    post(&a.v, qa, &wrs).unwrap();
    assert_eq!(a.wait(3), [(1, wc::SUCCESS), (2, wc::LOC_PROT_ERR), (3, wc::WR_FLUSH_ERR)]);
    assert_eq!(&dst[..100], &src[..100]);
}

#[test]
fn a_local_range_outside_its_region_or_an_unknown_lkey_is_refused() {
    let (a, qa, b, _qb) = pair(ALL, 16);
    let mut src = vec![1u8; 4096];
    let mut dst = vec![0u8; 4096];
    let (lkey, _) = a.mr(&mut src[..1024], ALL);
    let (_, rkey) = b.mr(&mut dst, ALL);
    post(&a.v, qa, &[wr(1, WrOp::Write, &src[..2048], lkey, dst.as_ptr() as u64, rkey)]).unwrap();
    assert_eq!(a.wait(1), [(1, wc::LOC_PROT_ERR)]);
    assert!(dst.iter().all(|b| *b == 0), "nothing was sent");
}

#[test]
fn a_responder_qp_without_remote_write_refuses_as_an_invalid_request() {
    let (a, qa, b, _qb) = pair(access::REMOTE_READ, 16);
    let mut src = vec![1u8; 256];
    let mut dst = vec![0u8; 256];
    let (lkey, _) = a.mr(&mut src, ALL);
    let (_, rkey) = b.mr(&mut dst, ALL);
    post(&a.v, qa, &[wr(1, WrOp::Write, &src, lkey, dst.as_ptr() as u64, rkey)]).unwrap();
    assert_eq!(a.wait(1), [(1, wc::REM_INV_REQ_ERR)]);
    assert!(dst.iter().all(|b| *b == 0));
}

#[test]
fn a_wrong_psn_gets_no_answer_until_the_retries_run_out() {
    let (a, b) = (dev(8), dev(8));
    let (qa, aa) = a.qp(4, 0);
    let (qb, ab) = b.qp(4, ALL);
    // The responder expects another PSN than the requester starts with.
    b.up(qb, &ab, &QpAddr { psn: aa.psn + 1, ..aa });
    a.up(qa, &aa, &ab);
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    let (lkey, _) = a.mr(&mut src, ALL);
    let (_, rkey) = b.mr(&mut dst, ALL);
    post(&a.v, qa, &[wr(1, WrOp::Write, &src, lkey, dst.as_ptr() as u64, rkey)]).unwrap();
    assert_eq!(a.wait(1), [(1, wc::RETRY_EXC_ERR)]);
    assert!(dst.iter().all(|b| *b == 0));
}

#[test]
fn an_overrun_cq_fails_polling() {
    let (a, b) = (dev(2), dev(8));
    let (qa, aa) = a.qp(8, 0);
    let (qb, ab) = b.qp(8, ALL);
    b.up(qb, &ab, &aa);
    a.up(qa, &aa, &ab);
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    let (lkey, _) = a.mr(&mut src, ALL);
    let (_, rkey) = b.mr(&mut dst, ALL);
    let wrs: Vec<_> = (0..3).map(|i| wr(i, WrOp::Write, &src, lkey, dst.as_ptr() as u64, rkey)).collect();
    post(&a.v, qa, &wrs).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut out = [Wc::default(); 4];
    let e = a.v.poll_cq(a.cq, &mut out).unwrap_err();
    assert!(e.message.contains("overrun"), "{e}");
}

#[test]
fn a_deregistered_region_is_refused_after_the_writes_before_landed() {
    let (a, qa, b, _qb) = pair(ALL, 16);
    let mut src = vec![9u8; 1 << 20];
    let mut dst = vec![0u8; 1 << 20];
    let (lkey, _) = a.mr(&mut src, ALL);
    let (dst_mr, _, rkey) = {
        // SAFETY: `dst` outlives the devices.
        unsafe { b.v.reg_mr(b.pd, dst.as_mut_ptr() as u64, dst.len() as u64, ALL) }.unwrap()
    };
    let remote = dst.as_ptr() as u64;
    post(&a.v, qa, &[wr(1, WrOp::Write, &src, lkey, remote, rkey)]).unwrap();
    assert_eq!(a.wait(1), [(1, wc::SUCCESS)]);
    // SAFETY: an MR of this test, deregistered once and not used after.
    unsafe { b.v.dereg_mr(dst_mr) }.unwrap();
    post(&a.v, qa, &[wr(2, WrOp::Read, &src[..64], lkey, remote, rkey)]).unwrap();
    assert_eq!(a.wait(1), [(2, wc::REM_ACCESS_ERR)], "a deregistered rkey is refused");
    assert_eq!(dst, src, "the first write had landed");
}

/// READs outstanding at once: a requester keeps up to its `max_rd_atomic` in flight, and a
/// responder QP sent more than its `max_dest_rd_atomic` refuses the one over it
/// (REM_INV_REQ_ERR) and goes to ERR, as a NIC does; a QP asked for more than the device has
/// is EINVAL.
#[test]
fn reads_over_the_responders_max_dest_rd_atomic_are_refused_as_by_a_nic() {
    let reads = |dest: u8, out: u8, n: usize| -> Vec<u32> {
        let (a, b) = (dev(64), dev(64));
        let (qa, aa) = a.qp(16, 0);
        let (qb, ab) = b.qp(16, ALL);
        b.up_rd(qb, &ab, &aa, dest, 16);
        a.up_rd(qa, &aa, &ab, 16, out);
        let mut src: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let (_, rkey) = b.mr(&mut src, ALL);
        let mut dst = vec![0u8; 8192];
        let (lkey, _) = a.mr(&mut dst, ALL);
        let at = src.as_ptr() as u64;
        let wrs: Vec<SendWr> = (0..n)
            .map(|i| {
                wr(i as u64, WrOp::Read, &dst[i * 1024..(i + 1) * 1024], lkey, at + i as u64 * 1024, rkey)
            })
            .collect();
        post(&a.v, qa, &wrs).unwrap();
        let got = a.wait(n);
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), (0..n as u64).collect::<Vec<_>>());
        let ok = got.iter().take_while(|g| g.1 == wc::SUCCESS).count();
        assert_eq!(dst[..ok * 1024], src[..ok * 1024], "the READs answered landed");
        got.into_iter().map(|g| g.1).collect()
    };
    assert_eq!(reads(2, 2, 6), vec![wc::SUCCESS; 6], "never more than 2 outstanding");
    assert_eq!(reads(16, 16, 6), vec![wc::SUCCESS; 6]);
    let over = reads(2, 16, 6);
    assert_eq!(&over[..3], &[wc::SUCCESS, wc::SUCCESS, wc::REM_INV_REQ_ERR], "{over:?}");
    assert!(over[3..].iter().all(|s| *s == wc::WR_FLUSH_ERR), "{over:?}");

    let d = dev(8);
    let (q, a) = d.qp(4, 0);
    let rtr = |rd_atomic| QpTransition::Rtr {
        remote: a,
        mtu: 5,
        port: 1,
        gid_index: 0,
        traffic_class: 0,
        sl: 0,
        rd_atomic,
    };
    assert!(d.v.modify_qp(q, &rtr(129)).is_err(), "over the device's max_qp_rd_atom (128)");
    d.v.modify_qp(q, &rtr(128)).unwrap();
    let rts = |rd_atomic| QpTransition::Rts { psn: 1, timeout: 1, retry_cnt: 1, rd_atomic };
    assert!(d.v.modify_qp(q, &rts(129)).is_err(), "over the device's max_qp_init_rd_atom (128)");
    d.v.modify_qp(q, &rts(128)).unwrap();
}

/// An inline WRITE carries the bytes its source held when it was posted (the provider copies
/// them then, as a NIC does), with no lkey; a QP asking for more inline bytes than the device
/// has is refused, and an inline request over the QP's `max_inline_data` is EINVAL.
#[test]
fn an_inline_write_carries_the_bytes_of_when_it_was_posted() {
    let (a, b) = (dev(64), dev(64));
    let caps = |inline| QpCaps {
        max_send_wr: 16,
        max_recv_wr: 1,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: inline,
    };
    assert!(a.v.create_qp(a.pd, a.cq, caps(4096)).is_err(), "more inline bytes than the device has");
    let q = a.v.create_qp(a.pd, a.cq, caps(64)).unwrap();
    a.v.modify_qp(q.qp, &QpTransition::Init { port: 1, access: 0 }).unwrap();
    let aa = QpAddr {
        gid: a.gid,
        lid: 0,
        qpn: q.qpn,
        psn: 100 + q.qpn,
        mtu: 5,
        rail: 0,
        reads_out: 16,
        reads_in: 16,
    };
    let (qb, ab) = b.qp(16, ALL);
    b.up(qb, &ab, &aa);
    a.up(q.qp, &aa, &ab);
    let mut dst = vec![0u8; 128];
    let (_, rkey) = b.mr(&mut dst, ALL);
    let mut src = vec![1u8; 64];
    let inline = SendWr { inline: true, ..wr(1, WrOp::Write, &src, 0, dst.as_ptr() as u64, rkey) };
    post(&a.v, q.qp, std::slice::from_ref(&inline)).unwrap();
    src.fill(2); // after the post: what was posted is what lands
    assert_eq!(a.wait(1), vec![(1, wc::SUCCESS)]);
    assert_eq!(&dst[..64], &[1u8; 64][..]);
    assert!(dst[64..].iter().all(|b| *b == 0));
    let big = vec![3u8; 65];
    let over = SendWr { inline: true, ..wr(2, WrOp::Write, &big, 0, dst.as_ptr() as u64, rkey) };
    assert_eq!(post(&a.v, q.qp, &[over]), Err(PostError { bad_wr: 0, errno: libc::EINVAL }));
}
