"""How long one prompt rank takes to link to N decoder ranks through the KV layer (loopback).

    python benches/kv_link.py                    # 8 decoders, 20 runs
    python benches/kv_link.py --decoders 8 --iters 50 --option hixl.backends=tcp --json out.json

Starts N decoder processes (hixl.kv.init, role "decoder", each listening on 127.0.0.1), then
this process calls hixl.kv.init(role="prompt") and times hixl.kv.link(all N ranks) -- connect,
find and read each rank's directory, check its role; the links go in parallel -- and then
hixl.kv.unlink(all N), --iters times. For comparison it also times the same links made one
after the other (one hixl.kv.link call per rank). Target: all N=8 linked in <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import parser

import hixl
from hixl.kv._context import context


def serve(rank: int, options: dict[str, str]) -> None:
    hixl.kv.init(cluster_id=rank, role="decoder", listen="127.0.0.1:0", peers={}, options=options)
    print(f"READY {context().address}", flush=True)
    sys.stdin.read()  # until the parent closes it
    hixl.kv.finalize()


def summary(secs: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in secs)
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
        "max_ms": ms[-1],
    }


def main() -> None:
    ap = parser(__doc__, "3 decoders, 5 runs")
    ap.add_argument("--serve-decoder", help=argparse.SUPPRESS)
    ap.add_argument("--decoders", type=int, default=None, help="decoder ranks (default 8)")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for every rank (repeatable), e.g. hixl.backends=tcp",
    )
    a = ap.parse_args()
    options = dict(o.split("=", 1) for o in a.option)
    if a.serve_decoder:
        return serve(int(a.serve_decoder), options)
    n = a.decoders or (3 if a.quick else 8)
    iters = a.iters or (5 if a.quick else 20)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [f"--option={o}" for o in a.option]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve-decoder", str(r), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(1, n + 1)
    ]
    try:
        addrs = {}
        for r, p in enumerate(procs, 1):
            assert p.stdout is not None
            tag, addr = p.stdout.readline().split()
            assert tag == "READY"
            addrs[r] = addr
        hixl.kv.init(cluster_id=0, role="prompt", listen="127.0.0.1:0", options=options)
        infos = [{"cluster_id": r, "address": addr} for r, addr in addrs.items()]
        ranks = list(addrs)

        def parallel() -> float:
            t0 = time.perf_counter()
            hixl.kv.link(infos)
            dt = time.perf_counter() - t0
            assert sorted(context().peers) == ranks
            hixl.kv.unlink(ranks)
            return dt

        def serial() -> float:
            t0 = time.perf_counter()
            for info in infos:
                hixl.kv.link([info])
            dt = time.perf_counter() - t0
            assert sorted(context().peers) == ranks
            hixl.kv.unlink(ranks)
            return dt

        backend = ""
        hixl.kv.link(infos)  # warm-up, and the backend actually used
        backend = context().engine.stats()[addrs[1]]["backend"]
        hixl.kv.unlink(ranks)
        rows = {
            "parallel": summary([parallel() for _ in range(iters)]),
            "one_by_one": summary([serial() for _ in range(iters)]),
        }
    finally:
        hixl.kv.finalize()
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(30)
    print(f"link 1 prompt rank to {n} decoder ranks, loopback, backend {backend}, {iters} runs")
    for name, r in rows.items():
        print(
            f"  {name:<11} median {r['median_ms']:6.1f} ms   min {r['min_ms']:6.1f}   "
            f"p90 {r['p90_ms']:6.1f}   max {r['max_ms']:6.1f}"
            + ("   (target <= 50 ms for 8)" if name == "parallel" else "")
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"decoders": n, "backend": backend, "iters": iters, **rows}, f, indent=2)


if __name__ == "__main__":
    main()
