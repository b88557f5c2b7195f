"""hixl.mooncake (Mooncake's TransferEngine API on hixl) vs hixl's own API, and vs the real
Mooncake transfer engine.

    python benches/mooncake_compat.py                          # hixl's API vs hixl.mooncake
    python benches/mooncake_compat.py --mooncake-python /path/to/venv-mooncake/bin/python

Two processes on this host for each column: a target engine holding the remote pages and the
measuring initiator. Rows (medians of --iters samples, default 15):
  pages   8192 x 16 KiB scattered pages WRITE in one batch (Mooncake:
          batch_transfer_sync_write from three lists; hixl: transfer_sync of an (N, 3) array)
  4k      one 4 KiB WRITE (Mooncake: transfer_sync_write; hixl: put); each sample is the mean
          of --small-calls calls
Columns: hixl's API and hixl.mooncake over tcp and auto (hixl's backends; "auto" through
HIXL_MOONCAKE_BACKENDS, since Mooncake has no such protocol), measured in one process on the
same engine and link with their samples interleaved, so that they differ only by the API
layer; and with --mooncake-python the real Mooncake TE over tcp (its per-peer queue raised through
MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, which rejects a batch of 8192 otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

PAGE = 16 * 1024
PAGES = 8192
SMALL = 4096
#: The real Mooncake's TCP transport queues far fewer transfers per peer by default than a
#: batch of 8192 pages: its column runs with MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER this high.
MC_QUEUE = str(4 * PAGES)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _buffer(n: int) -> tuple[Any, int]:
    buf = ctypes.create_string_buffer(n)
    return buf, ctypes.addressof(buf)


def _mooncake(impl: str) -> Any:
    if impl != "real":
        from hixl.mooncake import TransferEngine
    else:
        from mooncake.engine import TransferEngine  # the real package
    return TransferEngine


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise SystemExit(f"{call} returned {rc}")


def serve(impl: str, protocol: str) -> None:
    """The target: registers PAGES pages and prints ``READY <session> <addr>``."""
    span = PAGES * PAGE
    buf, addr = _buffer(span)
    te = _mooncake(impl)()
    _check(te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, ""), "initialize")
    _check(te.register_memory(addr, span), "register_memory")
    session = f"127.0.0.1:{te.get_rpc_port()}"
    print(f"READY {session} {addr}", flush=True)
    sys.stdin.read()
    del buf


def _interleaved(fns: dict[str, Any], iters: int, calls: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, sampled in turn (A, B, A, B, ...) so that
    a load change on this host hits them alike; one untimed warm-up call each first."""
    for k, fn in fns.items():
        if fn():
            raise SystemExit(f"{k}: the warm-up call returned an error code")
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            bad = 0
            for _ in range(calls):
                if fn():
                    bad += 1
            out[k].append((time.perf_counter() - t0) / calls)
            if bad:
                raise SystemExit(f"{k}: {bad} of {calls} calls returned an error code")
    return {k: statistics.median(v) for k, v in out.items()}


def measure(impl: str, protocol: str, iters: int, small_calls: int) -> dict[str, dict[str, float]]:
    """The columns of one target: for ``impl`` "hixl" hixl.mooncake's calls and hixl's own
    on the same engine and link (the face's ``engine``), so the two differ only by the API
    layer; for "real" the real Mooncake's. Medians as GB/s and us."""
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", "real" if impl == "real" else "face", protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert target.stdout is not None
        line = ""
        while not line.startswith("READY "):  # Mooncake may log to stdout too
            line = target.stdout.readline()
            if not line:
                raise SystemExit(f"target {impl}/{protocol} died")
        _, session, raddr_s = line.split()
        raddr = int(raddr_s)
        span = PAGES * PAGE
        buf, laddr = _buffer(span)
        ctypes.memset(laddr, 0x5A, span)
        rng = random.Random(38)
        lpages, rpages = list(range(PAGES)), list(range(PAGES))
        rng.shuffle(lpages)
        rng.shuffle(rpages)
        bufs = [laddr + p * PAGE for p in lpages]
        peers = [raddr + p * PAGE for p in rpages]
        lens = [PAGE] * PAGES
        te = _mooncake(impl)()
        _check(te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, ""), "initialize")
        _check(te.register_memory(laddr, span), "register_memory")
        # Each timed call is one lambda around the call measured; the sampler checks what it
        # returned (0 or None) with the same few instructions for every column.
        pages = {"face": lambda: te.batch_transfer_sync_write(session, bufs, peers, lens)}
        small = {"face": lambda: te.transfer_sync_write(session, laddr, raddr, SMALL)}
        if impl != "real":
            import numpy as np

            e = te.engine
            descs = np.array([bufs, peers, lens], np.uint64).T.copy()
            pages["api"] = lambda: e.transfer_sync(session, "WRITE", descs)
            small["api"] = lambda: e.put(session, laddr, raddr, SMALL)
        t_pages = _interleaved(pages, iters)
        t_small = _interleaved(small, iters, small_calls)
        del buf
        return {
            k: {"pages_gbps": span / t_pages[k] / 1e9, "small_us": t_small[k] * 1e6} for k in pages
        }
    finally:
        if target.stdin:
            target.stdin.close()
        target.wait(timeout=30)


#: (title prefix, impl, protocol) of each measuring process.
RUNS = [("hixl", "hixl", "tcp"), ("hixl", "hixl", "auto")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", nargs=2, metavar=("IMPL", "PROTOCOL"), help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=2, metavar=("IMPL", "PROTOCOL"), help=argparse.SUPPRESS)
    ap.add_argument("--mooncake-python", help="a python with mooncake-transfer-engine installed")
    ap.add_argument("--iters", type=int, default=15, help="samples per row (default 15)")
    ap.add_argument("--small-calls", type=int, default=200, help="4 KiB calls per sample")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = ap.parse_args()
    if a.serve:
        serve(*a.serve)
        return
    if a.measure:
        print(json.dumps(measure(*a.measure, a.iters, a.small_calls)), flush=True)
        return
    runs = list(RUNS)
    if a.mooncake_python:
        runs.insert(0, ("Mooncake TE", "real", "tcp"))
    results: dict[str, dict[str, float]] = {}
    for title, impl, proto in runs:
        python = a.mooncake_python if impl == "real" else sys.executable
        env = dict(os.environ, MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER=MC_QUEUE)
        env["HIXL_MOONCAKE_BACKENDS"] = proto  # "auto" is hixl's name, not Mooncake's
        cmd = [python, __file__, "--measure", impl, proto, "--iters", str(a.iters)]
        cmd += ["--small-calls", str(a.small_calls)]
        log(f"measuring {title} {proto} ...")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{title} {proto} failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        if impl == "real":
            results[f"Mooncake TE {proto}"] = got["face"]
        else:
            results[f"hixl API {proto}"] = got["api"]
            results[f"hixl.mooncake {proto}"] = got["face"]
    print(f"{'':22}{'8192 x 16 KiB GB/s':>20}{'4 KiB write us':>16}")
    for title, r in results.items():
        print(f"{title:22}{r['pages_gbps']:>20.2f}{r['small_us']:>16.1f}")
    for proto in ("tcp", "auto"):
        n, f = results[f"hixl API {proto}"], results[f"hixl.mooncake {proto}"]
        print(
            f"face/API {proto}: pages {f['pages_gbps'] / n['pages_gbps']:.0%} of the throughput, "
            f"4 KiB {f['small_us'] / n['small_us']:.0%} of the time"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
