//! Unit tests of option parsing.
use super::*;

#[test]
fn old_keys_are_unknown_keys_that_suggest_the_current_one() {
    // hixl.transport has no close key: the list of known keys names hixl.backends.
    for (old, new) in [
        ("hixl.transport", None),
        ("hixl.streams", Some("hixl.tcp.streams")),
        ("hixl.coalesce_us", Some("hixl.tcp.coalesce_us")),
        ("hixl.coalesce_max_ops", Some("hixl.tcp.coalesce_max_ops")),
        ("hixl.shm_threads", Some("hixl.shm.threads")),
    ] {
        let e = Options::parse(&map(&[(old, "1")])).unwrap_err();
        assert_eq!(e.status, crate::error::Status::ParamInvalid, "{e}");
        assert!(e.message.starts_with(&format!("unknown option key {old:?}")), "{e}");
        let hint = new.map(|n| format!("(did you mean {n:?}?)"));
        assert_eq!(hint.as_ref().is_some_and(|h| e.message.contains(h.as_str())), new.is_some(), "{e}");
        assert!(e.message.contains("known keys: hixl.backends,"), "{e}");
    }
}

fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn defaults_and_overrides() {
    assert_eq!(Options::parse(&map(&[])).unwrap(), Options::default());
    let o = Options::parse(&map(&[("hixl.tcp.streams", "4"), ("hixl.transfer_timeout_ms", "250")])).unwrap();
    assert_eq!(o.streams, 4);
    assert_eq!(o.backends, ["self", "cuda_ipc", "shm", "rdma", "tcp"], "fastest first by default");
    assert_eq!(
        (o.rdma.provider, o.rdma.port, o.rdma.gid_index, o.rdma.qps),
        (rdma::Provider::Verbs, 1, 0, 2)
    );
    assert_eq!(o.transfer_timeout, Duration::from_millis(250));
}

#[test]
fn cuda_streams_default_to_four_and_are_bounded() {
    assert_eq!(Options::default().cuda_streams, 4);
    assert_eq!(Options::parse(&map(&[("hixl.cuda.streams", "16")])).unwrap().cuda_streams, 16);
    for bad in ["0", "65", "x"] {
        let e = Options::parse(&map(&[("hixl.cuda.streams", bad)])).unwrap_err();
        assert!(e.message.contains("hixl.cuda.streams"), "{e}");
        let e = Options::parse(&map(&[("stream_count", bad)])).unwrap_err();
        assert!(e.message.contains("stream_count"), "{e}");
    }
    // HIXL's stream_count is the same pool; hixl's own key wins when both are given.
    assert_eq!(Options::parse(&map(&[("stream_count", "8")])).unwrap().cuda_streams, 8);
    let both = map(&[("stream_count", "8"), ("hixl.cuda.streams", "2")]);
    assert_eq!(Options::parse(&both).unwrap().cuda_streams, 2);
}

#[test]
fn bad_keys_and_values_name_themselves() {
    let e = Options::parse(&map(&[("hixl.stream", "4")])).unwrap_err();
    assert!(e.message.contains("\"hixl.stream\"") && !e.message.contains("\"4\""), "{e}");
    let e = Options::parse(&map(&[("hixl.tcp.streams", "0")])).unwrap_err();
    assert!(e.message.contains("hixl.tcp.streams=\"0\""), "{e}");
    let e = Options::parse(&map(&[("hixl.backends", "tcp,ib")])).unwrap_err();
    assert!(e.message.contains("\"tcp,ib\"") && e.message.contains("shm, rdma, tcp"), "{e}");
    let e = Options::parse(&map(&[("hixl.rdma.provider", "rxe")])).unwrap_err();
    assert!(e.message.contains("hixl.rdma.provider=\"rxe\"") && e.message.contains("verbs or soft"), "{e}");
    let e = Options::parse(&map(&[("hixl.rdma.device", "mlx5_0; rm")])).unwrap_err();
    assert!(e.message.contains("hixl.rdma.device"), "{e}");
    use super::rdma::Devices;
    let dev = |v: &str| Options::parse(&map(&[("hixl.rdma.device", v)])).map(|o| o.rdma.device);
    assert_eq!(dev("").unwrap(), Devices::First);
    assert_eq!(dev("ALL").unwrap(), Devices::All);
    assert_eq!(dev("mlx5_0").unwrap(), Devices::Named(vec!["mlx5_0".into()]));
    assert_eq!(dev(" rxe0, rxe1 ").unwrap(), Devices::Named(vec!["rxe0".into(), "rxe1".into()]));
    for (bad, says) in
        [("rxe0,,rxe1", "\"\""), ("rxe0,rxe0", "named twice"), ("a,b,c,d,e,f,g,h,i", "at most 8")]
    {
        let e = dev(bad).unwrap_err();
        assert!(e.message.contains(&format!("hixl.rdma.device={bad:?}")) && e.message.contains(says), "{e}");
    }
    let o = Options::parse(&map(&[("RdmaTrafficClass", "106"), ("RdmaServiceLevel", "3")])).unwrap();
    assert_eq!((o.rdma.traffic_class, o.rdma.service_level), (106, 3), "HIXL's keys act");
    let e = Options::parse(&map(&[("RdmaTrafficClass", "1"), ("hixl.rdma.traffic_class", "2")])).unwrap_err();
    assert!(e.message.contains("give one of them"), "{e}");
    let e = Options::parse(&map(&[("hixl.rdma.qps", "65")])).unwrap_err();
    assert!(e.message.contains("hixl.rdma.qps=\"65\""), "{e}");
    let e = Options::parse(&map(&[("hixl.queue_depth", "lots")])).unwrap_err();
    assert!(e.message.contains("lots"), "{e}");
}

#[test]
fn stream_caps_default_and_name_bad_values() {
    let o = Options::default();
    assert_eq!((o.max_streams, o.max_streams_per_source), (0, 0), "0: a share of the descriptor limit");
    let o =
        Options::parse(&map(&[("hixl.max_streams", "10"), ("hixl.max_streams_per_source", "3")])).unwrap();
    assert_eq!((o.max_streams, o.max_streams_per_source), (10, 3));
    for key in ["hixl.max_streams", "hixl.max_streams_per_source", "hixl.rdma.max_qps"] {
        let e = Options::parse(&map(&[(key, "-1")])).unwrap_err();
        assert!(e.message.contains(&format!("{key}=\"-1\"")), "{e}");
    }
    let e = Options::parse(&map(&[("hixl.rdma.max_qps_per_source", "0")])).unwrap_err();
    assert!(e.message.contains("hixl.rdma.max_qps_per_source=\"0\""), "{e}");
}

#[test]
fn the_backend_table_gives_the_backends_help_built_and_by_name() {
    let decls = crate::transport::backends::decls();
    let help = keys_with(&decls).into_iter().find(|(k, _, _)| *k == "hixl.backends").unwrap().2;
    assert_eq!(
        help,
        "backends that may carry data, tried in this order: auto (= self,cuda_ipc,shm,rdma,tcp; cuda_ipc \
         is offered only where CUDA is found, rdma only with a usable device) or a list of self (same \
         process), cuda_ipc (same host, CUDA memory too), shm (same host), rdma (RDMA verbs), tcp (any host)"
    );
    let names: Vec<&str> = decls.iter().map(|d| d.name).collect();
    assert_eq!(*crate::transport::backends::BUILT, names);
    assert_eq!(Options::default().built, names);
    let o = Options::default();
    for d in &decls {
        let b = crate::transport::backends::by_name(d.name, &o).unwrap();
        assert_eq!(b.name(), d.name, "the table's row makes the backend it declares");
        for row in d.options {
            assert!(row.key.starts_with(&format!("hixl.{}.", d.name)), "{} is not {}'s", row.key, d.name);
        }
    }
    assert!(crate::transport::backends::by_name("ib", &o).is_none());
}

#[test]
fn every_key_is_one_row_and_a_backends_rows_parse_only_with_its_declaration() {
    let decls = crate::transport::backends::decls();
    let keys: Vec<_> = keys_with(&decls).into_iter().map(|(k, _, _)| k).collect();
    let mut unique = keys.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), keys.len(), "a key declared twice: {keys:?}");
    for key in ["hixl.tcp.streams", "hixl.shm.threads", "hixl.rdma.qps"] {
        assert!(keys.contains(&key), "{key}");
    }
    // Without the table, a backend's key is unknown and `auto` means no backend.
    let e = Options::parse_with(&map(&[("hixl.tcp.streams", "4")]), &[]).unwrap_err();
    assert!(e.message.contains("unknown option key \"hixl.tcp.streams\""), "{e}");
    assert!(Options::defaults_with(&[]).backends.is_empty());
    let only_tcp: Vec<_> = decls.iter().copied().filter(|d| d.name == "tcp").collect();
    let o = Options::parse_with(&map(&[("hixl.tcp.streams", "4"), ("hixl.backends", "auto")]), &only_tcp)
        .unwrap();
    assert_eq!((o.streams, o.backends), (4, vec!["tcp".to_string()]));
    let e = Options::parse_with(&map(&[("hixl.backends", "shm")]), &only_tcp).unwrap_err();
    assert!(e.message.contains("a comma-separated list of tcp (this build's backends)"), "{e}");
}
