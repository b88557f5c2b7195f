//! A time-bounded fuzz run of the frame decoder, the code that reads whatever a peer sends:
//! random bytes, random bytes behind a valid header, and valid frames with random mutations,
//! truncations and splices. It must never panic, never loop, and never accept a frame whose
//! re-encoding differs. `HIXL_FUZZ_SECONDS` sets the time (default 2; CI runs longer).

use std::time::{Duration, Instant};

use hixl_core::unstable::auth::{FrameMac, MAC_LEN};
use hixl_core::unstable::wire::rdma::{QpAddr, QpRef, RdmaOpen};
use hixl_core::unstable::wire::{
    self, BackendKey, Capability, Domain, Frame, RegionEntry, Seg, StridedSeg, HEADER_LEN,
};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The session key of the sealed-stream check.
const KEY: [u8; 32] = [0x5a; 32];

fn seed_frames() -> Vec<Vec<u8>> {
    let mut named = RegionEntry::host(0x9000, 64, 2);
    named.name = "kv".into();
    named.keys = vec![BackendKey { backend: "shm".into(), key: 7i32.to_le_bytes().to_vec() }];
    let regions = vec![RegionEntry::host(0x1000, 4096, 1), named];
    let frames = vec![
        Frame::Hello {
            engine_id: "a:1".into(),
            host: "h".into(),
            link_nonce: 3,
            stream_index: 0,
            stream_count: 2,
            auth_nonce: [7; 32],
            flags: wire::FLAG_DATA_MAC,
            dialled: "127.0.0.1:4000".into(),
        },
        Frame::Welcome {
            engine_id: "b".into(),
            host: "h".into(),
            table_version: 3,
            capabilities: vec![
                Capability {
                    backend: "shm".into(),
                    domains: vec![(Domain::Host, Domain::Host)],
                    param: "hixl-00".into(),
                },
                Capability {
                    backend: "tcp".into(),
                    domains: vec![(Domain::Host, Domain::Host)],
                    param: String::new(),
                },
            ],
            regions: regions.clone(),
        },
        Frame::RegionsDelta { from: 3, version: 5, added: regions.clone(), removed: vec![4, 9] },
        Frame::Write { segs: vec![Seg { addr: 0x1000, len: 16 }, Seg { addr: 0x2000, len: 8 }] },
        Frame::Read { segs: vec![Seg { addr: 0x1000, len: 16 }] },
        Frame::ReadResp { status: 0, message: String::new() },
        Frame::Ack { status: 103900, message: "no".into() },
        Frame::Notify { name: "n".into(), msg: "m".into() },
        Frame::RegionsTable { version: 8, regions: regions.clone() },
        Frame::RegionsUpdate { version: 9, regions },
        Frame::WriteStrided { seg: StridedSeg { addr: 0x1000, count: 4, size: 64, stride: 128 } },
        Frame::ReadStrided { seg: StridedSeg { addr: 0x1000, count: 4, size: 64, stride: 128 } },
        Frame::AuthChallenge { nonce: [1; 32], proof: [2; 32], engine_id: "b".into() },
        Frame::AuthResponse { proof: [3; 32] },
        Frame::Heartbeat,
        Frame::Bye,
        Frame::BackendOpen { backend: "rdma".into(), payload: rdma_open().encode() },
        Frame::BackendOpened { status: 0, message: String::new(), payload: rdma_open().encode() },
        Frame::BackendOpened { status: 103900, message: "no device".into(), payload: vec![] },
    ];
    let mut out: Vec<Vec<u8>> = frames
        .iter()
        .map(|f| wire::encode(f, 5, if matches!(f, Frame::ReadResp { .. }) { 16 } else { 0 }))
        .collect();
    // Sealed copies, which mutations turn into forgeries.
    let sealed: Vec<Vec<u8>> = out
        .iter()
        .map(|b| {
            let mut b = b.clone();
            FrameMac::new(Some(KEY), false).seal(&mut b);
            b
        })
        .collect();
    out.extend(sealed);
    out
}

fn rdma_open() -> RdmaOpen {
    let q = QpAddr {
        gid: [0xfe; 16],
        lid: 0,
        qpn: 0x11,
        psn: 0x123,
        mtu: 5,
        rail: 0,
        reads_out: 16,
        reads_in: 16,
    };
    RdmaOpen {
        retire: vec![QpRef { rail: 1, qpn: 0x10 }],
        qps: vec![q, QpAddr { qpn: 0x12, rail: 1, reads_in: 2, ..q }],
    }
}

/// The rdma backend's payload inside a BackendOpen is peer input too: it must decode to
/// itself or be refused, never panic.
fn check_rdma_payload(b: &[u8]) {
    if let Ok(o) = RdmaOpen::decode(b) {
        assert_eq!(o.encode(), b, "accepted an rdma payload that does not re-encode to itself");
    }
    if let Ok(k) = wire::rdma::decode_rkeys(b) {
        assert_eq!(wire::rdma::encode_rkeys(&k), b, "an rdma key that does not re-encode to itself");
    }
}

/// A decoded strided descriptor walks lazily into ranges that cover exactly its bytes, in
/// order, inside its span, no more of them than `pieces()` (walked only when few).
fn check_strided_walk(seg: &StridedSeg) {
    let r = seg.ranges().expect("a decoded strided descriptor walks");
    assert_eq!(r.remaining(), seg.pieces());
    let _ = seg.check_elems();
    if seg.pieces() > 4096 {
        return;
    }
    let (end, mut at, mut bytes) = (seg.addr + seg.span().unwrap(), seg.addr, 0u64);
    for (a, n) in r {
        assert!(a >= at && a + n <= end, "range 0x{a:x}+{n} outside or out of order: {seg:?}");
        at = a + n;
        bytes += n;
    }
    assert_eq!(Some(bytes), seg.bytes(), "{seg:?}");
}

fn check(buf: &[u8]) {
    // On a sealed stream, no mutated or random frame may pass the MAC check: the receiver's
    // opener (sequence 0, the key below) must refuse everything but the sealed original.
    if buf.len() > MAC_LEN {
        let (frame, mac) = buf.split_at(buf.len() - MAC_LEN);
        let mut opener = FrameMac::new(Some(KEY), false);
        let mut sealer = FrameMac::new(Some(KEY), false);
        let mut sealed = frame.to_vec();
        sealer.seal(&mut sealed);
        let genuine = sealed == buf;
        assert_eq!(opener.open(&[frame], mac).is_ok(), genuine, "a frame with a forged MAC was accepted");
    }
    if let Ok((h, f, used)) = wire::decode(buf) {
        assert!(used <= buf.len());
        if let Frame::BackendOpen { payload, .. } | Frame::BackendOpened { payload, .. } = &f {
            check_rdma_payload(payload);
        }
        if let Frame::WriteStrided { seg } | Frame::ReadStrided { seg } = &f {
            check_strided_walk(seg);
        }
        let again = wire::encode(&f, h.tag, h.bulk_len);
        assert_eq!(&again[..], &buf[..used], "accepted a frame that does not re-encode to itself: {f:?}");
    }
}

#[test]
fn decoder_survives_hostile_input() {
    let secs: u64 = std::env::var("HIXL_FUZZ_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let end = Instant::now() + Duration::from_secs(secs);
    let seeds = seed_frames();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ std::process::id() as u64);
    let mut runs = 0u64;
    while Instant::now() < end {
        for _ in 0..1000 {
            let mut buf = match rng.below(4) {
                0 => {
                    let n = rng.below(256) as usize;
                    rng.bytes(n)
                }
                1 => {
                    // A plausible header (magic, version, any kind) over random payload.
                    let mut b = seeds[0][..4].to_vec();
                    b[3] = rng.below(26) as u8;
                    let n = rng.below(300) as usize;
                    b.extend_from_slice(&(n as u32).to_le_bytes());
                    b.extend_from_slice(&rng.bytes(16));
                    b.extend_from_slice(&rng.bytes(n));
                    b
                }
                _ => seeds[rng.below(seeds.len() as u64) as usize].clone(),
            };
            for _ in 0..rng.below(6) {
                if buf.is_empty() {
                    break;
                }
                let i = rng.below(buf.len() as u64) as usize;
                match rng.below(4) {
                    0 => buf[i] = rng.next() as u8,
                    1 => buf.truncate(i),
                    2 => {
                        let n = rng.below(40) as usize;
                        let tail = rng.bytes(n);
                        buf.splice(i..i, tail);
                    }
                    _ => {
                        // Overwrite an aligned 8-byte field with an extreme value.
                        let v =
                            [0u64, 1, u64::MAX, u64::MAX / 2, 1 << 32, 0xFFFF_FFFF][rng.below(6) as usize];
                        let i = HEADER_LEN.min(buf.len()) + (i / 8) * 8;
                        if i + 8 <= buf.len() {
                            buf[i..i + 8].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
            }
            check(&buf);
            runs += 1;
        }
    }
    println!("decoded {runs} hostile inputs in {secs} s");
    assert!(runs > 1000);
}
