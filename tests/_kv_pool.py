"""A KV rank holding paged pools (the other side of tests/test_kv_handoff.py), driven by
lines on stdin: a command word and a JSON object; each answer is one JSON line ({"ok":
true, ...} or {"ok": false, "error": ..., "status_code": ...}).

    python _kv_pool.py RANK ROLE  ->  "READY <address>"

  alloc    name, shape, block_axis, layers (a list of that many per-layer arrays) or
           layer_axis (one array), seed: a pool filled with pattern(shape, seed)
  link     rank, address: hixl.kv.link to that rank
  receive  rank, name, layers, request_id|null, timeout_ms: starts receive_cache_async
  done     request_id|null: whether that receive has ended, and its layers so far
  received request_id|null: waits for that receive; its bytes
  bytes    name: the pool's bytes as hex (a list's layers one after the other)
  exit
"""

from __future__ import annotations

import json
import sys

import numpy as np

import hixl


def pattern(shape: list[int], seed: int) -> np.ndarray:
    """float16 values of `shape` from `seed` (what the tests compare against)."""
    n = int(np.prod(shape)) * 2
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8).view(np.float16).reshape(shape)


def main() -> None:
    rank, role = int(sys.argv[1]), sys.argv[2]
    print(f"READY {hixl.kv.init(cluster_id=rank, role=role, listen='127.0.0.1:0').address}")
    sys.stdout.flush()
    pools: dict[str, hixl.kv.RegisteredCache] = {}
    recv: dict[str | None, tuple[hixl.kv.TransferTask, hixl.kv.LayerTracker]] = {}
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        c = json.loads(rest or "{}")
        out: dict = {"ok": True}
        try:
            if word == "alloc":
                if c.get("layers"):
                    arrs = [pattern(c["shape"], c["seed"] + k) for k in range(c["layers"])]
                    pools[c["name"]] = hixl.kv.allocate_cache(
                        arrs, name=c["name"], block_axis=c["block_axis"]
                    )
                else:
                    pools[c["name"]] = hixl.kv.allocate_cache(
                        pattern(c["shape"], c["seed"]),
                        name=c["name"],
                        layer_axis=c["layer_axis"],
                        block_axis=c["block_axis"],
                    )
            elif word == "link":
                hixl.kv.link(hixl.kv.PeerRank(c["rank"], address=c["address"]))
            elif word == "receive":
                syncer = hixl.kv.LayerTracker(c["layers"])
                cfg = hixl.kv.CacheTransferConfig(timeout_ms=c["timeout_ms"])
                pool = pools[c["name"]]
                task = hixl.kv.receive_cache_async(
                    c["rank"], pool, syncer, cfg, request_id=c["request_id"]
                )
                recv[c["request_id"]] = (task, syncer)
            elif word == "done":
                task, syncer = recv[c["request_id"]]
                out.update(done=task.is_done(), layers=syncer.get_layer_count())
            elif word == "received":
                out["bytes"] = recv[c["request_id"]][0].wait(60_000).bytes
            elif word == "bytes":
                arr = pools[c["name"]].array
                parts = arr if isinstance(arr, list) else [arr]
                out["hex"] = b"".join(a.tobytes() for a in parts).hex()
            elif word == "exit":
                hixl.kv.finalize()
                print(json.dumps(out), flush=True)
                return
        except hixl.HixlError as exc:
            out = {"ok": False, "error": str(exc), "status_code": getattr(exc, "status_code", None)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
