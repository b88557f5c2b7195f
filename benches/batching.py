"""Batching, strided descriptors and coalescing vs. the naive way, measured in the same run.

    python benches/batching.py                 # both transports
    python benches/batching.py --quick --transport tcp

Rows (each a ratio of the naive time to hixl's):
  batch     1024 x 4 KiB as one batched call vs 1024 separate sync calls
  strided   32 layers x 8 heads of 16 KiB elements: 32 strided calls vs 256 per-head calls
  coalesce  10,000 async 4 KiB requests from two Python threads, coalescing on vs off (TCP)
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
from _common import parser, start_target, stop_target, timed, write_json

import hixl

W = hixl.TransferOp.WRITE
ELEM = 16 * 1024
PAD = 4 * 1024  # per-element padding, so that nothing merges


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = hixl.aligned_empty(size)
    buf[:] = 1
    e.register(buf)
    print(f"READY {e.local_engine} {buf.ctypes.data}", flush=True)
    sys.stdin.read()
    e.finalize()


def run(transport: str, peer: str, raddr: int, iters: int, n_async: int, rows: dict) -> None:
    opts = {"hixl.backends": transport}
    e = hixl.Hixl()
    e.initialize("127.0.0.1", opts)
    src = hixl.aligned_empty(32 << 20)
    src[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    e.register(src)
    e.connect(peer, timeout_ms=5000)
    a = src.ctypes.data

    # 1024 x 4 KiB, scattered on both sides (every other 4 KiB), one call vs 1024 calls.
    idx = np.arange(1024, dtype=np.uint64) * 8192
    batch = np.stack([a + idx, raddr + idx, np.full(1024, 4096, np.uint64)], axis=1)
    one = timed(lambda: e.transfer_sync(peer, W, batch, 30_000), iters)

    def loop() -> None:
        for la, ra, n in batch:
            e.transfer_sync(peer, W, [(int(la), int(ra), int(n))], 30_000)

    many = timed(loop, iters)
    rows[f"{transport}_batch_1024x4KiB"] = {
        "one_call_ms": statistics.median(one) * 1e3,
        "separate_calls_ms": statistics.median(many) * 1e3,
        "speedup": statistics.median(many) / statistics.median(one),
    }

    # 32 layers x 8 heads of 16 KiB (+4 KiB padding): per layer one strided call vs per head.
    stride = ELEM + PAD
    layer = 8 * stride

    def per_layer() -> None:
        d = hixl.StridedDesc(8, ELEM, stride)
        for i in range(32):
            e.put_strided(peer, a + i * layer, raddr + i * layer, d, 30_000)

    def per_head() -> None:
        for i in range(32):
            for h in range(8):
                off = i * layer + h * stride
                e.put(peer, a + off, raddr + off, ELEM, 30_000)

    s = timed(per_layer, iters)
    h = timed(per_head, iters)
    rows[f"{transport}_kv_32x8x16KiB"] = {
        "strided_ms": statistics.median(s) * 1e3,
        "per_head_ms": statistics.median(h) * 1e3,
        "speedup": statistics.median(h) / statistics.median(s),
    }
    e.finalize()

    if transport != "tcp":
        return
    # Coalescing on vs off: two Python threads each submit n_async/2 async 4 KiB requests.
    for label, extra in [("off", {}), ("on", {"hixl.tcp.coalesce_us": "50"})]:
        e = hixl.Hixl()
        e.initialize("127.0.0.1", {**opts, **extra})
        e.register(src)
        e.connect(peer, timeout_ms=5000)
        per = n_async // 2

        def submit(t: int, e: hixl.Hixl = e, per: int = per) -> None:
            reqs = []
            for i in range(per):
                off = ((t * per + i) % 4096) * 8192
                reqs.append(e.put_async(peer, a + off, raddr + off, 4096))
            for r in reqs:
                assert r.wait(30_000) == hixl.TransferStatus.COMPLETED

        t0 = time.perf_counter()
        ts = [threading.Thread(target=submit, args=(t,)) for t in (0, 1)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        secs = time.perf_counter() - t0
        rows[f"tcp_coalesce_{label}"] = {"seconds": secs, "requests_per_s": n_async / secs}
        e.finalize()
    on, off = rows["tcp_coalesce_on"], rows["tcp_coalesce_off"]
    on["speedup_vs_off"] = on["requests_per_s"] / off["requests_per_s"]


def main() -> None:
    ap = parser(__doc__, "fewer runs and requests")
    ap.add_argument("--transport", choices=["tcp", "shm", "both"], default="both")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    iters = a.iters or (3 if a.quick else 10)
    n_async = 2000 if a.quick else 10_000
    target, (peer, raddr) = start_target(__file__, 40 << 20)
    rows: dict[str, dict] = {}
    for t in ["tcp", "shm"] if a.transport == "both" else [a.transport]:
        run(t, peer, int(raddr), iters, n_async, rows)
    stop_target(target)
    print(f"hixl {hixl.__version__} batching benchmark, median of {iters} runs")
    for name, r in rows.items():
        print(f"{name:26} " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
