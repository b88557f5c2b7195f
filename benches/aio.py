"""N concurrent 4 KiB WRITEs awaited from one asyncio event loop, against the same requests
submitted from a thread pool whose threads block in ``req.wait()``, in the same run.

    python benches/aio.py                 # 10,000 requests per row, 5 runs, tcp and shm
    python benches/aio.py --quick         # 2,000 requests, 3 runs
    python benches/aio.py --json out.json

Reports per row the median wall time of the whole batch, requests per second, and the
initiator's CPU seconds (user + system of this process, all threads) per 1,000 requests.
``asyncio`` awaits every request at once (``asyncio.gather``); ``threads`` runs the same
requests on a pool of --pool threads, each submitting one and waiting for it (the usual way
without asyncio). ``uvloop`` repeats the asyncio row on uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _common import parser, start_target, stop_target, write_json

import hixl

BLOCK = 4096


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", {"hixl.queue_depth": "16384"})
    buf = np.ones(size, np.uint8)
    e.register(buf)
    print(f"READY {e.local_engine} {buf.ctypes.data}", flush=True)
    sys.stdin.read()
    e.finalize()


def measure(run: object, n: int, iters: int) -> dict[str, float]:
    """Median wall seconds and CPU seconds of `iters` calls of run() (after one warm-up)."""
    assert callable(run)
    run()
    walls, cpus = [], []
    for _ in range(iters):
        c0, t0 = time.process_time(), time.perf_counter()
        run()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return {"wall_s": wall, "req_per_s": n / wall, "cpu_ms_per_1k": cpu / n * 1e6}


def bench_backend(
    backend: str, peer: str, raddr: int, n: int, iters: int, pool_threads: int
) -> dict[str, dict[str, float]]:
    """The asyncio, uvloop and thread-pool rows of one backend."""
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backend, "hixl.queue_depth": "16384"})
    src = np.random.default_rng(1).integers(0, 256, n * BLOCK, dtype=np.uint8)
    e.register(src)
    e.connect(peer, timeout_ms=5000)
    addrs = [(src.ctypes.data + i * BLOCK, raddr + i * BLOCK) for i in range(n)]
    rows: dict[str, dict[str, float]] = {}

    async def awaited() -> None:
        await asyncio.gather(*(e.put_async(peer, s, d, BLOCK) for s, d in addrs))

    def one(pair: tuple[int, int]) -> None:
        e.put_async(peer, pair[0], pair[1], BLOCK).wait()

    rows[f"{backend} asyncio"] = measure(lambda: asyncio.run(awaited()), n, iters)
    try:
        import uvloop

        rows[f"{backend} uvloop"] = measure(lambda: uvloop.run(awaited()), n, iters)
    except ImportError:
        pass
    with ThreadPoolExecutor(pool_threads) as pool:
        rows[f"{backend} threads x{pool_threads}"] = measure(
            lambda: list(pool.map(one, addrs)), n, iters
        )
    e.finalize()
    return rows


def main() -> None:
    ap = parser(__doc__, "2,000 requests, 3 runs")
    ap.add_argument("--requests", type=int, default=None, help="requests per batch (10,000)")
    ap.add_argument("--pool", type=int, default=32, help="threads of the thread-pool row")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    n = a.requests or (2000 if a.quick else 10000)
    iters = a.iters or (3 if a.quick else 5)
    span = -(-n * BLOCK // (2 << 20)) * (2 << 20)
    target, (peer, raddr) = start_target(__file__, span)
    raddr = int(raddr)
    rows: dict[str, dict[str, float]] = {}
    try:
        for backend in ("tcp", "shm"):
            rows.update(bench_backend(backend, peer, raddr, n, iters, a.pool))
    finally:
        stop_target(target)
    print(f"{n} concurrent {BLOCK}-byte WRITEs per batch, median of {iters} batches")
    print(f"{'row':18} {'wall ms':>9} {'req/s':>10} {'cpu ms/1k req':>14}")
    for name, r in rows.items():
        wall, rate, cpu = r["wall_s"] * 1e3, r["req_per_s"], r["cpu_ms_per_1k"]
        print(f"{name:18} {wall:9.1f} {rate:10.0f} {cpu:14.1f}")
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
