"""hixl over TCP loopback vs. a raw-socket baseline, measured in the same run.

    python benches/tcp.py            # full run (128 MiB messages)
    python benches/tcp.py --quick    # smaller and shorter (CI smoke)
    python benches/tcp.py --json out.json

Two processes: this one (initiator) and a target started by it, which holds a hixl engine and a
raw TCP sink (a Rust recv loop). Reports min and median of several runs in decimal GB/s and the
ratio of hixl to raw TCP for the same sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
MIB = 1 << 20


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    buf = np.ones(size, np.uint8)  # touched: no zero-page reads
    e.register(buf)
    raw = hixl._hixl._raw_tcp_sink("127.0.0.1:0")
    print(f"READY {e.local_engine} {raw} {buf.ctypes.data}", flush=True)
    sys.stdin.read()  # until the initiator closes our stdin
    e.finalize()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(xs: list[float]) -> tuple[float, float]:
    return min(xs), statistics.median(xs)


def timed(fn, iters: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", type=int, metavar="SIZE", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="32 MiB messages, fewer iterations")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per row (default 10)")
    ap.add_argument("--streams", type=int, default=2, help="hixl.streams and raw connections")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)

    size = 32 * MIB if a.quick else 128 * MIB
    iters = a.iters or (3 if a.quick else 10)
    nblk, blk = (2048 if a.quick else 8192), 16 * 1024
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(max(size, nblk * blk))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    tag, peer, raw, raddr = target.stdout.readline().split()
    assert tag == "READY"
    raddr = int(raddr)
    rows: dict[str, dict] = {}

    def row(name: str, secs: list[float], nbytes: int | None = None, **extra) -> None:
        lo, med = summary(secs)
        r = {"min_s": lo, "median_s": med, **extra}
        if nbytes:
            r["best_GBps"] = nbytes / lo / 1e9
            r["median_GBps"] = nbytes / med / 1e9
        rows[name] = r

    streams = a.streams
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.streams": str(streams)})

    # Registration cost of a fresh, touched 128 MiB buffer.
    reg = np.ones(128 * MIB, np.uint8)
    reg_times = []
    for _ in range(20):
        t0 = time.perf_counter()
        h = e.register_mem(hixl.MemDesc(reg.ctypes.data, reg.nbytes))
        reg_times.append(time.perf_counter() - t0)
        e.deregister_mem(h)
    row("register_128MiB", reg_times)

    src = np.random.default_rng(1).integers(0, 256, max(size, nblk * blk), dtype=np.uint8)
    dst = np.ones_like(src)
    e.register(src)
    e.register(dst)

    # Connect + first 4 KiB transfer.
    conn_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        e.connect(peer, timeout_ms=5000)
        e.transfer_sync(peer, W, [(src.ctypes.data, raddr, 4096)])
        conn_times.append(time.perf_counter() - t0)
        e.disconnect(peer)
    row("connect_plus_first_4KiB", conn_times)
    e.connect(peer, timeout_ms=5000)

    row("raw_tcp_big_1stream", hixl._hixl._raw_tcp_send(raw, size, iters, 1), size)
    row("raw_tcp_big", hixl._hixl._raw_tcp_send(raw, size, iters, streams), size)
    one = [(src.ctypes.data, raddr, size)]
    row("hixl_write_big", timed(lambda: e.transfer_sync(peer, W, one, 60_000), iters), size)
    back = [(dst.ctypes.data, raddr, size)]
    row("hixl_read_big", timed(lambda: e.transfer_sync(peer, R, back, 60_000), iters), size)

    perm = np.random.default_rng(2).permutation(nblk).astype(np.uint64)
    scat = np.stack(
        [
            src.ctypes.data + np.arange(nblk, dtype=np.uint64)[::-1] * blk,
            raddr + perm * blk,
            np.full(nblk, blk, np.uint64),
        ],
        axis=1,
    ).astype(np.uint64)
    row(
        "raw_tcp_scatter_equiv",
        hixl._hixl._raw_tcp_send(raw, nblk * blk, iters, streams),
        nblk * blk,
    )
    row(
        "hixl_write_scattered",
        timed(lambda: e.transfer_sync(peer, W, scat, 60_000), iters),
        nblk * blk,
        blocks=nblk,
    )

    small = [(src.ctypes.data, raddr, 4096)]
    n_small = 500 if a.quick else 3000
    lat = timed(lambda: e.transfer_sync(peer, W, small), n_small)
    raw_lat = hixl._hixl._raw_tcp_send(raw, 4096, n_small, 1)
    rows["write_4KiB_sync_latency"] = {
        "median_us": statistics.median(lat) * 1e6,
        "p99_us": float(np.percentile(lat, 99) * 1e6),
        "raw_tcp_median_us": statistics.median(raw_lat) * 1e6,
    }

    # Idle CPU of both engines while connected.
    idle = 1.0 if a.quick else 3.0
    c0, t0 = cpu_seconds(os.getpid()), cpu_seconds(target.pid)
    time.sleep(idle)
    c1, t1 = cpu_seconds(os.getpid()), cpu_seconds(target.pid)
    rows["idle_cpu_percent"] = {
        "initiator": (c1 - c0) / idle * 100,
        "target": (t1 - t0) / idle * 100,
    }
    e.finalize()
    target.stdin.close()
    target.wait(30)

    print(
        f"hixl {hixl.__version__} TCP loopback, {size // MIB} MiB x {iters} runs; "
        f"{nblk} x 16 KiB scattered; {streams} streams (the raw baseline uses as many)"
    )
    print(f"{'row':28} {'best GB/s':>10} {'median GB/s':>12} {'x raw best':>11} {'x raw med':>10}")
    for name in (
        "raw_tcp_big_1stream",
        "raw_tcp_big",
        "hixl_write_big",
        "hixl_read_big",
        "raw_tcp_scatter_equiv",
        "hixl_write_scattered",
    ):
        r = rows[name]
        base = rows["raw_tcp_scatter_equiv" if "scatter" in name else "raw_tcp_big"]
        r["ratio_to_raw"] = r["best_GBps"] / base["best_GBps"]
        r["median_ratio_to_raw"] = r["median_GBps"] / base["median_GBps"]
        print(
            f"{name:28} {r['best_GBps']:10.2f} {r['median_GBps']:12.2f} "
            f"{r['ratio_to_raw']:11.2f} {r['median_ratio_to_raw']:10.2f}"
        )
    lr = rows["write_4KiB_sync_latency"]
    print(
        f"4 KiB sync WRITE: median {lr['median_us']:.1f} us, p99 {lr['p99_us']:.1f} us "
        f"(raw TCP round trip median {lr['raw_tcp_median_us']:.1f} us)"
    )
    print(f"register 128 MiB: median {rows['register_128MiB']['median_s'] * 1e6:.1f} us")
    print(
        f"connect + first 4 KiB: median {rows['connect_plus_first_4KiB']['median_s'] * 1e3:.2f} ms"
    )
    ic = rows["idle_cpu_percent"]
    print(f"idle CPU: initiator {ic['initiator']:.1f} %, target {ic['target']:.1f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
