"""Block ids: checked lists of them, and the bytes of a list of blocks in two caches (what
pull_blocks, push_blocks and a layerwise transfer of a request's blocks move)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ParamInvalid
from .._kvcore._cache import block_pairs
from .._kvcore._plan import Pieces, block_runs
from .._peertext import shown
from ._cache import CacheInfo


def _ids(v: Any, what: str) -> list[int]:
    """`v` (a list, tuple, range or integer numpy array of block ids) as ints; ParamInvalid
    naming the first item that is no int (a bool, a float, a string) or `v` itself."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise ParamInvalid(f"{what} has dtype {v.dtype}: block ids are integers")
        return [int(b) for b in v.ravel()]
    if isinstance(v, (str, bytes, dict)) or not hasattr(v, "__iter__"):
        raise ParamInvalid(f"{what}={shown(v)} is not a list of block ids")
    out = []
    for i, b in enumerate(v):
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)):
            raise ParamInvalid(f"{what}[{i}]={shown(b)} is not a block id (an int)")
        out.append(int(b))
    return out


def _block_ids(
    local_blocks: Any, remote_blocks: Any, names: tuple[str, str] = ("local", "remote")
) -> tuple[list[int], list[int]]:
    """The block id lists as ints, checked to be of one length (before any link is used);
    `names` say which is which in the errors."""
    lb = _ids(local_blocks, f"{names[0]} block ids")
    rb = _ids(remote_blocks, f"{names[1]} block ids")
    if len(lb) != len(rb):
        raise ParamInvalid(f"{len(rb)} {names[1]} block ids but {len(lb)} {names[0]} ones")
    return lb, rb


def check_block_range(info: CacheInfo, ids: list[int], side: str) -> None:
    """ParamInvalid naming the first id of `ids` that is no block of `info`."""
    n = info.num_blocks
    bad = [b for b in ids if not 0 <= b < n]
    if bad:
        raise ParamInvalid(
            f"{side} block id {bad[0]} is out of range 0..{n - 1} (cache {info.name!r})"
        )


def block_pieces(local: CacheInfo, remote: CacheInfo, lb: list[int], rb: list[int]) -> list[Pieces]:
    """Local blocks `lb` and remote blocks `rb` (checked lists of one length) as byte offset
    triples (local, remote, length), one list per contiguous piece of a block (layer x K/V
    for the usual layouts): runs of consecutive ids on both sides are one triple. ParamInvalid
    for an id out of range or blocks that differ in size."""
    for side, info, ids in (("local", local, lb), ("remote", remote, rb)):
        check_block_range(info, ids, side)
    if (local.block_bytes, local.block_pieces()) != (remote.block_bytes, remote.block_pieces()):
        raise ParamInvalid(
            f"blocks differ: local {local.name!r} (shape {local.shape}, block_axis="
            f"{local.block_axis}) has {local.block_pieces()} x {local.block_bytes} bytes per "
            f"block, remote {remote.name!r} (shape {remote.shape}, block_axis="
            f"{remote.block_axis}) {remote.block_pieces()} x {remote.block_bytes}: both sides "
            "must allocate_cache with the same layout= (or layer_axis= and block_axis=)"
        )
    per = len(block_runs(lb, rb))
    flat = block_pairs(local.geometry, remote.geometry, lb, rb)
    return [flat[i : i + per] for i in range(0, len(flat), per)] if per else []
