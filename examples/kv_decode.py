"""The decode worker of the README's KV-cache example (rank 1, role "decoder").

Start it first: it allocates the cache "kv", starts following the prefill worker's layerwise
push, and prints "READY ip:port". Then start examples/kv_prefill.py with that address:

    python examples/kv_decode.py --listen 127.0.0.1:18101    # first; wait for its READY line
    python examples/kv_prefill.py --decode 127.0.0.1:18101   # then, in another shell

It "decodes" each layer (here: checks its values) as soon as that layer has arrived, while
the later layers are still being computed and sent. Exits 0 when every layer holds what the
prefill worker computed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

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
    p.add_argument("--listen", default="127.0.0.1:0", help="ip:port to listen on (port 0: any)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=32, help="cache blocks of 16 tokens")
    p.add_argument("--seed", type=int, default=0, help="the prefill worker's seed")
    p.add_argument("--timeout-s", type=float, default=30.0, help="longest wait for a layer")
    args = p.parse_args()
    ms = int(args.timeout_s * 1000)

    me = hixl.kv.init(cluster_id=1, role="decoder", listen=args.listen)
    try:
        lay = layout(args)
        # Peers address it as "kv"; layout= says where its layers and blocks are.
        cache = hixl.kv.allocate_cache(lay.array(), name="kv", layout=lay)
        syncer = hixl.kv.LayerTracker(total_layers=lay.num_layers)
        # Counts layer k as present when rank 0's notification for it arrives, which its
        # engine sends only after the layer's bytes are here.
        cfg = hixl.kv.CacheTransferConfig(timeout_ms=ms)
        task = hixl.kv.receive_cache_async(0, cache, syncer, cfg)
        print(f"READY {me.address}", flush=True)

        for k in range(lay.num_layers):
            syncer.wait_layer(k, timeout_ms=ms)  # raises the transfer's error if it failed
            layer = cache.array[k]  # use layer k: here, check it
            if not np.array_equal(layer[..., : lay.head_dim], computed_layer(lay, k, args.seed)):
                print(f"layer {k} does not hold what prefill computed", file=sys.stderr)
                return 1
            print(f"layer {k}: arrived and used ({layer.nbytes} bytes)", flush=True)
        res = task.wait(timeout_ms=ms)
        print(f"received {res.bytes} bytes in {lay.num_layers} layers from rank 0")
    finally:
        hixl.kv.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
