"""hixl over TCP loopback vs. a raw-socket baseline, measured in the same run.

    python benches/tcp.py            # full run (128 MiB messages)
    python benches/tcp.py --quick    # smaller and shorter (CI smoke)
    python benches/tcp.py --streams 4 --json out.json

Two processes: this one (initiator) and a target started by it, which holds a hixl engine and a
raw TCP sink (a Rust recv loop). Reports min and median of several runs in decimal GB/s and the
ratio of hixl to raw TCP for the same sizes, with as many raw connections as hixl streams.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
from _common import (
    MIB,
    Plan,
    bandwidth_row,
    parser,
    print_ratios,
    start_target,
    stop_target,
    timed,
    write_json,
)

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ


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


def main() -> None:
    ap = parser(__doc__, "32 MiB messages, fewer iterations")
    ap.add_argument("--streams", type=int, default=2, help="hixl.tcp.streams and raw connections")
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    plan, streams = Plan.of(a), a.streams
    size, iters, nblk, blk = plan.size, plan.iters, plan.nblk, plan.blk
    target, (peer, raw, raddr) = start_target(__file__, plan.span)
    raddr = int(raddr)
    rows: dict[str, dict] = {}

    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.tcp.streams": str(streams), "hixl.backends": "tcp"})

    # Registration cost of a fresh, touched 128 MiB buffer.
    reg = np.ones(128 * MIB, np.uint8)
    reg_times = []
    for _ in range(20):
        t0 = time.perf_counter()
        h = e.register_mem(hixl.MemDesc(reg.ctypes.data, reg.nbytes))
        reg_times.append(time.perf_counter() - t0)
        e.deregister_mem(h)
    rows["register_128MiB"] = {"median_s": statistics.median(reg_times)}

    src = np.random.default_rng(1).integers(0, 256, plan.span, dtype=np.uint8)
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
    rows["connect_plus_first_4KiB"] = {"median_s": statistics.median(conn_times)}
    e.connect(peer, timeout_ms=5000)

    send = hixl._hixl._raw_tcp_send
    rows["raw_tcp_big_1stream"] = bandwidth_row(send(raw, size, iters, 1), size)
    rows["raw_tcp_big"] = bandwidth_row(send(raw, size, iters, streams), size)
    one = [(src.ctypes.data, raddr, size)]
    back = [(dst.ctypes.data, raddr, size)]
    rows["hixl_write_big"] = bandwidth_row(
        timed(lambda: e.transfer_sync(peer, W, one, 60_000), iters), size
    )
    rows["hixl_read_big"] = bandwidth_row(
        timed(lambda: e.transfer_sync(peer, R, back, 60_000), iters), size
    )
    perm = np.random.default_rng(2).permutation(nblk).astype(np.uint64)
    scat = np.stack(
        [src.ctypes.data + np.arange(nblk, dtype=np.uint64)[::-1] * blk,
         raddr + perm * blk, np.full(nblk, blk, np.uint64)], axis=1,
    ).astype(np.uint64)  # fmt: skip
    rows["raw_tcp_scatter_equiv"] = bandwidth_row(send(raw, nblk * blk, iters, streams), nblk * blk)
    rows["hixl_write_scattered"] = bandwidth_row(
        timed(lambda: e.transfer_sync(peer, W, scat, 60_000), iters), nblk * blk
    )

    small = [(src.ctypes.data, raddr, 4096)]
    n_small = 500 if a.quick else 3000
    lat = timed(lambda: e.transfer_sync(peer, W, small), n_small)
    raw_lat = send(raw, 4096, n_small, 1)
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
    stop_target(target)

    print(
        f"hixl {hixl.__version__} TCP loopback, {size // MIB} MiB x {iters} runs; "
        f"{nblk} x 16 KiB scattered; {streams} streams (the raw baseline uses as many)"
    )
    print_ratios(
        rows,
        [
            ("raw_tcp_big_1stream", "raw_tcp_big"),
            ("raw_tcp_big", None),
            ("hixl_write_big", "raw_tcp_big"),
            ("hixl_read_big", "raw_tcp_big"),
            ("raw_tcp_scatter_equiv", None),
            ("hixl_write_scattered", "raw_tcp_scatter_equiv"),
        ],
        28,
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
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
