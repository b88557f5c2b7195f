"""Mid-size blocks (the sizes of paged-KV blocks) on the same host: hixl WRITE and READ from
Python with 1 and 4 requests in flight, each beside two baselines measured in the same run.

    python benches/blocks.py                       # 4 KiB to 1 MiB, 5 rounds
    python benches/blocks.py --sizes 16K,256K --rounds 3 --json out.json

- hixl: `transfer_sync` one block at a time (depth 1), 4 `transfer_async` then 4 `wait`
  (depth 4), or one `transfer_sync` of 4 blocks (batch 4: one call, one request, what a caller
  that has several blocks ready pays), with `hixl.backends=shm`.
- rust pvw: one `process_vm_writev`/`readv` per block in a Rust loop (`hixl._hixl._raw_cma`),
  the floor for one system call per block (timed call by call in Rust, one block);
- ctypes pvw: the same call made from Python through ctypes, what a Python program that copies
  one block per call pays.

Every call of every variant moves the same block (offset 0 of both buffers), so that all of
them find it equally warm in cache and the rows compare per-request costs, not cache misses.
Rounds alternate the three, so that the machine's drift hits all of them alike. Each row is
the median over rounds of GB/s (decimal); the ratios are hixl's over each baseline's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from _common import start_json_target  # noqa: E402

import hixl  # noqa: E402
from hixl import _hixl  # noqa: E402

WINDOW = 32 << 20
W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ


def serve() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = np.ones(WINDOW, np.uint8)
    e.register(buf)
    print(
        json.dumps({"engine": e.local_engine, "addr": buf.ctypes.data, "pid": os.getpid()}),
        flush=True,
    )
    sys.stdin.read()
    e.finalize()


def size_arg(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1:], 1)
    return int(s.rstrip("KM")) * mult


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="4K,16K,64K,256K,1M", help="block sizes (K, M suffixes)")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per row")
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per row and round")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    target, info = start_json_target(__file__)
    assert target.stdin is not None
    peer, raddr, pid = info["engine"], info["addr"], info["pid"]
    src = np.random.default_rng(1).integers(0, 256, WINDOW, dtype=np.uint8)
    e = hixl.Hixl()
    e.initialize(
        "127.0.0.1", {"hixl.backends": "shm", **json.loads(os.environ.get("HIXL_BENCH_OPTS", "{}"))}
    )
    e.register(src)
    e.connect(peer, timeout_ms=10_000)
    libc = ctypes.CDLL(None, use_errno=True)
    pvw, pvr = libc.process_vm_writev, libc.process_vm_readv
    pvw.argtypes = pvr.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    pvw.restype = pvr.restype = ctypes.c_ssize_t
    base = src.ctypes.data
    rows: dict[str, dict] = {}
    try:
        for size in [size_arg(s) for s in a.sizes.split(",")]:
            n = max(64, (a.mib << 20) // size)
            offs = [0] * n
            descs = [[(base + o, raddr + o, size)] for o in offs]
            quads = [[(base, raddr, size)] * 4 for _ in range(0, n, 4)]
            arr = np.array([(base, raddr, size)], np.uint64)
            iovs = [(Iovec(base + o, size), Iovec(raddr + o, size)) for o in offs]
            refs = [(ctypes.byref(lo), ctypes.byref(ro)) for lo, ro in iovs]
            for op, raw_fn, name in ((W, pvw, "write"), (R, pvr, "read")):
                samples: dict[str, list[float]] = {
                    k: []
                    for k in ("hixl_depth1", "hixl_depth4", "hixl_batch4", "rust_pvw", "ctypes_pvw")
                }

                def depth1() -> None:
                    for d in descs:  # noqa: B023
                        e.transfer_sync(peer, op, d)  # noqa: B023

                def depth4() -> None:
                    for i in range(0, n, 4):  # noqa: B023
                        reqs = [e.transfer_async(peer, op, d) for d in descs[i : i + 4]]  # noqa: B023
                        for q in reqs:
                            q.wait()
                            q.result()

                def batch4() -> None:
                    for d in quads:  # noqa: B023
                        e.transfer_sync(peer, op, d)  # noqa: B023

                def ctypes_loop() -> None:
                    for lp, rp in refs:  # noqa: B023
                        if raw_fn(pid, lp, 1, rp, 1, 0) != size:  # noqa: B023
                            raise OSError(ctypes.get_errno(), "process_vm_writev/readv")

                loops = {
                    "hixl_depth1": depth1,
                    "hixl_depth4": depth4,
                    "hixl_batch4": batch4,
                    "ctypes_pvw": ctypes_loop,
                }
                for k in loops:
                    loops[k]()  # warm-up
                for _ in range(a.rounds):
                    for k, f in loops.items():
                        t0 = time.perf_counter()
                        f()
                        samples[k].append(time.perf_counter() - t0)
                    # Per-call timings from Rust, summed over the same number of blocks.
                    per_call = _hixl._raw_cma(pid, op == W, arr, n)
                    samples["rust_pvw"].append(sum(per_call))
                gbps = {k: n * size / statistics.median(v) / 1e9 for k, v in samples.items()}
                for k, v in gbps.items():
                    rows[f"{name}_{size}_{k}"] = {"GBps": v}
                rows[f"{name}_{size}_ratios"] = {
                    f"{h}_x_{b}": gbps[h] / gbps[b]
                    for h in ("hixl_depth1", "hixl_depth4", "hixl_batch4")
                    for b in ("rust_pvw", "ctypes_pvw")
                }
                g = {k: f"{v:6.2f}" for k, v in gbps.items()}
                x = rows[f"{name}_{size}_ratios"]
                print(
                    f"{name:5s} {size >> 10:5d} KiB  GB/s: depth1 {g['hixl_depth1']} "
                    f"depth4 {g['hixl_depth4']} batch4 {g['hixl_batch4']} rust pvw "
                    f"{g['rust_pvw']} ctypes pvw {g['ctypes_pvw']}  x rust: "
                    f"{x['hixl_depth1_x_rust_pvw']:.2f} / {x['hixl_depth4_x_rust_pvw']:.2f} / "
                    f"{x['hixl_batch4_x_rust_pvw']:.2f}  x ctypes: "
                    f"{x['hixl_depth1_x_ctypes_pvw']:.2f} / {x['hixl_depth4_x_ctypes_pvw']:.2f} / "
                    f"{x['hixl_batch4_x_ctypes_pvw']:.2f}",
                    flush=True,
                )
    finally:
        e.finalize()
        target.stdin.close()
        target.wait(30)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
