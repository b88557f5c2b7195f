"""Where the microseconds of one small synchronous transfer go, from Python.

    python scripts/latency_profile.py                  # same host, 4 KiB WRITE
    python scripts/latency_profile.py --backend tcp --size 16384 --op read

Starts a target process, runs `transfer_sync` in a loop in this process, samples the calling
thread (or, with `--side target`, every thread of the target) with `perf record` (Linux perf
must be installed; the samples stay in /tmp/hixl-latency-profile.data for `perf report`) for a
few seconds of the steady state, and sorts the samples (self time) into stages by symbol:

- python: the interpreter running the caller's loop, and the call into the extension;
- bindings: hixl's PyO3 layer (argument and descriptor parsing, GIL release);
- validate: registry and peer-table lookups, pins, merging and splitting;
- request: making, submitting, completing and dropping the request (stats, settle);
- wait: waiting for the request (spinning, sleeping, waking);
- system call: the copy's own system calls, kernel and libc (process_vm_writev/readv, or
  sendmsg/recvmsg and epoll for tcp); memcpy when the target's memory is engine-allocated;
- alloc: malloc and free; clock: reading the clock; other: the rest.

Prints microseconds per transfer for each stage (the stage's share of the samples times the
measured time per transfer). Shares of a sampled profile, not exact costs: use them to see
what dominates, and compare two builds in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import hixl  # noqa: E402

STAGES: list[tuple[str, str]] = [
    (
        "alloc",
        r"^(malloc|free|cfree|_int_free|_int_malloc|realloc|__libc_malloc|__libc_free|"
        r"malloc_consolidate|tcache|_int_realloc)",
    ),
    ("clock", r"clock_gettime|__vdso"),
    ("wait", r"Request::wait|futex|yield|sched_yield|Condvar|WaitHelp|drive_here|wait_req"),
    (
        "validate",
        r"validate|registry|Registry|RemoteTable|Pins?::|Pin::|push_merged|split|"
        r"with_fresh_table|check_domains",
    ),
    (
        "request",
        r"Request|Completer|complete::|PeerStats|stats::|submit|remember|execute|"
        r"copy_segs|finish_part|finish_elsewhere|ShmLink|TcpLink|kick|Part|Engine::conn|running",
    ),
    ("bindings", r"^_hixl::|pyo3|parse_descs|uint_named|__pymethod|trampoline"),
]
KERNEL_OR_LIBC_IO = re.compile(
    r"process_vm|sendmsg|recvmsg|epoll|^__libc_send|^__libc_recv|syscall|entry_SYSCALL|"
    r"memmove|memcpy"
)


def classify(dso: str, sym: str) -> str:
    if "kernel" in dso or KERNEL_OR_LIBC_IO.search(sym):
        return "system call"
    for stage, pat in STAGES:
        if re.search(pat, sym):
            return stage
    if "libpython" in dso or sym.startswith("_Py") or sym.startswith("Py"):
        return "python"
    return "other"


def serve(mem: str) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    if mem == "alloc":
        buf = e.alloc(1 << 22)  # engine-allocated: a same-host peer copies through a mapping
    else:
        buf = np.ones(1 << 22, np.uint8)
        e.register(buf)
    print(
        json.dumps({"engine": e.local_engine, "addr": buf.ctypes.data, "pid": os.getpid()}),
        flush=True,
    )
    sys.stdin.read()
    e.finalize()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--backend", choices=["shm", "tcp"], default="shm")
    ap.add_argument("--size", type=int, default=4096, help="bytes per transfer (<= 4 MiB)")
    ap.add_argument("--op", choices=["write", "read"], default="write")
    ap.add_argument("--seconds", type=float, default=4.0, help="how long perf samples")
    ap.add_argument(
        "--side",
        choices=["initiator", "target"],
        default="initiator",
        help="sample the calling thread (default) or every thread of the target process",
    )
    ap.add_argument(
        "--target-mem",
        choices=["registered", "alloc"],
        default="registered",
        help="the target's buffer: numpy memory it registered (same host: cross-memory attach), "
        "or engine-allocated (`Hixl.alloc`; same host: copied through a mapping)",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.target_mem)
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (Debian: apt-get install linux-perf)")
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--target-mem", a.target_mem],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert target.stdout is not None and target.stdin is not None
    info = json.loads(target.stdout.readline())
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": a.backend})
    src = np.ones(1 << 22, np.uint8)
    e.register(src)
    peer = info["engine"]
    e.connect(peer, timeout_ms=10_000)
    op = hixl.TransferOp.WRITE if a.op == "write" else hixl.TransferOp.READ
    d = [(src.ctypes.data, info["addr"], a.size)]
    stop = threading.Event()
    count = [0, 0.0]

    def loop() -> None:
        for _ in range(2000):
            e.transfer_sync(peer, op, d)
        t0, n = time.perf_counter(), 0
        while not stop.is_set():
            for _ in range(200):
                e.transfer_sync(peer, op, d)
            n += 200
        count[0], count[1] = n, time.perf_counter() - t0

    data = "/tmp/hixl-latency-profile.data"
    th = threading.Thread(target=loop)
    th.start()
    time.sleep(0.5)
    who = ["-t", str(th.native_id)] if a.side == "initiator" else ["-p", str(info["pid"])]
    subprocess.run(
        ["perf", "record", "-q", "-F", "9999", *who, "-o", data, "--", "sleep", str(a.seconds)],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    stop.set()
    th.join()
    e.finalize()
    target.stdin.close()
    target.wait(30)
    per_us = count[1] / count[0] * 1e6
    rep = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            data,
            "--no-children",
            "--sort",
            "dso,sym",
            "--stdio",
            "-q",
            "--percent-limit",
            "0",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    shares: dict[str, float] = {}
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)$", line)
        if not m:
            continue
        pct, dso, sym = float(m.group(1)), m.group(2), m.group(3).strip()
        stage = classify(dso, sym)
        shares[stage] = shares.get(stage, 0.0) + pct
    total = sum(shares.values()) or 1.0
    print(
        f"hixl {hixl.__version__}: {a.backend} {a.op} of {a.size} bytes, "
        f"{per_us:.2f} us per transfer_sync"
    )
    if a.side == "target":
        print("  (target process: all of its threads; us = share x time per transfer)")
    print(f"  {'stage':12s} {'share':>6s} {'us':>6s}")
    for stage, pct in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {stage:12s} {pct / total * 100:5.1f}% {pct / total * per_us:6.2f}")


if __name__ == "__main__":
    main()
