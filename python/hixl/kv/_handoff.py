"""A request's handoff between two paged pools: a layerwise transfer of only a request's
blocks (``transfer_cache_async(..., src_blocks=, dst_blocks=, request_id=)``), block ids
remapped on the way, each layer's notification naming the request so that the receiver's
``receive_cache_async(..., request_id=)`` counts that request's layers only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._errors import HixlError, ParamInvalid
from .._kvcore._plan import Pieces
from ._blocks import _block_ids, block_pieces, check_block_range
from ._cache import CacheInfo, RegisteredCache, addr_pairs
from ._notes import request_text
from ._transfer import as_llm_error


@dataclass(frozen=True)
class Handoff:
    """The checked arguments of a request's layerwise transfer: the local and remote block
    ids (pairwise: local[i] moves to or from remote[i]) and the request id (or None)."""

    local: list[int]
    remote: list[int]
    request_id: str | None


def check_handoff(
    mode: str, cache: RegisteredCache, src_blocks: Any, dst_blocks: Any, request_id: Any
) -> Handoff | None:
    """The arguments a layerwise transfer adds to a whole-cache one, checked before anything
    runs (None when neither is given: the whole cache moves). A KVError (PARAM_INVALID,
    status_code "103900") names the value when the block lists are not both given, not
    lists of ints, of different lengths, empty, or name a block outside the local cache;
    or when the request id is no short printable string, or given for a pull (which sends
    no notification)."""
    try:
        rid = None if request_id is None else request_text(request_id)
        if rid is not None and mode != "push":
            raise ParamInvalid(
                f"request_id={rid!r} names the layer notifications of a push; a pull sends none"
            )
        if src_blocks is None and dst_blocks is None:
            return None if rid is None else Handoff([], [], rid)
        if src_blocks is None or dst_blocks is None:
            given, missing = ("src", "dst") if dst_blocks is None else ("dst", "src")
            raise ParamInvalid(f"{given}_blocks was given without {missing}_blocks: give both")
        src, dst = _block_ids(src_blocks, dst_blocks, ("src", "dst"))
        if not src:
            raise ParamInvalid("src_blocks and dst_blocks are empty: no block to move")
        local, remote = (src, dst) if mode == "push" else (dst, src)
        check_block_range(cache.info, local, "src" if mode == "push" else "dst")
    except HixlError as exc:
        raise as_llm_error(exc, f"layerwise {mode}") from exc
    return Handoff(local, remote, rid)


def layer_groups(
    local: CacheInfo, remote: CacheInfo, h: Handoff, groups: int, per: int, push: bool
) -> list[Pieces]:
    """The (local address, remote address, length) triples of the handoff's blocks in each
    of `groups` synchronizer layers (cache layers g*per .. g*per+per-1). ParamInvalid when
    a remote id is out of range, the blocks differ in size, or the caches do not hold their
    layers alike before the block axis (each block piece must lie in one layer)."""
    check_block_range(remote, h.remote, "dst" if push else "src")
    la, ba = local.layer_axis, local.block_axis
    assert ba is not None  # check_block_range needs it
    if la > ba or (la, local.shape[:ba]) != (remote.layer_axis, remote.shape[: remote.block_axis]):
        raise ParamInvalid(
            f"a layerwise block transfer needs the layer axis before the block axis and the "
            f"axes up to the block axis alike: local {local.name!r} has shape {local.shape} "
            f"(layer_axis={la}, block_axis={ba}), remote {remote.name!r} {remote.shape} "
            f"(layer_axis={remote.layer_axis}, block_axis={remote.block_axis})"
        )
    inner, layers = math.prod(local.shape[la + 1 : ba]), local.shape[la]
    out: list[Pieces] = [[] for _ in range(groups)]
    for p, pieces in enumerate(block_pieces(local, remote, h.local, h.remote)):
        out[(p // inner) % layers // per] += pieces
    return [addr_pairs(local, remote, sorted(g)) for g in out]
