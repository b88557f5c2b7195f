"""A KV-cache rank in its own process, configured only by the environment (HIXL_CLUSTER_ID,
HIXL_ROLE, HIXL_LISTEN, HIXL_PEERS) and driven by JSON lines on stdin.

It calls a bare ``hixl.kv.init()`` and prints "READY <address>" (with HIXL_KV_DEFER_INIT=1 it
prints "READY -" and waits for an "init" command instead). Each command line is a JSON
object with "cmd"; each answer is one JSON line ({"ok": true, ...} or {"ok": false,
"error": ..., "status_code": ...}):
  init    at, cluster_id, role, listen, peers: waits until time.monotonic() >= at (so that
          several workers call it at the same instant), then hixl.kv.init(...); answers the
          ranks linked and link_ms, the time init took
  finalize: hixl.kv.finalize() (and forgets the caches); init may follow
  linked: the ranks this rank is linked to
  alloc   name, shape, dtype, seed|null, layer_axis, block_axis: allocate (random or zeros)
  bytes   name: the cache's bytes as hex
  digest  name: the sha256 of the cache's bytes
  link    ranks: hixl.kv.link(ranks)
  pull    rank, name, remote_name|null: pull_cache into the local cache of that name
  push    ranks, name, remote_name|null: push_cache of the local cache to every rank
  push_layers rank, name: transfer_cache_async(mode="push") of the local cache to `rank`,
          every layer marked ready at once; answers when it is done, with its bytes
  receive rank, name: start receive_cache_async; answers at once
  received: wait for the receive task; answers the monotonic arrival time of every layer
  progress: the layers the receive task counts as arrived so far, without waiting
  ranks   role|null: hixl.kv.ranks(role) as [rank, role, address] lists
  wait_ranks want, role|null, timeout_s: polls hixl.kv.ranks(role) until its ranks are exactly
          `want`; answers them and "at", the monotonic time they were (ok false on timeout)
  exit
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

import hixl
from hixl.kv._context import context


def main() -> None:
    if os.environ.get("HIXL_KV_DEFER_INIT") == "1":
        print("READY -", flush=True)
    else:
        print(f"READY {hixl.kv.init().address}", flush=True)
    caches: dict[str, hixl.kv.RegisteredCache] = {}
    receiving: tuple[hixl.kv.TransferTask, hixl.kv.LayerTracker] | None = None
    for line in sys.stdin:
        c = json.loads(line)
        out: dict = {"ok": True}
        try:
            if c["cmd"] == "init":
                while time.monotonic() < c["at"]:
                    time.sleep(0.0002)
                t0 = time.monotonic()
                hixl.kv.init(
                    cluster_id=c["cluster_id"],
                    role=c["role"],
                    listen=c["listen"],
                    peers={int(r): a for r, a in c["peers"].items()},
                )
                out["link_ms"] = (time.monotonic() - t0) * 1000
                out["linked"] = sorted(context().peers)
            elif c["cmd"] == "finalize":
                hixl.kv.finalize()
                caches.clear()
            elif c["cmd"] == "linked":
                out["linked"] = sorted(context().peers)
            elif c["cmd"] == "alloc":
                shape, dt = tuple(c["shape"]), np.dtype(c["dtype"])
                if c.get("seed") is None:
                    arr = np.zeros(shape, dt)
                else:
                    rng = np.random.default_rng(c["seed"])
                    arr = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, np.uint8)
                    arr = arr.view(dt).reshape(shape)
                caches[c["name"]] = hixl.kv.allocate_cache(
                    arr,
                    name=c["name"],
                    layer_axis=c.get("layer_axis", 0),
                    # The tests' paged shapes have blocks on axis 2; the others none.
                    block_axis=c.get("block_axis", 2 if len(shape) > 2 else None),
                )
            elif c["cmd"] == "bytes":
                out["hex"] = caches[c["name"]].array.tobytes().hex()
            elif c["cmd"] == "digest":
                out["sha256"] = hashlib.sha256(caches[c["name"]].array.tobytes()).hexdigest()
            elif c["cmd"] == "link":
                hixl.kv.link(c["ranks"])
            elif c["cmd"] == "pull":
                hixl.kv.pull_cache(c["rank"], caches[c["name"]], remote_name=c.get("remote_name"))
            elif c["cmd"] == "push":
                cfg = hixl.kv.CacheTransferConfig(max_concurrent=8)
                hixl.kv.push_cache(c["ranks"], caches[c["name"]], cfg, c.get("remote_name"))
            elif c["cmd"] == "push_layers":
                cache = caches[c["name"]]
                syncer = hixl.kv.LayerTracker(cache.num_layers)
                task = hixl.kv.transfer_cache_async(c["rank"], cache, syncer, mode="push")
                for k in range(cache.num_layers):
                    syncer.layer_ready(k)
                out["bytes"] = task.wait(60_000).bytes
            elif c["cmd"] == "receive":
                cache = caches[c["name"]]
                syncer = hixl.kv.LayerTracker(cache.num_layers)
                cfg = hixl.kv.CacheTransferConfig(timeout_ms=c.get("timeout_ms", 10_000))
                receiving = (hixl.kv.receive_cache_async(c["rank"], cache, syncer, cfg), syncer)
            elif c["cmd"] == "received":
                assert receiving is not None
                task, syncer = receiving
                res = task.wait(60_000)
                out["arrived"] = [syncer.times["arrived"][k] for k in range(syncer.total_layers)]
                out["bytes"] = res.bytes
            elif c["cmd"] == "progress":
                assert receiving is not None
                out["layers"] = receiving[1].get_layer_count()
                out["done"] = receiving[0].is_done()
            elif c["cmd"] == "ranks":
                out["ranks"] = [
                    [i.cluster_id, i.role, i.address] for i in hixl.kv.ranks(c.get("role"))
                ]
            elif c["cmd"] == "wait_ranks":
                deadline = time.monotonic() + c["timeout_s"]
                while True:
                    got = sorted(i.cluster_id for i in hixl.kv.ranks(c.get("role")))
                    if got == sorted(c["want"]) or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                out = {"ok": got == sorted(c["want"]), "ranks": got, "at": time.monotonic()}
            elif c["cmd"] == "exit":
                hixl.kv.finalize()
                print(json.dumps(out), flush=True)
                return
        except hixl.HixlError as exc:
            out = {"ok": False, "error": str(exc), "status_code": getattr(exc, "status_code", None)}
        out["t"] = time.monotonic()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
