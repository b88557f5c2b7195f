"""hixl's same-host backend (cross-memory attach) vs raw process_vm_writev, in the same run.

    python benches/same_host.py            # 128 MiB and 8192 x 16 KiB, 10 runs per row
    python benches/same_host.py --quick    # 32 MiB and 2048 x 16 KiB, 3 runs
    python benches/same_host.py --threads 1 --json out.json

Two processes: this one (initiator) and a target it starts, which holds a registered buffer and
an engine-allocated one (alloc: copied through a mapping). The raw baseline is a Rust loop of
process_vm_writev/readv calls (one call for the big message, IOV_MAX iovecs per call for the
scattered one) with iovecs built before timing. Reports min and median in decimal GB/s.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from _common import (
    MIB,
    Plan,
    bandwidth_row,
    parser,
    print_ratios,
    start_target,
    stop_target,
    timed,
    write_json,
)

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = np.ones(size, np.uint8)  # touched: no zero-page reads
    e.register(buf)
    shared = e.alloc(size)  # engine-allocated: same-host peers copy through a mapping
    shared[:] = 1
    pid = os.getpid()
    print(f"READY {e.local_engine} {pid} {buf.ctypes.data} {shared.ctypes.data}", flush=True)
    sys.stdin.read()
    e.finalize()


def main() -> None:
    ap = parser(__doc__, "32 MiB, 2048 blocks, 3 runs")
    ap.add_argument("--threads", type=int, default=2, help="hixl.shm.threads (default 2)")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    plan = Plan.of(a)
    size, iters, nblk, blk = plan.size, plan.iters, plan.nblk, plan.blk
    target, (peer, pid, raddr, saddr) = start_target(__file__, plan.span)
    pid, raddr, saddr = int(pid), int(raddr), int(saddr)

    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "shm", "hixl.shm.threads": str(a.threads)})
    src = np.random.default_rng(1).integers(0, 256, plan.span, dtype=np.uint8)
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

    def hixl_row(op: hixl.TransferOp, descs: np.ndarray, nbytes: int) -> dict[str, float]:
        return bandwidth_row(timed(lambda: e.transfer_sync(peer, op, descs, 60_000), iters), nbytes)

    def to_shared(d: np.ndarray) -> np.ndarray:
        out = d.copy()
        out[:, 1] = out[:, 1] - np.uint64(raddr) + np.uint64(saddr)
        return out

    cma = hixl._hixl._raw_cma
    rows: dict[str, dict] = {
        # What a copy through a shared mapping could do at best: memcpy, one process, one thread.
        "memcpy_1thread_big": bandwidth_row(
            timed(lambda: np.copyto(dst[:size], src[:size]), iters), size
        ),
        "raw_cma_write_big": bandwidth_row(cma(pid, True, big_w, iters), size),
        "hixl_write_big": hixl_row(W, big_w, size),
        "raw_cma_read_big": bandwidth_row(cma(pid, False, big_r, iters), size),
        "hixl_read_big": hixl_row(R, big_r, size),
        "raw_cma_write_scattered": bandwidth_row(cma(pid, True, scat, iters), nblk * blk),
        "hixl_write_scattered": hixl_row(W, scat, nblk * blk),
    }
    direct0 = e.stats()[peer]["direct_parts"]
    rows["hixl_write_big_mapped"] = hixl_row(W, to_shared(big_w), size)
    rows["hixl_read_big_mapped"] = hixl_row(R, to_shared(big_r), size)
    rows["hixl_write_scattered_mapped"] = hixl_row(W, to_shared(scat), nblk * blk)
    assert e.stats()[peer]["direct_parts"] > direct0, "the mapped path was not used"

    small = [(src.ctypes.data, raddr, 4096)]
    n_small = 2000 if a.quick else 20000
    lat = timed(lambda: e.transfer_sync(peer, W, small), n_small)
    raw_small = cma(pid, True, np.array([small[0]], np.uint64), n_small)
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
    stop_target(target)

    print(
        f"hixl {hixl.__version__} same host (CMA), {size // MIB} MiB and {nblk} x 16 KiB, "
        f"{iters} runs, hixl.shm.threads={a.threads}"
    )
    print_ratios(
        rows,
        [
            ("memcpy_1thread_big", "raw_cma_write_big"),
            ("raw_cma_write_big", None),
            ("hixl_write_big", "raw_cma_write_big"),
            ("raw_cma_read_big", None),
            ("hixl_read_big", "raw_cma_read_big"),
            ("raw_cma_write_scattered", None),
            ("hixl_write_scattered", "raw_cma_write_scattered"),
            ("hixl_write_big_mapped", "raw_cma_write_big"),
            ("hixl_read_big_mapped", "raw_cma_read_big"),
            ("hixl_write_scattered_mapped", "raw_cma_write_scattered"),
        ],
        28,
    )
    lr = rows["write_4KiB_sync_latency"]
    print(
        f"4 KiB sync WRITE from Python: median {lr['median_us']:.2f} us, p99 {lr['p99_us']:.2f} "
        f"us (raw CMA call median {lr['raw_cma_median_us']:.2f} us)"
    )
    print(f"register 128 MiB: median {rows['register_128MiB_us']['median']:.1f} us")
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
