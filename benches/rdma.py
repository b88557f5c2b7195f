"""hixl's rdma backend beside perftest on the same RDMA device, measured in the same run.

    scripts/rxe_vm.sh run -- python benches/rdma.py --device rxe0 --gid-index 1   # in the VM
    python benches/rdma.py --device mlx5_0 --gid-index 3 --json out.json         # a real NIC
    scripts/rxe_vm.sh run --rails 2 -- python benches/rdma.py --rails rxe0,rxe1 --gid-index 1

Two processes on one device (a target started by this one, holding a hixl engine with
hixl.backends=rdma on the real verbs provider). perftest (Debian's `perftest`: ib_write_bw,
ib_read_bw, ib_write_lat) runs between two processes on the same device first. Rows: 1 MiB
WRITE and READ throughput (a window of requests in flight) against ib_write_bw / ib_read_bw at
1 MiB, 8192 x 16 KiB scattered WRITE in one batch against ib_write_bw at 16 KiB, 4 KiB
synchronous WRITE latency against ib_write_lat's typical latency (with hixl.rdma.busy_poll_us
at its default, 0 and 5 ms) and against a raw post-send/poll-CQ loop on one QP of the same
device with no hixl at all (`crates/hixl-core/examples/rdma_raw_lat.rs`, `--raw-bin`; built
with `cargo build --release --example rdma_raw_lat`, the row is skipped saying so where it is
missing), and the CPU an idle engine
with an RDMA link uses. Under the VM's emulated CPU (TCG) absolute figures mean little; the
ratios, measured in the same run on the same device, are the result.

`--rails A,B,...` measures multi-rail instead: a 64 MiB WRITE (one request, striped across the
rails by bytes) with `hixl.rdma.device` = A alone, then = A,B,... (both engines), in the same
run, and the ratio of the two medians. Under TCG on two vCPUs the rails share the emulated CPU,
so a ratio near 1 there says nothing about NICs.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np
from _common import MIB, bandwidth_row, parser, start_target, stop_target, timed, write_json

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
KIB = 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Latency rows beside the default (hixl.rdma.busy_poll_us=50): the waiter's CQ polling off,
#: and on for 5 ms (longer than the emulated round trip).
LATENCY_MODES = [("hixl_write_4KiB_sync_busy0", "0"), ("hixl_write_4KiB_sync_busy5ms", "5000")]


def options(device: str, gid: str) -> dict[str, str]:
    return {
        "hixl.backends": "rdma",
        "hixl.rdma.provider": "verbs",
        "hixl.rdma.device": device,
        "hixl.rdma.gid_index": gid,
    }


def serve(size: int) -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", options(os.environ["BENCH_DEVICE"], os.environ["BENCH_GID"]))
    buf = np.ones(size, np.uint8)
    e.register(buf)
    print(f"READY {e.local_engine} {buf.ctypes.data} {os.getpid()}", flush=True)
    sys.stdin.read()
    e.finalize()


def perftest(tool: str, device: str, gid: str, size: int, iters: int, port: int) -> str:
    """Runs `tool` as server and client on `device`; the client's output."""
    base = [tool, "-d", device, "-x", gid, "-s", str(size), "-n", str(iters), "-p", str(port), "-F"]
    server = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        out = subprocess.run([*base, "127.0.0.1"], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise SystemExit(f"{tool} failed: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout
    finally:
        server.wait(30)


def perftest_bw(out: str) -> float:
    """Average GB/s of an ib_*_bw report (its line: bytes iterations peak avg msg-rate)."""
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0].isdigit() and f[1].isdigit():
            return float(f[3]) * 1e6 / 1e9  # MB/sec (10^6) -> GB/s
    raise SystemExit(f"no bandwidth line in:\n{out}")


def perftest_lat(out: str) -> float:
    """Typical one-way latency in seconds of an ib_write_lat report."""
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0].isdigit() and f[1].isdigit():
            return float(f[4]) / 1e6  # t_min t_max t_typical: the 5th column, usec
    raise SystemExit(f"no latency line in:\n{out}")


def raw_latency(binary: str, device: str, gid: str, size: int, iters: int) -> dict | None:
    """The raw verbs baseline: `rdma_raw_lat` (one QP, post one signaled WRITE, poll the CQ
    until it completes, no hixl) on the same device and size; None, saying why, where the
    program is not built."""
    if not os.access(binary, os.X_OK):
        print(f"raw baseline skipped: {binary} is missing (cargo build --release --example "
              "rdma_raw_lat, or --raw-bin)", file=sys.stderr)  # fmt: skip
        return None
    args = ["--device", device, "--gid-index", gid, "--size", str(size), "--iters", str(iters)]
    out = subprocess.run([binary, *args], capture_output=True, text=True, timeout=600, check=True)
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(f.split("=", 1) for f in last.split()[1:])
    return {"median_s": float(fields["median_us"]) / 1e6, "p99_s": float(fields["p99_us"]) / 1e6}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def windowed(e: hixl.Hixl, peer: str, op: hixl.TransferOp, rows: list, window: int) -> None:
    """Keeps `window` requests of one row each in flight until all of `rows` are done."""
    pending = []
    for r in rows:
        pending.append(e.transfer_async(peer, op, [r]))
        if len(pending) >= window:
            assert pending.pop(0).wait(60_000) == hixl.TransferStatus.COMPLETED
    for p in pending:
        assert p.wait(60_000) == hixl.TransferStatus.COMPLETED


def one_write(devices: str, gid: str, size: int, iters: int) -> tuple[dict, list]:
    """`iters` timed WRITEs of `size` bytes in one request between two engines on `devices`;
    the bandwidth row and the link's rails (device, up, bytes) from stats()."""
    os.environ["BENCH_DEVICE"], os.environ["BENCH_GID"] = devices, gid
    target, (peer, raddr, _) = start_target(__file__, size)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {**options(devices, gid), "hixl.rdma.qps": "2"})
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    e.register(src)
    e.connect(peer, timeout_ms=10_000)
    assert e.stats()[peer]["backend"] == "rdma"
    d = [(src.ctypes.data, int(raddr), size)]
    row = bandwidth_row(timed(lambda: e.transfer_sync(peer, W, d, 120_000), iters), size)
    rails = [(r["device"], r["up"], r["bytes"]) for r in e.stats()[peer]["rails"]]
    e.finalize()
    stop_target(target)
    return row, rails


def rails_main(a) -> None:
    """One rail against all of `a.rails`, 64 MiB WRITE, same run."""
    devs = a.rails.split(",")
    iters = a.iters or (3 if a.quick else 7)
    size = 64 * MIB
    rows: dict[str, dict] = {"device": {"name": a.rails, "info": hixl._hixl._rdma_info("verbs")}}
    one, r1 = one_write(devs[0], a.gid_index, size, iters)
    many, rn = one_write(a.rails, a.gid_index, size, iters)
    rows[f"hixl_write_64MiB_{devs[0]}"] = {**one, "rails": r1}
    rows[f"hixl_write_64MiB_{len(devs)}_rails"] = {**many, "rails": rn}
    ratio = many["median_GBps"] / one["median_GBps"]
    rows["ratio"] = {"median": ratio}
    print(f"device: {rows['device']['info']}")
    print(f"{'row':34} {'median GB/s':>11} {'best GB/s':>10}  bytes per rail")
    for name in (f"hixl_write_64MiB_{devs[0]}", f"hixl_write_64MiB_{len(devs)}_rails"):
        r = rows[name]
        per = ", ".join(f"{d} {'up' if up else 'OUT'} {b / MIB:.0f} MiB" for d, up, b in r["rails"])
        print(f"{name:34} {r['median_GBps']:11.3f} {r['best_GBps']:10.3f}  {per}")
    print(f"{len(devs)} rails / 1 rail (medians): {ratio:.2f}x (goal on NICs: >= 1.6x)")
    write_json(a.json, rows)


def main() -> None:
    ap = parser(__doc__, "fewer iterations")
    ap.add_argument("--device", default=os.environ.get("HIXL_RDMA_DEVICE", "rxe0"))
    ap.add_argument("--gid-index", default=os.environ.get("HIXL_RDMA_GID_INDEX", "1"))
    ap.add_argument("--rails", metavar="A,B", help="multi-rail rows only: one rail against these")
    ap.add_argument(
        "--raw-bin",
        default=os.path.join(
            os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")),
            "release/examples/rdma_raw_lat",
        ),
        help="the raw verbs latency loop (cargo build --release --example rdma_raw_lat)",
    )
    a = ap.parse_args()
    if a.serve:
        return serve(a.serve)
    if a.rails:
        return rails_main(a)
    dev, gid = a.device, a.gid_index
    iters = a.iters or (3 if a.quick else 7)
    rows: dict[str, dict] = {"device": {"name": dev, "info": hixl._hixl._rdma_info("verbs")}}

    n_bw = 200 if a.quick else 1000
    rows["ib_write_bw_1MiB"] = {
        "GBps": perftest_bw(perftest("ib_write_bw", dev, gid, MIB, n_bw, 18515))
    }
    rows["ib_read_bw_1MiB"] = {
        "GBps": perftest_bw(perftest("ib_read_bw", dev, gid, MIB, n_bw, 18516))
    }
    n16 = 2000 if a.quick else 8192
    out = perftest("ib_write_bw", dev, gid, 16 * KIB, n16, 18517)
    rows["ib_write_bw_16KiB"] = {"GBps": perftest_bw(out)}
    n_lat = 500 if a.quick else 2000
    rows["ib_write_lat_4KiB"] = {
        "s": perftest_lat(perftest("ib_write_lat", dev, gid, 4 * KIB, n_lat, 18518))
    }
    raw = raw_latency(a.raw_bin, dev, gid, 4 * KIB, n_lat)
    if raw is not None:
        rows["raw_write_lat_4KiB"] = raw

    nblk, blk = 8192, 16 * KIB
    span = max(64 * MIB, nblk * blk)
    os.environ["BENCH_DEVICE"], os.environ["BENCH_GID"] = dev, gid
    target, (peer, raddr, tpid) = start_target(__file__, span)
    raddr_i, tpid_i = int(raddr), int(tpid)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", options(dev, gid))
    src = np.random.default_rng(1).integers(0, 256, span, dtype=np.uint8)
    dst = np.zeros_like(src)
    e.register(src)
    e.register(dst)
    e.connect(peer, timeout_ms=10_000)
    assert e.stats()[peer]["backend"] == "rdma"

    n_mib = 64
    wr = [(src.ctypes.data + i * MIB, raddr_i + i * MIB, MIB) for i in range(n_mib)]
    rd = [(dst.ctypes.data + i * MIB, raddr_i + i * MIB, MIB) for i in range(n_mib)]
    rows["hixl_write_1MiB"] = bandwidth_row(
        timed(lambda: windowed(e, peer, W, wr, 16), iters), n_mib * MIB
    )
    rows["hixl_read_1MiB"] = bandwidth_row(
        timed(lambda: windowed(e, peer, R, rd, 16), iters), n_mib * MIB
    )
    assert np.array_equal(dst[: n_mib * MIB], src[: n_mib * MIB]), "READ brought back other bytes"
    perm = np.random.default_rng(2).permutation(nblk).astype(np.uint64)
    scat = np.stack(
        [src.ctypes.data + np.arange(nblk, dtype=np.uint64)[::-1] * blk,
         raddr_i + perm * blk, np.full(nblk, blk, np.uint64)], axis=1,
    ).astype(np.uint64)  # fmt: skip
    rows["hixl_write_scattered_8192x16KiB"] = bandwidth_row(
        timed(lambda: e.transfer_sync(peer, W, scat, 120_000), iters), nblk * blk
    )
    small = [(src.ctypes.data, raddr_i, 4096)]
    lat = timed(lambda: e.transfer_sync(peer, W, small), n_lat)
    rows["hixl_write_4KiB_sync"] = {
        "median_s": statistics.median(lat),
        "p99_s": sorted(lat)[len(lat) * 99 // 100],
    }
    # The same with the waiter's CQ polling off (the completion thread completes each request)
    # and long enough to span the round trip (latency mode), each on an engine of its own.
    for name, busy in LATENCY_MODES:
        el = hixl.Hixl()
        el.initialize("127.0.0.1", {**options(dev, gid), "hixl.rdma.busy_poll_us": busy})
        el.register(src)
        el.connect(peer, timeout_ms=10_000)
        lat = timed(lambda el=el: el.transfer_sync(peer, W, small), n_lat)
        rows[name] = {"median_s": statistics.median(lat), "busy_poll_us": int(busy)}
        el.finalize()

    # Idle: the link up, nothing moving, 10 s; both engines' CPU.
    time.sleep(1)
    c0, t0, w0 = cpu_seconds(os.getpid()), cpu_seconds(tpid_i), time.monotonic()
    time.sleep(10)
    wall = time.monotonic() - w0
    rows["idle_cpu_share"] = {
        "initiator": (cpu_seconds(os.getpid()) - c0) / wall,
        "target": (cpu_seconds(tpid_i) - t0) / wall,
    }
    e.finalize()
    stop_target(target)

    ratio = [
        ("hixl_write_1MiB", "ib_write_bw_1MiB", 0.9),
        ("hixl_read_1MiB", "ib_read_bw_1MiB", 0.9),
        ("hixl_write_scattered_8192x16KiB", "ib_write_bw_16KiB", 0.8),
    ]
    print(f"device: {rows['device']['info']}")
    print(f"{'row':34} {'median GB/s':>11} {'baseline':>18} {'GB/s':>6} {'ratio':>6} goal")
    for name, base, goal in ratio:
        got, b = rows[name]["median_GBps"], rows[base]["GBps"]
        rows[name]["ratio"] = got / b
        print(f"{name:34} {got:11.3f} {base:>18} {b:6.3f} {got / b:6.2f} >={goal}")
    bl, base = rows["ib_write_lat_4KiB"]["s"], "ib_write_lat_4KiB"
    for name in ["hixl_write_4KiB_sync"] + [n for n, _ in LATENCY_MODES]:
        hl = rows[name]["median_s"]
        rows[name]["ratio"] = hl / bl
        print(
            f"{name + ' (us)':34} {hl * 1e6:11.1f} {base:>18} {bl * 1e6:6.1f} {hl / bl:6.2f} <=1.3"
        )
    if "raw_write_lat_4KiB" in rows:
        rl, base = rows["raw_write_lat_4KiB"]["median_s"], "raw_write_lat_4KiB"
        hl = rows["hixl_write_4KiB_sync"]["median_s"]
        rows["hixl_write_4KiB_sync"]["ratio_raw"] = hl / rl
        name = "hixl_write_4KiB_sync (us)"
        print(f"{name:34} {hl * 1e6:11.1f} {base:>18} {rl * 1e6:6.1f} {hl / rl:6.2f}")
    ini, tgt = rows["idle_cpu_share"]["initiator"] * 100, rows["idle_cpu_share"]["target"] * 100
    print(f"idle CPU with an RDMA link: initiator {ini:.3f} %, target {tgt:.3f} % of a core")
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
