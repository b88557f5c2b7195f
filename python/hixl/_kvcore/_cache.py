"""The KV core's cache model: the byte geometry both KV faces' caches have.

A cache is one or more tensors of one `shape` and element size, each at its own address
(``hixl.kv``: one array; ``hixl.llm_datadist``: ``num_tensors`` tensors). An index along an
axis (a layer along the layer axis, a block along the block axis, a batch entry along the
batch axis) occupies ``prod(shape[:axis])`` contiguous pieces of ``prod(shape[axis + 1:])``
elements in each tensor, ``shape[axis]`` such lengths apart. Faces keep their own classes
and errors; this module raises hixl's ParamInvalid only for indices out of range.

A cache's tensors are registered with the engine, one region each; ``register_tensors``
and ``deregister`` are how both faces make and drop those regions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._errors import HixlError, ParamInvalid
from .._hixl import MemDesc, MemHandle
from ._plan import Pieces, block_runs, run_bytes


def axis_pieces(
    shape: tuple[int, ...], itemsize: int, axis: int, index: int
) -> list[tuple[int, int]]:
    """(byte offset, length) of the contiguous pieces of `index` along `axis` in one tensor."""
    inner = math.prod(shape[axis + 1 :]) * itemsize
    step = shape[axis] * inner
    return [(o * step + index * inner, inner) for o in range(math.prod(shape[:axis]))]


@dataclass(frozen=True)
class Geometry:
    """One tensor's layout: its `shape`, element size, and which axes hold the layers and
    the blocks (None: not an axis of the tensor)."""

    shape: tuple[int, ...]
    itemsize: int
    layer_axis: int | None = None
    block_axis: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of one tensor."""
        return math.prod(self.shape) * self.itemsize

    @property
    def num_layers(self) -> int:
        assert self.layer_axis is not None
        return self.shape[self.layer_axis]

    def layer_ranges(self, layer: int) -> list[tuple[int, int]]:
        """(byte offset, length) of every contiguous piece of one layer."""
        if not 0 <= layer < self.num_layers:
            raise ParamInvalid(f"layer={layer} is out of range 0..{self.num_layers - 1}")
        assert self.layer_axis is not None
        return axis_pieces(self.shape, self.itemsize, self.layer_axis, layer)

    @property
    def num_blocks(self) -> int:
        assert self.block_axis is not None
        return self.shape[self.block_axis]

    @property
    def block_bytes(self) -> int:
        """Bytes of one contiguous piece of a block."""
        assert self.block_axis is not None
        return math.prod(self.shape[self.block_axis + 1 :]) * self.itemsize

    @property
    def block_pieces(self) -> int:
        """Contiguous pieces of one block: one per index of the axes before the block axis."""
        assert self.block_axis is not None
        return math.prod(self.shape[: self.block_axis])

    @property
    def block_stride(self) -> int:
        """Bytes from one piece of a block to its next piece."""
        return self.num_blocks * self.block_bytes


def block_pairs(
    src: Geometry,
    dst: Geometry,
    src_ids: list[int],
    dst_ids: list[int],
    src_base: int = 0,
    dst_base: int = 0,
) -> Pieces:
    """(source, destination, length) of blocks `src_ids` into blocks `dst_ids` (ids checked
    by the caller; both of one block layout), every piece of them: runs of consecutive ids
    on both sides are one piece, from `src_base` / `dst_base`."""
    runs, bb = block_runs(src_ids, dst_ids), src.block_bytes
    return [
        x
        for p in range(src.block_pieces)
        for x in run_bytes(
            runs, bb, src_base + p * src.block_stride, dst_base + p * dst.block_stride
        )
    ]


def register_tensors(
    engine: Any, addrs: Iterable[int], nbytes: int, access: str
) -> list[MemHandle]:
    """Registers `nbytes` at each of `addrs` (one region a tensor, peers' `access` "rw" or
    "r") and returns the handles; on a failure those made already are dropped again and the
    engine's HixlError is raised."""
    out: list[MemHandle] = []
    try:
        for a in addrs:
            out.append(engine.register_mem(MemDesc(a, nbytes), access=access))
    except BaseException:
        deregister(engine, out)
        raise
    return out


def deregister(engine: Any, handles: Iterable[MemHandle], quiet: bool = True) -> None:
    """Drops the regions of `handles`; with `quiet`, an engine finalized already (or any
    HixlError) is no error."""
    for h in handles:
        try:
            engine.deregister_mem(h)
        except HixlError:
            if not quiet:
                raise
