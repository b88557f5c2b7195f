"""The KV core's planner primitives: how a face's cache operation becomes the (local
address, remote address, length) triples of engine requests. Pure functions; each face
checks its own arguments (and raises its own errors) before it calls them.
"""

from __future__ import annotations

import numpy as np

#: (source, destination, length) triples: byte offsets or addresses.
Pieces = list[tuple[int, int, int]]


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count): consecutive ids on both sides become one run."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def run_bytes(
    runs: list[tuple[int, int, int]], block_bytes: int, src_base: int = 0, dst_base: int = 0
) -> Pieces:
    """Runs of blocks of `block_bytes` each as byte triples from `src_base` / `dst_base`."""
    return [
        (src_base + s * block_bytes, dst_base + d * block_bytes, n * block_bytes)
        for s, d, n in runs
    ]


def split(pairs: Pieces, parts: int) -> list[Pieces]:
    """`pairs` cut into at most `parts` requests of consecutive pieces (none when empty)."""
    per = -(-len(pairs) // max(1, parts))
    return [pairs[i : i + per] for i in range(0, len(pairs), per)]


def descs(pairs: Pieces) -> np.ndarray:
    """(local address, remote address, length) triples as the engine's descriptor array."""
    return np.array(pairs, dtype=np.uint64).reshape(-1, 3)
