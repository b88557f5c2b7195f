"""The KV-cache layer vs the engine it runs on, and how much of a layerwise push is hidden.

    python benches/kv.py                 # 32 layers x 8 KV heads x 128, fp16, 4k tokens (512 MiB)
    python benches/kv.py --quick         # 8 layers, 1k tokens (32 MiB)
    python benches/kv.py --transport tcp --json out.json

Two processes: this one (rank 1, "decoder") and a worker it starts (rank 0, "mix") that holds
a filled source cache and an empty destination of the same paged layout. Per transport:

* engine: one 128 MiB transfer_sync WRITE and READ on the same link (the reference figure);
* pull_cache / push_cache of the whole cache: GB/s and ratio to the engine's READ / WRITE;
* layerwise: this process "computes" each layer (a sleep of --compute-ms, by default the time
  the engine needs to move one layer, as if a GPU were busy and the CPU free) and pushes it
  at once; the worker follows with receive_cache_async and "decodes" each layer (a 0.2 ms
  sleep) as soon as it arrives. Reported: the whole transfer (first send to last arrival)
  and the tail (last layer computed to decode finished), which is what layerwise leaves of
  the transfer time. Every run checks the bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from _common import MIB, parser

import hixl
from hixl.kv._context import context

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
DECODE_MS = 0.2


def shape(layers: int, tokens: int) -> tuple[int, ...]:
    return (layers, 2, tokens // 16, 16, 8, 128)


def serve(layers: int, tokens: int, transport: str) -> None:
    hixl.kv.init(
        cluster_id=0, role="mix", listen="127.0.0.1:0", options={"hixl.backends": transport}
    )
    shp = shape(layers, tokens)
    src = np.random.default_rng(1).integers(0, 1 << 16, shp, dtype=np.uint16).view(np.float16)
    hixl.kv.allocate_cache(src, name="src", layer_axis=0, block_axis=2)
    dst = hixl.kv.allocate_cache(np.zeros(shp, np.float16), name="dst", layer_axis=0, block_axis=2)
    raw = np.ones(128 * MIB, np.uint8)
    hixl.kv.allocate_cache(raw, name="raw", layer_axis=0, block_axis=None)
    print(f"READY {context().address}", flush=True)
    done: dict[int, float] = {}
    rx: tuple[hixl.kv.TransferTask, threading.Thread] | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {}
        if cmd["cmd"] == "receive":
            dst.array[...] = 0
            syncer = hixl.kv.LayerTracker(layers)
            task = hixl.kv.receive_cache_async(
                1, dst, syncer, hixl.kv.CacheTransferConfig(timeout_ms=30_000)
            )

            def decode(s: hixl.kv.LayerTracker = syncer) -> None:
                for k in range(layers):
                    s.wait_layer(k, timeout_ms=60_000)
                    time.sleep(DECODE_MS / 1000)
                    done[k] = time.monotonic()

            th = threading.Thread(target=decode)
            th.start()
            rx = (task, th)
        elif cmd["cmd"] == "received":
            assert rx is not None
            rx[0].wait(60_000)
            rx[1].join()
            out = {
                "decode_end": done[layers - 1],
                "ok": bool((dst.array.view(np.uint16) == src.view(np.uint16)).all()),
            }
        elif cmd["cmd"] == "zero":
            dst.array[...] = 0
        elif cmd["cmd"] == "check":
            out = {"ok": bool((dst.array.view(np.uint16) == src.view(np.uint16)).all())}
        print(json.dumps(out), flush=True)
    hixl.kv.finalize()


class Worker:
    def __init__(self, layers: int, tokens: int, transport: str) -> None:
        args = ["--serve-kv", f"{layers},{tokens},{transport}"]
        self.p = subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        tag, self.address = self.p.stdout.readline().split()
        assert tag == "READY"

    def call(self, cmd: str) -> dict:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.p.stdin.flush()
        return dict(json.loads(self.p.stdout.readline()))

    def close(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(30)


def med_gbps(fn, nbytes: int, iters: int) -> float:
    fn()
    secs = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    return nbytes / statistics.median(secs) / 1e9


def measure(transport: str, layers: int, tokens: int, iters: int, compute_ms: float | None) -> dict:
    w = Worker(layers, tokens, transport)
    hixl.kv.init(
        cluster_id=1,
        role="decoder",
        listen="127.0.0.1:0",
        peers={0: w.address},
        options={"hixl.backends": transport},
    )
    try:
        ctx = context()
        e, addr = ctx.engine, w.address
        shp = shape(layers, tokens)
        want = np.random.default_rng(1).integers(0, 1 << 16, shp, dtype=np.uint16).view(np.float16)
        local = hixl.kv.allocate_cache(
            np.zeros(shp, np.float16), name="src", layer_axis=0, block_axis=2
        )
        scratch = hixl.kv.allocate_cache(
            np.ones(128 * MIB, np.uint8), name="scratch", layer_axis=0, block_axis=None
        )
        _, raw = ctx.remote_cache(0, "raw")
        _, dst = ctx.remote_cache(0, "dst")
        backend = e.stats()[addr]["backend"]
        big = np.array([[scratch.addr, raw.addr, 128 * MIB]], np.uint64)
        row: dict = {"transport": backend, "cache_bytes": local.nbytes}
        row["engine_write_GBps"] = med_gbps(
            lambda: e.transfer_sync(addr, W, big, 60_000), 128 * MIB, iters
        )
        row["engine_read_GBps"] = med_gbps(
            lambda: e.transfer_sync(addr, R, big, 60_000), 128 * MIB, iters
        )
        cfg = hixl.kv.CacheTransferConfig(max_concurrent=4, timeout_ms=60_000)
        row["pull_GBps"] = med_gbps(lambda: hixl.kv.pull_cache(0, local, cfg), local.nbytes, iters)
        assert local.array.tobytes() == want.tobytes(), "pull_cache moved wrong bytes"
        row["push_GBps"] = med_gbps(
            lambda: hixl.kv.push_cache(0, local, cfg, remote_name="dst"), local.nbytes, iters
        )
        assert w.call("check")["ok"], "push_cache moved wrong bytes"
        row["pull_vs_engine"] = row["pull_GBps"] / row["engine_read_GBps"]
        row["push_vs_engine"] = row["push_GBps"] / row["engine_write_GBps"]

        # Layerwise push with simulated compute on both sides.
        layer_bytes = local.nbytes // layers
        if compute_ms is None:
            compute_ms = layer_bytes / (row["engine_write_GBps"] * 1e9) * 1e3
        row["compute_ms_per_layer"] = compute_ms
        w.call("zero")
        w.call("receive")
        syncer = hixl.kv.LayerTracker(layers)
        task = hixl.kv.transfer_cache_async(
            0, local, syncer, mode="push", transfer_config=cfg, remote_name="dst"
        )
        t_start = time.monotonic()
        for k in range(layers):
            time.sleep(compute_ms / 1000)
            syncer.layer_ready(k)
        last_computed = time.monotonic()
        task.wait(60_000)
        got = w.call("received")
        assert got["ok"], "layerwise push moved wrong bytes"
        first_submit = min(task.layer_times["submitted"].values())
        last_sent = max(task.layer_times["sent"].values())
        row["layerwise_transfer_ms"] = (last_sent - first_submit) * 1e3
        row["layerwise_tail_ms"] = (got["decode_end"] - last_computed) * 1e3
        row["compute_total_ms"] = (last_computed - t_start) * 1e3
        row["whole_push_ms"] = local.nbytes / (row["push_GBps"] * 1e9) * 1e3
        return row
    finally:
        hixl.kv.finalize()
        w.close()


def main() -> None:
    ap = parser(__doc__, "8 layers, 1k tokens, 2 runs")
    ap.add_argument("--serve-kv", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="auto,tcp", help="comma-separated (default auto,tcp)")
    ap.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="simulated compute per layer (default: one layer's engine move time)",
    )
    a = ap.parse_args()
    if a.serve_kv:
        layers, tokens, transport = a.serve_kv.split(",")
        return serve(int(layers), int(tokens), transport)
    layers, tokens = (8, 1024) if a.quick else (32, 4096)
    iters = a.iters or (2 if a.quick else 5)
    rows = []
    for t in a.transport.split(","):
        row = measure(t, layers, tokens, iters, a.compute_ms)
        if any(r["transport"] == row["transport"] for r in rows):
            continue
        rows.append(row)
    print(
        f"KV cache: {layers} layers x 8 KV heads x 128, fp16, {tokens} tokens, 16-token blocks "
        f"= {rows[0]['cache_bytes'] / MIB:.0f} MiB; {iters} runs, median"
    )
    for r in rows:
        print(f"\n[{r['transport']}]")
        print(
            f"  engine 128 MiB     write {r['engine_write_GBps']:6.2f} GB/s   read "
            f"{r['engine_read_GBps']:6.2f} GB/s"
        )
        print(
            f"  push_cache         {r['push_GBps']:6.2f} GB/s = {r['push_vs_engine']:.2f} x engine "
            "write (target >= 0.8)"
        )
        print(
            f"  pull_cache         {r['pull_GBps']:6.2f} GB/s = {r['pull_vs_engine']:.2f} x engine "
            "read (target >= 0.8)"
        )
        print(
            f"  layerwise push     compute {r['compute_ms_per_layer']:.2f} ms/layer "
            f"({r['compute_total_ms']:.1f} ms in all); whole transfer "
            f"{r['layerwise_transfer_ms']:.1f} ms; tail after the last layer was computed: "
            f"{r['layerwise_tail_ms']:.2f} ms (a push after compute would add "
            f"{r['whole_push_ms']:.1f} ms)"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
