//! Criterion benches of the per-call CPU work on hixl's data path, with no I/O:
//! `cargo bench -p hixl-core --bench hot_paths` (add `-- --quick` for a short run).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use hixl_core::unstable::queue::{SegPair, Strided, WorkQueue};
use hixl_core::unstable::registry::{new_holder_id, Abort, MemType, Registry, RemoteTable};
use hixl_core::unstable::wire::{self, Frame, RegionEntry, Seg};
use hixl_core::unstable::{push_merged, split};
use hixl_core::TransferOpDesc;

const REGIONS: u64 = 4096;
const REGION_LEN: u64 = 1 << 20;
const BASE: u64 = 0x7f00_0000_0000;

/// 4096 registered 1 MiB regions with 4 KiB gaps, as a registry and as a peer's table.
fn regions() -> (Registry, RemoteTable) {
    let reg = Registry::new();
    let mut table = Vec::new();
    for i in 0..REGIONS {
        let addr = BASE + i * (REGION_LEN + 4096);
        reg.register(addr, REGION_LEN, MemType::Host).expect("register");
        table.push(RegionEntry::host(addr, REGION_LEN, i));
    }
    (reg, RemoteTable::new(table))
}

/// `n` 1 KiB descriptors inside the first region; `contiguous` ones merge into one segment,
/// the others do not.
fn descs(n: u64, contiguous: bool) -> Vec<TransferOpDesc> {
    (0..n)
        .map(|i| {
            let r = if contiguous { i } else { (i * 7919) % n };
            TransferOpDesc { local_addr: BASE + i * 1024, remote_addr: BASE + r * 1024, len: 1024 }
        })
        .collect()
}

fn registry_lookup(c: &mut Criterion) {
    let (reg, table) = regions();
    let mut g = c.benchmark_group("registry");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u64;
    g.bench_function("local lookup, 4k regions", |b| {
        b.iter(|| {
            i = (i + 2399) % REGIONS;
            black_box(reg.lookup(BASE + i * (REGION_LEN + 4096) + 100, 4096, "local").is_ok())
        })
    });
    g.bench_function("remote table contains, 4k regions", |b| {
        b.iter(|| {
            i = (i + 2399) % REGIONS;
            black_box(table.contains(BASE + i * (REGION_LEN + 4096) + 100, 4096))
        })
    });
    g.finish();
}

/// What `transfer_async` does per descriptor before anything is queued: find the local
/// region, check the remote range against the peer's table, merge with the previous one.
fn validate_and_merge(c: &mut Criterion) {
    let (reg, table) = regions();
    let mut g = c.benchmark_group("validate+merge");
    for (name, contiguous) in [("1024 adjacent", true), ("1024 scattered", false)] {
        let ds = descs(1024, contiguous);
        g.throughput(Throughput::Elements(ds.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut segs: Vec<SegPair> = Vec::with_capacity(ds.len());
                for d in &ds {
                    let ok = reg.lookup(d.local_addr, d.len, "local").is_ok()
                        && table.contains(d.remote_addr, d.len);
                    assert!(ok);
                    push_merged(&mut segs, d);
                }
                black_box(split(segs, 1024 * 1024, 2, 1 << 20))
            })
        });
    }
    g.finish();
}

fn strided_expansion(c: &mut Criterion) {
    let st = Strided { local: BASE, remote: BASE, count: 4096, size: 256, lstride: 256, rstride: 1024 };
    let mut g = c.benchmark_group("strided");
    g.throughput(Throughput::Elements(st.count));
    g.bench_function("expand 4096 elements, 1024 per chunk", |b| {
        b.iter(|| {
            let mut n = 0u64;
            st.for_each_chunk::<()>(1024, |segs| {
                n += segs.iter().map(|s| s.len).sum::<u64>();
                Ok(())
            })
            .unwrap();
            black_box(n)
        })
    });
    g.throughput(Throughput::Elements(1));
    g.bench_function("split into 2 parts", |b| b.iter(|| black_box(black_box(st).split(2))));
    g.finish();
}

fn wire_codec(c: &mut Criterion) {
    let segs: Vec<Seg> = (0..1024).map(|i| Seg { addr: BASE + i * 8192, len: 4096 }).collect();
    let frame = Frame::Write { segs };
    let bytes = wire::encode(&frame, 42, 0);
    let mut g = c.benchmark_group("wire");
    g.throughput(Throughput::Elements(1024));
    g.bench_function("encode Write, 1024 segments", |b| b.iter(|| black_box(wire::encode(&frame, 42, 0))));
    g.bench_function("decode Write, 1024 segments", |b| b.iter(|| black_box(wire::decode(&bytes).unwrap())));
    g.finish();
}

fn queue_push_pop(c: &mut Criterion) {
    let q: Arc<WorkQueue<u64>> = Arc::new(WorkQueue::new(4096));
    let mut g = c.benchmark_group("queue");
    g.throughput(Throughput::Elements(256));
    g.bench_function("reserve+push+pop 256, one thread", |b| {
        b.iter_batched(
            || (),
            |_| {
                q.reserve(256).unwrap();
                for i in 0..256u64 {
                    q.push_reserved(i);
                }
                let mut n = 0;
                while let Some(v) = q.pop() {
                    n += v;
                }
                black_box(n)
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// A pin holder that is never aborted.
struct Holder(u64);
impl Abort for Holder {
    fn abort(&self, _why: &str) {}
    fn holder_id(&self) -> u64 {
        self.0
    }
}

/// What every transfer pays per region on each side: take a pin and release it; alone, and
/// with two holders (two links) pinning the same region from two threads at once.
fn region_pins(c: &mut Criterion) {
    let reg = Registry::new();
    let region = reg.register(BASE, REGION_LEN, MemType::Host).expect("register");
    let mut g = c.benchmark_group("pins");
    g.throughput(Throughput::Elements(1));
    let one: Arc<dyn Abort> = Arc::new(Holder(new_holder_id()));
    g.bench_function("pin+release, one thread", |b| b.iter(|| drop(black_box(region.pin(&one).unwrap()))));
    g.bench_function("pin+release, two threads on one region", |b| {
        b.iter_custom(|iters| {
            let start = std::time::Instant::now();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    let region = region.clone();
                    s.spawn(move || {
                        let h: Arc<dyn Abort> = Arc::new(Holder(new_holder_id()));
                        for _ in 0..iters {
                            drop(black_box(region.pin(&h).unwrap()));
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    region_pins,
    registry_lookup,
    validate_and_merge,
    strided_expansion,
    wire_codec,
    queue_push_pop
);
criterion_main!(benches);
