"""The prefill worker of the README's KV-cache example (rank 0, role "prompt").

Links to the decode worker (examples/kv_decode.py, started first, prints its address) and
pushes the request's KV cache to it layer by layer: layer k is sent the moment it has been
computed, while the next one is being computed.

    python examples/kv_decode.py --listen 127.0.0.1:18101    # first; wait for its READY line
    python examples/kv_prefill.py --decode 127.0.0.1:18101   # then, in another shell

Exits 0 when every layer has landed in the decode worker's cache "kv", 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import hixl


def layout(args: argparse.Namespace) -> hixl.KVLayout:
    # Both workers must use the same layout (the push checks that the shapes match).
    return hixl.KVLayout(
        num_layers=args.layers,
        num_kv_heads=8,
        head_dim=128,
        dtype="float16",
        block_tokens=16,
        num_blocks=args.blocks,
    )


def computed_layer(lay: hixl.KVLayout, k: int, seed: int) -> np.ndarray:
    """What prefill computes for layer k: (K/V, blocks, tokens, heads, head_dim) values."""
    rng = np.random.default_rng([seed, k])
    return rng.standard_normal((*lay.shape[1:-1], lay.head_dim)).astype(lay.dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", required=True, help="the decode worker's ip:port (rank 1)")
    p.add_argument("--listen", default="127.0.0.1:0", help="ip:port to listen on (port 0: any)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=32, help="cache blocks of 16 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0, help="link and transfer timeout")
    args = p.parse_args()
    ms = int(args.timeout_s * 1000)

    # Links to every rank in peers (retrying while it starts) and checks its role.
    hixl.kv.init(
        cluster_id=0, role="prompt", listen=args.listen, peers={1: args.decode}, link_timeout_ms=ms
    )
    try:
        lay = layout(args)
        cache = hixl.kv.allocate_cache(lay.array(), name="kv", layout=lay)
        syncer = hixl.kv.LayerTracker(total_layers=lay.num_layers)
        cfg = hixl.kv.CacheTransferConfig(timeout_ms=ms)
        # Pushes into rank 1's cache of the same name ("kv"), each layer once it is ready.
        task = hixl.kv.transfer_cache_async(1, cache, syncer, mode="push", transfer_config=cfg)
        for k in range(lay.num_layers):
            time.sleep(0.01)  # computing layer k ...
            cache.array[k, ..., : lay.head_dim] = computed_layer(lay, k, args.seed)
            syncer.layer_ready(k)  # ... its transfer starts now
            print(f"layer {k}: computed, sending", flush=True)
        res = task.wait(timeout_ms=ms)  # raises the task's KVError if it failed
        print(
            f"pushed {res.bytes} bytes in {lay.num_layers} layers to rank 1 "
            f"in {res.elapsed_s * 1000:.1f} ms"
        )
    finally:
        hixl.kv.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
