"""A KV-cache rank in its own process, configured only by the environment (HIXL_CLUSTER_ID,
HIXL_ROLE, HIXL_LISTEN, HIXL_PEERS) and driven by JSON lines on stdin.

It calls a bare ``hixl.init()`` and prints "READY <address>". Each command line is a JSON
object with "cmd"; each answer is one JSON line ({"ok": true, ...} or {"ok": false,
"error": ..., "status_code": ...}):
  alloc   name, shape, dtype, seed|null, layer_axis, block_axis: allocate (random or zeros)
  bytes   name: the cache's bytes as hex
  link    ranks: hixl.link(ranks)
  pull    rank, name: pull_cache into the local cache of that name
  receive rank, name: start receive_cache_async; answers at once
  received: wait for the receive task; answers the monotonic arrival time of every layer
  exit
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import hixl


def main() -> None:
    me = hixl.init()
    print(f"READY {me.address}", flush=True)
    caches: dict[str, hixl.Cache] = {}
    receiving: tuple[hixl.TransferTask, hixl.LayerSynchronizer] | None = None
    for line in sys.stdin:
        c = json.loads(line)
        out: dict = {"ok": True}
        try:
            if c["cmd"] == "alloc":
                shape, dt = tuple(c["shape"]), np.dtype(c["dtype"])
                if c.get("seed") is None:
                    arr = np.zeros(shape, dt)
                else:
                    rng = np.random.default_rng(c["seed"])
                    arr = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, np.uint8)
                    arr = arr.view(dt).reshape(shape)
                caches[c["name"]] = hixl.allocate_cache(
                    arr,
                    name=c["name"],
                    layer_axis=c.get("layer_axis", 0),
                    block_axis=c.get("block_axis", 2),
                )
            elif c["cmd"] == "bytes":
                out["hex"] = caches[c["name"]].array.tobytes().hex()
            elif c["cmd"] == "link":
                hixl.link(c["ranks"])
            elif c["cmd"] == "pull":
                hixl.pull_cache(c["rank"], caches[c["name"]])
            elif c["cmd"] == "receive":
                cache = caches[c["name"]]
                syncer = hixl.LayerSynchronizer(cache.num_layers)
                cfg = hixl.TransferConfig(timeout_ms=c.get("timeout_ms", 10_000))
                receiving = (hixl.receive_cache_async(c["rank"], cache, syncer, cfg), syncer)
            elif c["cmd"] == "received":
                assert receiving is not None
                task, syncer = receiving
                res = task.wait(60_000)
                out["arrived"] = [syncer.times["arrived"][k] for k in range(syncer.total_layers)]
                out["bytes"] = res.bytes
            elif c["cmd"] == "exit":
                hixl.finalize()
                print(json.dumps(out), flush=True)
                return
        except hixl.HixlError as exc:
            out = {"ok": False, "error": str(exc), "status_code": getattr(exc, "status_code", None)}
        out["t"] = time.monotonic()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
