//! Round trips, truncations and limits of the frame codec.

use super::*;
use proptest::prelude::*;

fn seg() -> impl Strategy<Value = Seg> {
    (0u64..u64::MAX / 2, 1u64..1 << 40).prop_map(|(addr, len)| Seg { addr, len })
}

fn domain() -> impl Strategy<Value = Domain> + Clone {
    prop_oneof![
        Just(Domain::Host),
        Just(Domain::Device),
        (0u8..=Domain::MAX_CUDA_ORDINAL).prop_map(Domain::Cuda)
    ]
}

fn backend() -> impl Strategy<Value = String> + Clone {
    "[a-z0-9_-]{1,32}"
}

fn region() -> impl Strategy<Value = RegionEntry> + Clone {
    let key = (backend(), prop::collection::vec(any::<u8>(), 0..40))
        .prop_map(|(backend, key)| BackendKey { backend, key });
    (
        1u64..1 << 48,
        1u64..1 << 30,
        any::<u64>(),
        any::<bool>(),
        domain(),
        "[a-zA-Z0-9/._-]{0,40}",
        prop::collection::vec(key, 0..3),
    )
        .prop_map(|(addr, len, id, writable, domain, name, keys)| RegionEntry {
            addr,
            len,
            id,
            writable,
            domain,
            name,
            keys,
        })
}

fn capability() -> impl Strategy<Value = Capability> {
    (backend(), prop::collection::vec((domain(), domain()), 0..4), "[a-z0-9@.-]{0,40}")
        .prop_map(|(backend, domains, param)| Capability { backend, domains, param })
}

fn frame() -> impl Strategy<Value = Frame> {
    let s = "[a-zA-Z0-9:._ -]{0,40}";
    let regions = prop::collection::vec(region(), 0..20);
    prop_oneof![
        (s, any::<u64>(), any::<u16>(), any::<u16>(), any::<[u8; 32]>(), 0..=KNOWN_FLAGS).prop_map(
            |(e, n, i, c, a, flags)| Frame::Hello {
                host: e.chars().rev().collect(),
                dialled: format!("{e}:1"),
                engine_id: e,
                link_nonce: n,
                stream_index: i,
                stream_count: c,
                auth_nonce: a,
                flags,
            }
        ),
        (any::<[u8; 32]>(), any::<[u8; 32]>(), s)
            .prop_map(|(nonce, proof, engine_id)| Frame::AuthChallenge { nonce, proof, engine_id }),
        any::<[u8; 32]>().prop_map(|proof| Frame::AuthResponse { proof }),
        (s, s, any::<u64>(), prop::collection::vec(capability(), 0..4), regions.clone()).prop_map(
            |(e, host, v, capabilities, regions)| Frame::Welcome {
                engine_id: e,
                host,
                table_version: v,
                capabilities,
                regions
            }
        ),
        (0u64..1 << 40, 1u64..1 << 20, regions.clone(), prop::collection::vec(any::<u64>(), 0..20)).prop_map(
            |(from, step, added, removed)| Frame::RegionsDelta { from, version: from + step, added, removed }
        ),
        prop::collection::vec(seg(), 0..50).prop_map(|segs| Frame::Write { segs }),
        prop::collection::vec(seg(), 0..50).prop_map(|segs| Frame::Read { segs }),
        (1u32.., s).prop_map(|(status, message)| Frame::ReadResp { status, message }),
        (any::<u32>(), s).prop_map(|(status, message)| Frame::Ack { status, message }),
        (any::<u32>(), s).prop_map(|(status, message)| Frame::Error { status, message }),
        (s, s).prop_map(|(name, msg)| Frame::Notify { name, msg }),
        Just(Frame::Heartbeat),
        Just(Frame::HeartbeatAck),
        Just(Frame::Bye),
        Just(Frame::RegionsQuery),
        (any::<u64>(), regions.clone())
            .prop_map(|(version, regions)| Frame::RegionsTable { version, regions }),
        (any::<u64>(), regions).prop_map(|(version, regions)| Frame::RegionsUpdate { version, regions }),
        any::<u64>().prop_map(|version| Frame::RegionsAck { version }),
        (1u64..1 << 40, 1u64..1 << 20, 1u64..1 << 12, 0u64..1 << 12).prop_map(|(addr, count, size, pad)| {
            Frame::WriteStrided { seg: StridedSeg { addr, count, size, stride: size + pad } }
        }),
        (1u64..1 << 40, 1u64..1 << 20, 1u64..1 << 12, 0u64..1 << 12).prop_map(|(addr, count, size, pad)| {
            Frame::ReadStrided { seg: StridedSeg { addr, count, size, stride: size + pad } }
        }),
        (backend(), prop::collection::vec(any::<u8>(), 0..300))
            .prop_map(|(backend, payload)| Frame::BackendOpen { backend, payload }),
        (s, prop::collection::vec(any::<u8>(), 0..300)).prop_map(|(message, payload)| Frame::BackendOpened {
            status: 0,
            message,
            payload
        }),
        (1u32.., s).prop_map(|(status, message)| Frame::BackendOpened { status, message, payload: vec![] }),
    ]
}

proptest! {
    #[test]
    fn round_trip(f in frame(), tag in any::<u64>()) {
        let buf = encode(&f, tag, 0);
        let (h, g, used) = decode(&buf).unwrap();
        prop_assert_eq!(used, buf.len());
        prop_assert_eq!(h.tag, tag);
        prop_assert_eq!(h.bulk_len, f.bulk_len());
        prop_assert_eq!(g, f);
    }

    #[test]
    fn truncation_is_rejected(f in frame(), cut in 0usize..1000) {
        let buf = encode(&f, 1, 0);
        let cut = cut % buf.len();
        prop_assert!(decode(&buf[..cut]).is_err());
    }

    #[test]
    fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&b);
    }

    #[test]
    fn mutated_frames_never_panic(f in frame(), i in any::<usize>(), v in any::<u8>()) {
        let mut buf = encode(&f, 7, 0);
        let i = i % buf.len();
        buf[i] = v;
        let _ = decode(&buf);
    }
}

#[test]
fn oversized_fields_are_rejected() {
    let mut h = encode_header(&Header { kind: Kind::Write, payload_len: 0, tag: 0, bulk_len: 0 });
    h[4..8].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
    assert!(matches!(decode_header(&h), Err(WireError::TooLarge { field: "payload_len", .. })));
    // Each kind has its own cap: a Hello may not declare more than MAX_HELLO.
    let hello = encode_header(&Header { kind: Kind::Hello, payload_len: MAX_HELLO + 1, tag: 0, bulk_len: 0 });
    assert!(
        matches!(decode_header(&hello), Err(WireError::TooLarge { limit, .. }) if limit == MAX_HELLO as u64)
    );
    let hb = encode_header(&Header { kind: Kind::Heartbeat, payload_len: 1, tag: 0, bulk_len: 0 });
    assert!(decode_header(&hb).is_err(), "a heartbeat has no payload");
    let mut buf = encode(&Frame::Read { segs: vec![] }, 0, 0);
    buf[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&((MAX_DESCS + 1) as u32).to_le_bytes());
    assert!(matches!(decode(&buf), Err(WireError::TooLarge { field: "segment count", .. })));
    let mut v = encode(&Frame::Heartbeat, 0, 0);
    v[2] = 9;
    assert_eq!(decode(&v).unwrap_err(), WireError::BadVersion(9));
    let w = encode(&Frame::Write { segs: vec![Seg { addr: 1, len: 4 }] }, 0, 0);
    let (h, _, _) = decode(&w).unwrap();
    assert_eq!(h.bulk_len, 4);
    let mut bad = w.clone();
    bad[16..24].copy_from_slice(&5u64.to_le_bytes());
    assert!(decode(&bad).is_err(), "bulk_len must match the segments");
    let zero = encode(&Frame::Write { segs: vec![Seg { addr: 1, len: 0 }] }, 0, 0);
    assert!(decode(&zero).is_err(), "zero-length segment");
    let wrap = encode(&Frame::Read { segs: vec![Seg { addr: u64::MAX, len: 2 }] }, 0, 0);
    assert!(decode(&wrap).is_err(), "wrapping segment");
}

#[test]
fn region_limits_are_checked() {
    let mut e = RegionEntry::host(0x1000, 64, 1);
    e.name = "x".repeat(MAX_REGION_NAME);
    e.keys = vec![BackendKey { backend: "shm".into(), key: vec![1, 2, 3, 4] }];
    let f = Frame::RegionsTable { version: 1, regions: vec![e.clone()] };
    let buf = encode(&f, 0, 0);
    assert_eq!(decode(&buf).unwrap().1, f);
    assert_eq!(buf.len(), HEADER_LEN + 8 + 4 + e.encoded_len());
    // A name one byte too long, a bad backend name, an unknown domain are all refused.
    let mut long = e.clone();
    long.name.push('y');
    assert!(matches!(
        decode(&encode(&Frame::RegionsTable { version: 1, regions: vec![long] }, 0, 0)),
        Err(WireError::TooLarge { field: "region name", .. })
    ));
    let mut upper = e.clone();
    upper.keys[0].backend = "SHM".into();
    assert!(decode(&encode(&Frame::RegionsTable { version: 1, regions: vec![upper] }, 0, 0)).is_err());
    let mut dom = buf.clone();
    dom[HEADER_LEN + 8 + 4 + 25] = 7;
    assert!(matches!(decode(&dom), Err(WireError::Invalid { field: "memory domain", .. })));
    // A delta must move forward.
    let back = Frame::RegionsDelta { from: 5, version: 5, added: vec![], removed: vec![] };
    assert!(decode(&encode(&back, 0, 0)).is_err());
}

#[test]
fn names_with_control_characters_are_refused() {
    let hello = |engine_id: &str, host: &str| Frame::Hello {
        engine_id: engine_id.into(),
        host: host.into(),
        link_nonce: 1,
        stream_index: 0,
        stream_count: 1,
        auth_nonce: [0; 32],
        flags: 0,
        dialled: "127.0.0.1:1".into(),
    };
    assert!(decode(&encode(&hello("127.0.0.1:5", "h"), 0, 0)).is_ok());
    for (e, h, want) in
        [("a\nb", "h", ("engine_id", 1)), ("a", "\x1b[2J", ("host", 0)), ("a\u{85}", "h", ("engine_id", 1))]
    {
        match decode(&encode(&hello(e, h), 0, 0)) {
            Err(WireError::Control { field, at }) => assert_eq!((field, at), want),
            other => panic!("{e:?}/{h:?}: {other:?}"),
        }
    }
}
