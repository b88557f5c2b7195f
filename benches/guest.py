"""hixl as a guest in a busy, pinned process: two processes (an initiator and a target) whose
main threads pin themselves to one shared core after `initialize` (as vLLM's worker does) and
run a busy thread that holds the GIL; the initiator makes N WRITEs of 160 KiB. Pinned and
unpinned; figures: p50/p99/max latency and failures.

    python benches/guest.py            # 1,000 transfers per mode
    python benches/guest.py --quick    # about 100 (a smoke run)

Run it on a quiet machine (and, for the loaded figures, beside two CPU-bound processes such as
`python -c 'while True: pass'`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

import hixl

SIZE = 160 << 10


def spin() -> None:
    n = 0
    while True:
        n += 1


def settle(pin: int | None) -> None:
    """What the host does after initialize: pins its main thread, starts a GIL-holding loop."""
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    threading.Thread(target=spin, daemon=True).start()


def target(pin: int | None) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
    buf = np.zeros(SIZE, np.uint8)
    e.register(buf)
    settle(pin)
    print(f"{e.local_engine} {buf.ctypes.data}", flush=True)
    sys.stdin.readline()
    e.finalize()


def initiator(pin: int | None, n: int) -> tuple[list[float], int]:
    cmd = [sys.executable, __file__, "--target", "" if pin is None else str(pin)]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdin is not None
        engine, addr = peer.stdout.readline().split()
        e = hixl.Hixl()
        e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        src = np.ones(SIZE, np.uint8)
        e.register(src)
        e.connect(engine, timeout_ms=10_000)
        settle(pin)
        lat, failures = [], 0
        for _ in range(n):
            t0 = time.perf_counter()
            try:
                e.transfer_sync(
                    engine, hixl.TransferOp.WRITE, [(src.ctypes.data, int(addr), SIZE)], 30_000
                )
            except hixl.HixlError:
                failures += 1
            lat.append(time.perf_counter() - t0)
        e.finalize()
        peer.stdin.write("\n")
        peer.stdin.flush()
        return lat, failures
    finally:
        peer.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 100 transfers per mode")
    ap.add_argument("-n", type=int, default=None, help="transfers per mode (default 1000)")
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target is not None:
        target(int(a.target) if a.target else None)
        return
    n = a.n or (100 if a.quick else 1000)
    core = max(os.sched_getaffinity(0))
    print(f"{n} WRITEs of 160 KiB per mode; pinned: both main threads on CPU {core}")
    print(f"{'mode':<10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}{'failures':>10}")
    for mode, pin in (("unpinned", None), ("pinned", core)):
        lat, failures = initiator(pin, n)
        ms = np.array(lat) * 1000
        p50, p99 = np.percentile(ms, 50), np.percentile(ms, 99)
        print(f"{mode:<10}{p50:>10.3f}{p99:>10.3f}{ms.max():>10.3f}{failures:>10}")


if __name__ == "__main__":
    main()
