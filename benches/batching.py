"""Batching, strided descriptors and coalescing vs. the naive way, measured in the same run.

    python benches/batching.py                 # both transports
    python benches/batching.py --quick --transport tcp

Rows (each a ratio of the naive time to hixl's):
  batch     1024 x 4 KiB as one batched call vs 1024 separate sync calls
  strided   32 layers x 8 heads of 16 KiB, 4 KiB and 1 KiB elements: 32 strided calls vs 256
            per-head calls; over shm into registered memory (cross-memory attach) and into
            engine-allocated memory (copied through a mapping)
  coalesce  10,000 async 4 KiB requests from two Python threads, coalescing on vs off (TCP)

The strided rows give each call's time, and over shm into registered memory also the copy
alone, measured in the same run (raw process_vm_writev of all 256 elements in one call, timed
in Rust), and the time per call beyond it: what a call costs on top of moving its bytes.
Striding can only remove per-call costs, so the speedup approaches 8x only where the copy does
not dominate: small elements, and engine-allocated memory, which a same-host peer copies with
memcpy and no system call.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import numpy as np
from _common import parser, start_target, stop_target, timed, write_json

import hixl
from hixl import _hixl

W = hixl.TransferOp.WRITE
PAD = 4 * 1024  # per-element padding, so that nothing merges
LAYERS, HEADS = 32, 8
KV_ELEMS = (16 * 1024, 4 * 1024, 1024)
KV_SPAN = LAYERS * HEADS * (KV_ELEMS[0] + PAD)


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = hixl.aligned_empty(size)
    buf[:] = 1
    e.register(buf)
    shared = e.alloc(KV_SPAN)  # engine-allocated: a same-host peer copies through a mapping
    print(
        f"READY {e.local_engine} {buf.ctypes.data} {shared.ctypes.data} {os.getpid()}", flush=True
    )
    sys.stdin.read()
    e.finalize()


def kv_row(
    e: hixl.Hixl,
    peer: str,
    a: int,
    base: int,
    elem: int,
    iters: int,
    rows: dict,
    label: str,
    pid: int,
) -> None:
    """32 layers x 8 heads of `elem` bytes (+4 KiB padding): per layer one strided call vs
    one call per head, and the copy alone."""
    stride = elem + PAD
    layer = HEADS * stride

    def per_layer() -> None:
        d = hixl.StridedDesc(HEADS, elem, stride)
        for i in range(LAYERS):
            e.put_strided(peer, a + i * layer, base + i * layer, d, 30_000)

    def per_head() -> None:
        for i in range(LAYERS):
            for h in range(HEADS):
                off = i * layer + h * stride
                e.put(peer, a + off, base + off, elem, 30_000)

    s = statistics.median(timed(per_layer, iters))
    h = statistics.median(timed(per_head, iters))
    row = {
        "strided_ms": s * 1e3,
        "per_head_ms": h * 1e3,
        "speedup": h / s,
        "strided_us_per_call": s / LAYERS * 1e6,
        "per_head_us_per_call": h / (LAYERS * HEADS) * 1e6,
    }
    if label == "shm":
        # All 256 elements in one process_vm_writev, timed in Rust: the same memory as the
        # calls walk, with one system call instead of 32 or 256.
        offs = (
            np.arange(LAYERS, dtype=np.uint64)[:, None] * layer
            + np.arange(HEADS, dtype=np.uint64) * stride
        )
        offs = offs.reshape(-1)
        arr = np.stack([a + offs, base + offs, np.full(offs.size, elem, np.uint64)], axis=1)
        copy = statistics.median(_hixl._raw_cma(pid, True, arr, 10 * iters))
        row["copy_ms"] = copy * 1e3
        row["strided_us_per_call_beyond_copy"] = (s - copy) / LAYERS * 1e6
        row["per_head_us_per_call_beyond_copy"] = (h - copy) / (LAYERS * HEADS) * 1e6
    rows[f"{label}_kv_{LAYERS}x{HEADS}x{elem // 1024}KiB"] = row


def run(
    transport: str,
    peer: str,
    raddr: int,
    shared: int,
    pid: int,
    iters: int,
    n_async: int,
    rows: dict,
) -> None:
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

    targets = [("registered", raddr)]
    if transport == "shm":
        targets.append(("alloc", shared))
    for mem, base in targets:
        for elem in KV_ELEMS:
            kv_row(
                e,
                peer,
                a,
                base,
                elem,
                iters,
                rows,
                f"{transport}_{mem}" if mem == "alloc" else transport,
                pid,
            )
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
    target, (peer, raddr, shared, pid) = start_target(__file__, 40 << 20)
    rows: dict[str, dict] = {}
    for t in ["tcp", "shm"] if a.transport == "both" else [a.transport]:
        run(t, peer, int(raddr), int(shared), int(pid), iters, n_async, rows)
    stop_target(target)
    print(f"hixl {hixl.__version__} batching benchmark, median of {iters} runs")
    for name, r in rows.items():
        print(f"{name:26} " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
