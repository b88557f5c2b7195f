"""Synchronous 4 KiB same-host WRITE against the bare `process_vm_writev` call, paired across
builds of hixl: the latency figure of docs/PERFORMANCE.md.

    python scripts/paired_4k.py --sittings 3 \\
        --variant old=/work/wt-old/python --variant new=python

Each variant is a PYTHONPATH whose `import hixl` is the build to measure. A sitting runs every
variant once, in turn (old new, then new old in the next sitting, so that neither always goes
first); a run is a fresh initiator process and a target process of the same build. In a run the
initiator calls `Hixl.put`, `Hixl.transfer_sync` with one `(local, remote, 4096)` triple, and
`process_vm_writev` of the same 4 KiB through ctypes (the raw call), each `--n` times after a
warm-up, in blocks of 500 calls that take turns (put, sync, raw, put, ...); a block is timed
whole, and a run reports per kind the median over its blocks of the mean microseconds per call. The
report: per variant, the median over the sittings of those medians and of each run's
hixl / raw ratio.

    python scripts/paired_4k.py --run --n 20000 --only put    # one initiator run, for profiling

`--run` makes one run of the `hixl` on this PYTHONPATH and prints its JSON line; `--only put`
(or `sync`, `raw`) times one call alone, which is what an instruction count under
`valgrind --tool=callgrind` wants (see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KIB4 = 4096
#: Calls per timed block.
BLOCK = 500
CALLS = ("put", "sync", "raw")


def serve() -> None:
    """The target: an engine with one registered, touched 1 MiB buffer."""
    import numpy as np

    import hixl

    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = np.ones(1 << 20, np.uint8)
    e.register(buf)
    print(json.dumps([e.local_engine, buf.ctypes.data, os.getpid()]), flush=True)
    sys.stdin.read()
    e.finalize()


def raw_writev(pid: int, local: int, remote: int):
    """A no-argument callable: one `process_vm_writev` of 4 KiB, as ctypes calls it."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    loc, rem = Iovec(local, KIB4), Iovec(remote, KIB4)
    lp, rp = ctypes.byref(loc), ctypes.byref(rem)
    pvw = libc.process_vm_writev
    pvw.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong]
    pvw.argtypes.append(ctypes.c_ulong)  # flags
    pvw.restype = ctypes.c_ssize_t

    def call() -> None:
        if pvw(pid, lp, 1, rp, 1, 0) != KIB4:
            raise OSError(ctypes.get_errno(), "process_vm_writev")

    return call


def one_run(n: int, only: str | None) -> dict:
    """Starts a target, connects over `shm`, times the calls; returns median us per call."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy as np

    import hixl

    target = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert target.stdin is not None and target.stdout is not None
    try:
        peer, raddr, pid = json.loads(target.stdout.readline())
        e = hixl.Hixl()
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        e.register(src)
        e.connect(peer, timeout_ms=10_000)
        assert e.stats()[peer]["backend"] == "shm", e.stats()[peer]
        laddr = src.ctypes.data
        d = [(laddr, raddr, KIB4)]
        W = hixl.TransferOp.WRITE
        fns = {
            "put": lambda: e.put(peer, laddr, raddr, KIB4),
            "sync": lambda: e.transfer_sync(peer, W, d),
            "raw": raw_writev(pid, laddr, raddr),
        }
        if only:
            fns = {only: fns[only]}
        for f in fns.values():  # warm-up
            for _ in range(min(n, 500)):
                f()
        # Blocks of BLOCK calls, the kinds taking turns block by block; a block is timed whole
        # (no clock read per call) and counts as its mean.
        blocks: dict[str, list[float]] = {k: [] for k in fns}
        pc = time.perf_counter
        for _ in range(max(1, n // BLOCK)):
            for k, f in fns.items():
                t0 = pc()
                for _ in range(BLOCK):
                    f()
                blocks[k].append((pc() - t0) / BLOCK)
        e.finalize()
    finally:
        target.stdin.close()
        target.wait(30)
    out = {k: statistics.median(v) * 1e6 for k, v in blocks.items()}
    if "raw" in out:
        out.update({f"{k}/raw": out[k] / out["raw"] for k in ("put", "sync") if k in out})
    return out


def sittings(variants: dict[str, str], n: int, count: int) -> None:
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    order = list(variants)
    for i in range(count):
        for name in order if i % 2 == 0 else order[::-1]:
            path = str(Path(variants[name]).resolve())
            env = {**os.environ, "PYTHONPATH": path}
            cmd = [sys.executable, __file__, "--run", "--n", str(n)]
            line = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            r = json.loads(line.strip().splitlines()[-1])
            runs[name].append(r)
            print(f"sitting {i + 1} {name:>6}: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))
    load = os.getloadavg()[0]
    print(
        f"\nmedian of {count} sittings, {n} calls of each per run, "
        f"{os.cpu_count()} cores, load average {load:.2f} at the end"
    )
    head = ("variant", "put us", "sync us", "raw us", "put/raw")
    print(" ".join(f"{h:>8}" for h in head) + f" {'sync/raw':>9}")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{name:>8} {med['put']:8.3f} {med['sync']:8.3f} {med['raw']:8.3f} "
            f"{med['put/raw']:8.3f} {med['sync/raw']:9.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variant", action="append", default=[], help="NAME=PYTHONPATH")
    ap.add_argument("--sittings", type=int, default=3)
    ap.add_argument("--n", type=int, default=20000, help="calls of each kind per run")
    ap.add_argument("--run", action="store_true", help="one run of this PYTHONPATH's hixl")
    ap.add_argument("--only", choices=CALLS, help="with --run: time this call alone")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    if a.run:
        print(json.dumps(one_run(a.n, a.only)))
        return
    if not a.variant:
        ap.error("give at least one --variant NAME=PYTHONPATH (or --run)")
    variants = dict(v.partition("=")[::2] for v in a.variant)
    sittings(variants, a.n, a.sittings)


if __name__ == "__main__":
    main()
