"""hixl's same-host backend (cross-memory attach) vs raw process_vm_writev, in the same run.

    python benches/same_host.py            # 128 MiB and 8192 x 16 KiB, 10 runs per row
    python benches/same_host.py --quick    # 32 MiB and 2048 x 16 KiB, 3 runs
    python benches/same_host.py --threads 1 --json out.json

Two processes: this one (initiator) and a target it starts, which holds a registered buffer.
The raw baseline is a Rust loop of process_vm_writev/readv calls (one call for the big
message, IOV_MAX iovecs per call for the scattered one) with iovecs built before timing.
Reports min and median in decimal GB/s and hixl / raw ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
MIB = 1 << 20


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = np.ones(size, np.uint8)  # touched: no zero-page reads
    e.register(buf)
    shared = e.alloc(size)  # engine-allocated: same-host peers copy through a mapping
    shared[:] = 1
    import os

    print(
        f"READY {e.local_engine} {os.getpid()} {buf.ctypes.data} {shared.ctypes.data}", flush=True
    )
    sys.stdin.read()
    e.finalize()


def timed(fn, iters: int) -> list[float]:
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", type=int, metavar="SIZE", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2048 blocks, 3 runs")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per row (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="hixl.shm_threads (default 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)

    size = 32 * MIB if a.quick else 128 * MIB
    iters = a.iters or (3 if a.quick else 10)
    nblk, blk = (2048 if a.quick else 8192), 16 * 1024
    span = max(size, nblk * blk)  # a multiple of 2 MiB, as alloc rounds
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(span)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    tag, peer, pid, raddr, saddr = target.stdout.readline().split()
    assert tag == "READY"
    pid, raddr, saddr = int(pid), int(raddr), int(saddr)

    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.transport": "shm", "hixl.shm_threads": str(a.threads)})
    src = np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)
    dst = np.ones_like(src)
    e.register(src)
    e.register(dst)
    e.connect(peer, timeout_ms=5000)
    assert e.stats()[peer]["backend"] == "shm"

    big_w = np.array([[src.ctypes.data, raddr, size]], np.uint64)
    big_r = np.array([[dst.ctypes.data, raddr, size]], np.uint64)
    perm = np.random.default_rng(2).permutation(nblk).astype(np.uint64)
    scat = np.stack(
        [src.ctypes.data + np.arange(nblk, dtype=np.uint64)[::-1] * blk,
         raddr + perm * blk, np.full(nblk, blk, np.uint64)], axis=1,
    ).astype(np.uint64)  # fmt: skip

    rows: dict[str, dict] = {}

    def row(name: str, secs: list[float], nbytes: int) -> None:
        rows[name] = {
            "best_GBps": nbytes / min(secs) / 1e9,
            "median_GBps": nbytes / statistics.median(secs) / 1e9,
        }

    # What a copy through a shared mapping could do at best: memcpy in one process, one thread.
    row("memcpy_1thread_big", timed(lambda: np.copyto(dst[:size], src[:size]), iters), size)
    row("raw_cma_write_big", hixl._hixl._raw_cma(pid, True, big_w, iters), size)
    row("hixl_write_big", timed(lambda: e.transfer_sync(peer, W, big_w, 60_000), iters), size)
    row("raw_cma_read_big", hixl._hixl._raw_cma(pid, False, big_r, iters), size)
    row("hixl_read_big", timed(lambda: e.transfer_sync(peer, R, big_r, 60_000), iters), size)
    row("raw_cma_write_scattered", hixl._hixl._raw_cma(pid, True, scat, iters), nblk * blk)
    row(
        "hixl_write_scattered",
        timed(lambda: e.transfer_sync(peer, W, scat, 60_000), iters), nblk * blk,
    )  # fmt: skip

    # The same moves into the target's engine-allocated memory: memcpy through a mapping.
    direct0 = e.stats()[peer]["direct_parts"]

    def to_shared(d: np.ndarray) -> np.ndarray:
        out = d.copy()
        out[:, 1] = out[:, 1] - np.uint64(raddr) + np.uint64(saddr)
        return out

    m_w, m_r, m_s = to_shared(big_w), to_shared(big_r), to_shared(scat)
    row("hixl_write_big_mapped", timed(lambda: e.transfer_sync(peer, W, m_w, 60_000), iters), size)
    row("hixl_read_big_mapped", timed(lambda: e.transfer_sync(peer, R, m_r, 60_000), iters), size)
    row(
        "hixl_write_scattered_mapped",
        timed(lambda: e.transfer_sync(peer, W, m_s, 60_000), iters), nblk * blk,
    )  # fmt: skip
    assert e.stats()[peer]["direct_parts"] > direct0, "the mapped path was not used"

    small = [(src.ctypes.data, raddr, 4096)]
    n_small = 2000 if a.quick else 20000
    lat = timed(lambda: e.transfer_sync(peer, W, small), n_small)
    raw_small = hixl._hixl._raw_cma(pid, True, np.array([small[0]], np.uint64), n_small)
    rows["write_4KiB_sync_latency"] = {
        "median_us": statistics.median(lat) * 1e6,
        "p99_us": float(np.percentile(lat, 99) * 1e6),
        "raw_cma_median_us": statistics.median(raw_small) * 1e6,
    }
    reg = np.ones(128 * MIB, np.uint8)
    reg_t = []
    for _ in range(20):
        t0 = time.perf_counter()
        h = e.register_mem(hixl.MemDesc(reg.ctypes.data, reg.nbytes))
        reg_t.append(time.perf_counter() - t0)
        e.deregister_mem(h)
    rows["register_128MiB_us"] = {"median": statistics.median(reg_t) * 1e6}
    e.finalize()
    target.stdin.close()
    target.wait(30)

    print(f"hixl {hixl.__version__} same host (CMA), {size // MIB} MiB and {nblk} x 16 KiB, "
          f"{iters} runs, hixl.shm_threads={a.threads}")  # fmt: skip
    print(f"{'row':26} {'best GB/s':>10} {'median GB/s':>12} {'x raw best':>11} {'x raw med':>10}")
    for name, base in [
        ("memcpy_1thread_big", "raw_cma_write_big"),
        ("raw_cma_write_big", None), ("hixl_write_big", "raw_cma_write_big"),
        ("raw_cma_read_big", None), ("hixl_read_big", "raw_cma_read_big"),
        ("raw_cma_write_scattered", None), ("hixl_write_scattered", "raw_cma_write_scattered"),
        ("hixl_write_big_mapped", "raw_cma_write_big"),
        ("hixl_read_big_mapped", "raw_cma_read_big"),
        ("hixl_write_scattered_mapped", "raw_cma_write_scattered"),
    ]:  # fmt: skip
        r = rows[name]
        b = rows[base] if base else r
        r["ratio_to_raw"] = r["best_GBps"] / b["best_GBps"]
        r["median_ratio_to_raw"] = r["median_GBps"] / b["median_GBps"]
        print(f"{name:26} {r['best_GBps']:10.2f} {r['median_GBps']:12.2f} "
              f"{r['ratio_to_raw']:11.2f} {r['median_ratio_to_raw']:10.2f}")  # fmt: skip
    lr = rows["write_4KiB_sync_latency"]
    print(
        f"4 KiB sync WRITE from Python: median {lr['median_us']:.2f} us, p99 {lr['p99_us']:.2f} "
        f"us (raw CMA call median {lr['raw_cma_median_us']:.2f} us)"
    )
    print(f"register 128 MiB: median {rows['register_128MiB_us']['median']:.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
