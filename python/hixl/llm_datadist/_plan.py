"""How a cache operation's bytes are laid out: which tensor goes to which, and the (source
offset, destination offset, length) pieces of batch entries and blocks, turned into (source
address, destination address, length) triples. Pure functions over CacheDesc; a bad argument
raises LLMException (LLM_PARAM_INVALID).
"""

from __future__ import annotations

from typing import Any

from .._kvcore._cache import block_pairs
from ._status import check
from ._types import CacheDesc, check_int, check_layer_range

Offsets = list[tuple[int, int, int]]  # (source offset, destination offset, length)


def _tensor_pairs(
    n_src: int, n_dst: int, src_range: Any, dst_range: Any, tpl: int
) -> list[tuple[int, int]]:
    """(source tensor, destination tensor) for the layer ranges (None: every layer)."""
    tpl = check_int("tensor_num_per_layer", tpl, 1, 2**32 - 1)
    src_range = check_layer_range("src_layer_range", src_range)
    dst_range = check_layer_range("dst_layer_range", dst_range)
    if src_range is None and dst_range is None:
        check(n_src == n_dst, f"source has {n_src} tensors, destination {n_dst}")
        return [(i, i) for i in range(n_src)]
    src_range = src_range or range(0, n_src // tpl)
    dst_range = dst_range or range(0, n_dst // tpl)
    check(
        len(src_range) == len(dst_range),
        f"src_layer_range={src_range} and dst_layer_range={dst_range} differ in length",
    )
    out = []
    for s, d in zip(src_range, dst_range, strict=True):
        for t in range(tpl):
            si, di = s * tpl + t, d * tpl + t
            check(si < n_src, f"source layer {s} is out of range ({n_src} tensors, {tpl} a layer)")
            check(di < n_dst, f"destination layer {d} is out of range ({n_dst} tensors)")
            out.append((si, di))
    return out


def _entry(desc: CacheDesc, index: int, what: str) -> list[tuple[int, int]]:
    check_int(f"{what} batch index", index, 0, 2**32 - 1)
    check(
        index < desc.batch_size,
        f"{what} batch index {index} is out of range (batch size {desc.batch_size})",
    )
    return desc.batch_pieces(index)


def _entry_offsets(src: CacheDesc, sb: int, dst: CacheDesc, db: int, size: int) -> Offsets:
    """One batch entry of each tensor: source entry `sb` into destination entry `db`; `size`
    bytes of it (-1: all of the source entry, which must fit)."""
    sp, dp = _entry(src, sb, "source"), _entry(dst, db, "destination")
    check(
        len(sp) == len(dp),
        f"batch entries differ in layout (source {src!r}, destination {dst!r})",
    )
    check(size == -1 or (size > 0 and len(sp) == 1), f"size={size} must be -1 or > 0")
    out = []
    for (so, sn), (do, dn) in zip(sp, dp, strict=True):
        n = sn if size == -1 else size
        check(n <= sn, f"size={n} is larger than a source batch entry ({sn} bytes)")
        check(n <= dn, f"{n} bytes do not fit in a destination batch entry ({dn} bytes)")
        out.append((so, do, n))
    return out


def _block_bytes(desc: CacheDesc, what: str) -> int:
    pieces = desc.batch_pieces(0)
    check(len(pieces) == 1, f"{what}: blocks must be the first dimension ({desc!r})")
    return pieces[0][1]


def _block_offsets(src: CacheDesc, sbl: list[int], dst: CacheDesc, dbl: list[int]) -> Offsets:
    check(len(sbl) == len(dbl), f"{len(sbl)} source blocks but {len(dbl)} destination blocks")
    sbb, dbb = _block_bytes(src, "source"), _block_bytes(dst, "destination")
    check(sbb == dbb, f"block sizes differ: source {sbb} bytes, destination {dbb}")
    for what, desc, ids in (("source", src, sbl), ("destination", dst, dbl)):
        bad = [b for b in ids if b >= desc.batch_size]
        check(not bad, f"{what} block {bad[:1]} is out of range (blocks: {desc.batch_size})")
    return block_pairs(src.geometry, dst.geometry, sbl, dbl)  # one piece a block each


def _entry_to_blocks(src: CacheDesc, sb: int, dst: CacheDesc, dbl: list[int]) -> Offsets:
    """A plain cache's batch entry cut into the destination's blocks, in order (as much of
    it as the blocks hold)."""
    sp = _entry(src, sb, "source")
    check(len(sp) == 1, f"source batch entries must be contiguous ({src!r})")
    (so, sn), dbb = sp[0], _block_bytes(dst, "destination")
    bad = [b for b in dbl if b >= dst.batch_size]
    check(not bad, f"destination block {bad[:1]} is out of range (blocks: {dst.batch_size})")
    out = []
    for j, b in enumerate(dbl):
        n = min(dbb, sn - j * dbb)
        if n <= 0:
            break
        out.append((so + j * dbb, b * dbb, n))
    return out


def _pairs(
    tensors: list[tuple[int, int]], src_addrs: list[int], dst_addrs: list[int], offs: Offsets
) -> list[tuple[int, int, int]]:
    """(source address, destination address, length) of every piece."""
    return [(src_addrs[s] + so, dst_addrs[d] + do, n) for s, d in tensors for so, do, n in offs]


def _flip(p: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [(d, s, n) for s, d, n in p]
