"""Small transfers at the limit: 4 KiB synchronous WRITE and READ latency from Python, each beside
its raw baseline measured in the same run.

    python benches/latency.py              # 3,000 of each
    python benches/latency.py --n 500 --json out.json

Rows (p50 and p99 in microseconds):
- tcp: hixl over loopback with default options, and in low-latency mode (both engines with
  `hixl.tcp.busy_poll_us`); raw: a Python ping-pong of 4 KiB and a 1-byte answer over one
  socket, blocking, and busy-polling (non-blocking recv in a loop) on both ends;
- same host: hixl (`hixl.backends=shm`) against `process_vm_writev` / `process_vm_readv`
  called through ctypes, interleaved call by call in one loop;
- idle CPU of the low-latency initiator in the second after its last transfer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import threading
import time

# numpy's BLAS threads spin for a while after import: on a 2-core machine they take the core
# the other side of a ping-pong needs. This benchmark does no linear algebra.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from _common import start_json_target  # noqa: E402

import hixl  # noqa: E402

KIB4 = 4096
BUSY_US = "200"


def serve() -> None:
    """The target process: a default and a low-latency hixl engine, and two raw servers."""
    engines = []
    for opts in ({}, {"hixl.tcp.busy_poll_us": BUSY_US}):
        e = hixl.Hixl()
        e.initialize("127.0.0.1:0", opts)
        buf = np.ones(1 << 20, np.uint8)
        e.register(buf)
        engines.append((e, buf))

    def raw_server(busy: bool) -> int:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)

        def run() -> None:
            c, _ = ls.accept()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c.setblocking(not busy)
            buf = bytearray(KIB4)
            view = memoryview(buf)
            while True:
                got = 0
                while got < KIB4:
                    try:
                        k = c.recv_into(view[got:])
                    except BlockingIOError:
                        continue
                    if k == 0:
                        return
                    got += k
                c.send(b"k")

        threading.Thread(target=run, daemon=True).start()
        return ls.getsockname()[1]

    ports = [raw_server(False), raw_server(True)]
    info = [[e.local_engine, b.ctypes.data] for e, b in engines]
    print(json.dumps({"engines": info, "raw": ports, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    for e, _ in engines:
        e.finalize()


def pct(ts: list[float]) -> dict:
    ts = sorted(ts)
    return {"p50_us": ts[len(ts) // 2] * 1e6, "p99_us": ts[int(len(ts) * 0.99)] * 1e6}


def timed(f, n: int) -> list[float]:
    for _ in range(min(300, n)):
        f()
    out = []
    pc = time.perf_counter
    for _ in range(n):
        t0 = pc()
        f()
        out.append(pc() - t0)
    return out


def raw_pingpong(port: int, busy: bool, n: int) -> list[float]:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(not busy)
    payload = b"x" * KIB4

    def once() -> None:
        s.sendall(payload) if not busy else _send_busy(s, payload)
        while True:
            try:
                if s.recv(1):
                    return
                raise ConnectionError("raw server closed")
            except BlockingIOError:
                continue

    try:
        return timed(once, n)
    finally:
        s.close()


def _send_busy(s: socket.socket, b: bytes) -> None:
    view = memoryview(b)
    while view:
        try:
            view = view[s.send(view) :]
        except BlockingIOError:
            continue


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=3000, help="transfers per row")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    target, info = start_json_target(__file__)
    assert target.stdin is not None
    rows: dict[str, dict] = {}
    W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    try:
        for name, opts, (peer, raddr) in (
            ("tcp_default", {}, info["engines"][0]),
            ("tcp_busy_poll", {"hixl.tcp.busy_poll_us": BUSY_US}, info["engines"][1]),
        ):
            e = hixl.Hixl()
            e.initialize("127.0.0.1", {"hixl.backends": "tcp", **opts})
            e.register(src)
            e.connect(peer, timeout_ms=10_000)
            d = [(src.ctypes.data, raddr, KIB4)]
            rows[f"{name}_write"] = pct(timed(lambda: e.transfer_sync(peer, W, d), a.n))  # noqa: B023
            rows[f"{name}_read"] = pct(timed(lambda: e.transfer_sync(peer, R, d), a.n))  # noqa: B023
            if opts:
                c0, t0 = cpu_seconds(), time.perf_counter()
                time.sleep(1.0)
                rows["busy_poll_idle_cpu_pct"] = {
                    "pct": (cpu_seconds() - c0) / (time.perf_counter() - t0) * 100
                }
            e.finalize()
        rows["raw_blocking_pingpong"] = pct(raw_pingpong(info["raw"][0], False, a.n))

        # Same host: hixl and the bare system call, interleaved call by call.
        e = hixl.Hixl()
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        e.register(src)
        peer, raddr = info["engines"][0]
        e.connect(peer, timeout_ms=10_000)
        libc = ctypes.CDLL(None, use_errno=True)

        class Iovec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        loc, rem = Iovec(src.ctypes.data, KIB4), Iovec(raddr, KIB4)
        lp, rp, pid = ctypes.byref(loc), ctypes.byref(rem), info["pid"]
        args = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        pvw, pvr = libc.process_vm_writev, libc.process_vm_readv
        pvw.argtypes = pvr.argtypes = args
        d = [(src.ctypes.data, raddr, KIB4)]
        calls = {
            "raw_pvw": lambda: pvw(pid, lp, 1, rp, 1, 0),
            "shm_write": lambda: e.transfer_sync(peer, W, d),
            "raw_pvr": lambda: pvr(pid, lp, 1, rp, 1, 0),
            "shm_read": lambda: e.transfer_sync(peer, R, d),
        }
        ts: dict[str, list[float]] = {k: [] for k in calls}
        pc = time.perf_counter
        for i in range(a.n + 300):
            for k, f in calls.items():
                t0 = pc()
                f()
                t1 = pc()
                if i >= 300:
                    ts[k].append(t1 - t0)
        rows.update({k: pct(v) for k, v in ts.items()})
        e.finalize()
        # Last: its server spins until this client closes.
        rows["raw_busy_pingpong"] = pct(raw_pingpong(info["raw"][1], True, a.n))
    finally:
        target.stdin.close()
        target.wait(30)

    print(f"hixl {hixl.__version__}: 4 KiB synchronous transfers from Python, {a.n} each")
    print(f"  {'row':24s} {'p50 us':>8s} {'p99 us':>8s}")
    for k, v in rows.items():
        if "p50_us" in v:
            print(f"  {k:24s} {v['p50_us']:8.1f} {v['p99_us']:8.1f}")
    p50 = {k: v["p50_us"] for k, v in rows.items() if "p50_us" in v}
    blocking, busy = p50["raw_blocking_pingpong"], p50["raw_busy_pingpong"]
    print(
        f"  tcp default write / raw blocking ping-pong: {p50['tcp_default_write'] / blocking:.2f}; "
        f"busy-poll write / raw busy ping-pong: {p50['tcp_busy_poll_write'] / busy:.2f}"
    )
    print(
        f"  same host write / ctypes process_vm_writev: {p50['shm_write'] / p50['raw_pvw']:.2f}; "
        f"read / process_vm_readv: {p50['shm_read'] / p50['raw_pvr']:.2f}"
    )
    idle = rows["busy_poll_idle_cpu_pct"]["pct"]
    print(f"  idle CPU of the busy-poll initiator, 1 s after its last transfer: {idle:.2f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
