"""Bounded soak: 8 initiator processes x 2 threads, mixed READ/WRITE batches to one target
over both transports (half the processes each), every byte verified, engines replaced every
few seconds. The target's RSS and open file descriptors must stay flat.

    pytest tests/test_soak.py --soak-seconds 600 -s     # the long run, by hand
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SLICE = 1 << 20
PROCS = 8
THREADS = 2


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_soak(make_peer, soak_seconds: float) -> None:
    peer = make_peer(PROCS * THREADS * SLICE)
    script = Path(__file__).with_name("_soak_initiator.py")

    def start(seconds: float) -> list[subprocess.Popen[str]]:
        return [
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    peer.engine,
                    str(peer.addr),
                    str(SLICE),
                    str(i * THREADS),
                    "shm" if i % 2 else "tcp",
                    str(seconds),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(PROCS)
        ]

    # A short warm-up round first, so that the first sample is taken at steady state.
    for p in start(1.0):
        p.communicate(timeout=120)
    first = (rss_kib(peer.proc.pid), fds(peer.proc.pid))
    t0 = time.monotonic()
    procs = start(soak_seconds)
    samples = [first]
    while any(p.poll() is None for p in procs):
        time.sleep(min(2.0, soak_seconds / 5))
        samples.append((rss_kib(peer.proc.pid), fds(peer.proc.pid)))
    took = time.monotonic() - t0
    results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    time.sleep(0.5)  # let the target close the last engines' streams
    last = (rss_kib(peer.proc.pid), fds(peer.proc.pid))
    ops = sum(r["ops"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    errors = [e for r in results for e in r["errors"]]
    report = {
        "seconds": round(took, 1),
        "processes": PROCS,
        "threads": THREADS,
        "ops": ops,
        "bytes": nbytes,
        "engines": sum(r["engines"] for r in results),
        "errors": len(errors),
        "target_rss_kib_first_last": [first[0], last[0]],
        "target_rss_kib_max": max(s[0] for s in samples),
        "target_fds_first_last": [first[1], last[1]],
    }
    print("soak:", json.dumps(report))
    assert not errors, errors[:5]
    assert ops >= PROCS * THREADS * 2
    assert all(p.returncode == 0 for p in procs)
    # Flat: the target's memory does not grow with the run (allow allocator noise).
    assert last[0] <= first[0] * 1.15 + 16 * 1024, report
    assert last[1] <= first[1] + 2, report
