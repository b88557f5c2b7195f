//! The backend's target side and registration refusals, with the soft provider.

use super::*;

#[test]
fn a_refused_registration_fails_only_when_rdma_is_the_one_backend() {
    let enomem = || Error::failed("ibv_reg_mr(0x1000+4096) failed: Cannot allocate memory (os error 12)");
    let e = refused_registration(enomem(), true).unwrap_err();
    assert!(e.message.contains("ulimit -l") && e.message.contains("0x1000"), "{e}");
    assert_eq!(refused_registration(enomem(), false).unwrap(), None, "left without an rdma key");
    let e = refused_registration(Error::failed("ibv_reg_mr failed: Bad address"), true).unwrap_err();
    assert!(!e.message.contains("ulimit"), "{e}");
}

const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

fn soft_backend_with(extra: &[(&str, &str)]) -> Arc<dyn Backend> {
    let kv = [("hixl.backends", "rdma"), ("hixl.rdma.provider", "soft")];
    let map = kv.iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Arc::new(Rdma::new(&Options::parse(&map).unwrap()))
}

fn soft_backend() -> Arc<dyn Backend> {
    soft_backend_with(&[])
}

/// QPs are capped per source and per engine, across links; a link's end gives its back.
#[test]
fn target_qps_are_capped_per_source_and_per_engine() {
    use crate::transport::backend::{answer_open, Accepted};
    let backends =
        vec![soft_backend_with(&[("hixl.rdma.max_qps", "6"), ("hixl.rdma.max_qps_per_source", "4")])];
    let q =
        |qpn| QpAddr { gid: [0xfe; 16], lid: 0, qpn, psn: 7, mtu: 5, rail: 0, reads_out: 16, reads_in: 16 };
    let ask = |n: u32| RdmaOpen { retire: vec![], qps: (0..n).map(|i| q(0x40 + i)).collect() }.encode();
    let other = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));
    let (mut a, mut b, mut c) = (Accepted::new(), Accepted::new(), Accepted::new());
    assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(3), &mut a)).0, 0);
    let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &ask(2), &mut b));
    assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
    assert!(msg.contains("hixl.rdma.max_qps_per_source = 4") && msg.contains("127.0.0.1"), "{msg}");
    assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(1), &mut b)).0, 0);
    let (status, msg, _) = opened(answer_open(&backends, true, other, "rdma", &ask(3), &mut c));
    assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
    assert!(msg.contains("hixl.rdma.max_qps = 6"), "{msg}");
    drop(a);
    assert_eq!(opened(answer_open(&backends, true, other, "rdma", &ask(3), &mut c)).0, 0);
    assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(2), &mut b)).0, 0);
}

fn opened(f: crate::wire::Frame) -> (u32, String, Vec<u8>) {
    match f {
        crate::wire::Frame::BackendOpened { status, message, payload } => (status, message, payload),
        other => panic!("not an answer: {other:?}"),
    }
}

/// The target's side of BackendOpen: hostile payloads are refused naming the problem,
/// only a control link may open, QPs are made per link (and retired only from it), and a
/// link cannot make more than its share.
#[test]
fn the_target_answers_backend_open_and_bounds_what_a_link_makes() {
    use crate::transport::backend::{answer_open, Accepted};
    let backends = vec![soft_backend()];
    let mut link = Accepted::new();
    let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &[1, 2, 3], &mut link));
    assert_eq!(Status::from_code(status), Status::ParamInvalid, "{msg}");
    assert!(msg.contains("RDMA QP addresses"), "{msg}");
    let q =
        |qpn| QpAddr { gid: [0xfe; 16], lid: 0, qpn, psn: 7, mtu: 5, rail: 0, reads_out: 16, reads_in: 16 };
    let ask = RdmaOpen { retire: vec![], qps: vec![q(0x41), q(0x42)] }.encode();
    let (status, msg, _) = opened(answer_open(&backends, false, LOCAL, "rdma", &ask, &mut link));
    assert_eq!(Status::from_code(status), Status::ParamInvalid, "a data-path stream: {msg}");
    let (status, _, _) = opened(answer_open(&backends, true, LOCAL, "gpu", &ask, &mut link));
    assert_eq!(Status::from_code(status), Status::Unsupported);
    let (status, msg, payload) = opened(answer_open(&backends, true, LOCAL, "rdma", &ask, &mut link));
    assert_eq!(status, 0, "{msg}");
    let ours = RdmaOpen::decode(&payload).unwrap();
    assert_eq!(ours.qps.len(), 2, "one target QP per initiator QP");
    let held = |link: &mut Accepted| {
        let st = link[0].1.as_mut().unwrap().downcast_mut::<TargetQps>().unwrap();
        st.qps.iter().map(|(_, _, n)| *n).collect::<Vec<u32>>()
    };
    assert_eq!(held(&mut link), ours.qps.iter().map(|a| a.qpn).collect::<Vec<_>>());
    let qref = |qpn| crate::wire::rdma::QpRef { rail: 0, qpn };
    // A replacement retires one of this link's QPs; an unknown number is ignored.
    let again = RdmaOpen { retire: vec![qref(ours.qps[0].qpn), qref(0x7777)], qps: vec![q(0x43)] }.encode();
    let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &again, &mut link));
    assert_eq!(status, 0, "{msg}");
    assert_eq!(held(&mut link).len(), 2);
    assert!(!held(&mut link).contains(&ours.qps[0].qpn));
    // At most MAX_TARGET_QPS per link.
    let many = RdmaOpen { retire: vec![], qps: (0..MAX_QPS as u32).map(|i| q(0x100 + i)).collect() }.encode();
    assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &many, &mut link)).0, 0);
    let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &many, &mut link));
    assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
    assert_eq!(held(&mut link).len(), 2 + MAX_QPS);
}

/// The target answers each QP with the READs it accepts from it: no more than its initiator
/// keeps outstanding (nor its own device answers), and says its own outstanding depth.
#[test]
fn the_target_answers_with_the_read_depth_of_each_pair() {
    use crate::transport::backend::{answer_open, Accepted};
    let backends = vec![soft_backend()];
    let q = |qpn, reads_out| QpAddr {
        gid: [0xfe; 16],
        lid: 0,
        qpn,
        psn: 7,
        mtu: 5,
        rail: 0,
        reads_out,
        reads_in: 16,
    };
    let ask = RdmaOpen { retire: vec![], qps: vec![q(0x41, 3), q(0x42, 16)] }.encode();
    let mut link = Accepted::new();
    let (status, msg, payload) = opened(answer_open(&backends, true, LOCAL, "rdma", &ask, &mut link));
    assert_eq!(status, 0, "{msg}");
    let ours = RdmaOpen::decode(&payload).unwrap();
    let depths: Vec<(u8, u8)> = ours.qps.iter().map(|a| (a.reads_out, a.reads_in)).collect();
    // The soft device allows 128 each way, cut to the 16 the backend asks for.
    assert_eq!(depths, vec![(16, 3), (16, 16)]);
}
