"""Memory helpers for real layouts: aligned numpy buffers and a paged KV-cache layout."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ParamInvalid
from ._hixl import StridedDesc

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def aligned_empty(
    shape: int | tuple[int, ...], dtype: Any = "uint8", alignment: int = 4096
) -> np.ndarray:
    """An uninitialized numpy array whose data starts on an `alignment`-byte boundary.

    numpy's own allocations are often only 16-byte aligned; strided transfers need bases that
    are multiples of 64 bytes (see ``hixl.strict_alignment``).

    Args:
        shape: an int or a tuple of non-negative ints, as for ``numpy.empty``.
        dtype: any numpy dtype (default ``"uint8"``).
        alignment: a power of two, in bytes (default 4096).

    Returns a C-contiguous, writable array (a view of a slightly larger buffer, which it keeps
    alive); register it with ``Hixl.register``. Raises ``ParamInvalid`` for an alignment that
    is not a positive power of two or a shape that is not non-negative ints.
    """
    import numpy as np

    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ParamInvalid(f"alignment={alignment!r} must be a positive power of two")
    dt = np.dtype(dtype)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in dims):
        raise ParamInvalid(f"shape={shape!r} must hold non-negative ints")
    nbytes = math.prod(dims) * dt.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    off = (-raw.ctypes.data) % alignment
    return raw[off : off + nbytes].view(dt).reshape(dims)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache laid out as (layers, 2 [K, V], blocks, block_tokens, kv_heads, head row).

    Each head row holds ``head_dim`` values and is padded to a power of two of at least 64
    bytes (head_dim 96 in float16: 192 bytes used, stride 256), so every row starts on a
    64-byte boundary. The descriptors move only the used bytes of each row, never the padding.

    ``KVLayout(num_layers, num_kv_heads, head_dim, dtype, block_tokens, num_blocks)``: every
    count a positive int (``ParamInvalid`` otherwise), ``dtype`` any numpy dtype. It is a
    frozen dataclass that only computes offsets: ``array()``/``empty()`` allocate, the
    ``*_desc`` methods return ``(byte offset, StridedDesc)`` to add to both registered bases,
    and raise ``ParamInvalid`` for a layer, head or block out of range. Also ``hixl.kv.KVLayout``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    block_tokens: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "num_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ParamInvalid(f"{name}={v!r} must be a positive int")

    @property
    def itemsize(self) -> int:
        """Bytes of one ``dtype`` element."""
        import numpy as np

        return int(np.dtype(self.dtype).itemsize)

    @property
    def head_bytes(self) -> int:
        """Used bytes of one head row."""
        return self.head_dim * self.itemsize

    @property
    def head_stride(self) -> int:
        """Bytes from one head row to the next (padded)."""
        return max(64, _next_pow2(self.head_bytes))

    @property
    def token_stride(self) -> int:
        """Bytes from one token to the next (all KV heads of it, padded rows)."""
        return self.num_kv_heads * self.head_stride

    @property
    def block_stride(self) -> int:
        """Bytes from one block to the next (``block_tokens`` tokens)."""
        return self.block_tokens * self.token_stride

    @property
    def kv_stride(self) -> int:
        """Bytes from a layer's K half to its V half (all blocks)."""
        return self.num_blocks * self.block_stride

    @property
    def layer_stride(self) -> int:
        """Bytes from one layer to the next (K and V)."""
        return 2 * self.kv_stride

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache, padding included."""
        return self.num_layers * self.layer_stride

    def rows_per_layer(self) -> int:
        """Head rows in one layer: 2 (K, V) x blocks x block_tokens x kv_heads."""
        return 2 * self.num_blocks * self.block_tokens * self.num_kv_heads

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(layers, 2, blocks, block_tokens, kv_heads, padded head row) in ``dtype`` elements."""
        row = self.head_stride // self.itemsize
        return (self.num_layers, 2, self.num_blocks, self.block_tokens, self.num_kv_heads, row)

    def array(self, alignment: int = 4096) -> np.ndarray:
        """A zeroed, aligned array of ``shape`` and ``dtype``: what ``hixl.kv.allocate_cache``
        takes (layer axis 0, block axis 2). ``[..., :head_dim]`` is the used part of a row."""
        import numpy as np

        out = self.empty(alignment).view(np.dtype(self.dtype)).reshape(self.shape)
        out[...] = 0
        return out

    def empty(self, alignment: int = 4096) -> np.ndarray:
        """An aligned uint8 buffer of ``nbytes`` (uninitialized)."""
        return aligned_empty(self.nbytes, "uint8", alignment)

    def layer_desc(self, layer: int) -> tuple[int, StridedDesc]:
        """(byte offset, descriptor) moving every head row of one layer in one strided call."""
        self._check("layer", layer, self.num_layers)
        desc = StridedDesc(self.rows_per_layer(), self.head_bytes, self.head_stride)
        return layer * self.layer_stride, desc

    def head_desc(self, layer: int, head: int) -> tuple[int, StridedDesc]:
        """(byte offset, descriptor) for one head of one layer (what a per-head loop sends)."""
        self._check("layer", layer, self.num_layers)
        self._check("head", head, self.num_kv_heads)
        count = 2 * self.num_blocks * self.block_tokens
        desc = StridedDesc(count, self.head_bytes, self.token_stride)
        return layer * self.layer_stride + head * self.head_stride, desc

    def block_descs(
        self, blocks: npt.ArrayLike, layers: range | None = None
    ) -> list[tuple[int, StridedDesc]]:
        """(offset, descriptor) pairs moving the listed blocks, K and V, for each layer (all by
        default). Runs of consecutive block ids become one descriptor each."""
        import numpy as np

        ids = [int(b) for b in np.asarray(blocks).ravel()]
        for b in ids:
            self._check("block", b, self.num_blocks)
        runs: list[tuple[int, int]] = []
        for b in ids:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((b, 1))
        rows_per_block = self.block_tokens * self.num_kv_heads
        out = []
        for layer in layers if layers is not None else range(self.num_layers):
            for kv in (0, 1):
                for start, n in runs:
                    off = (
                        layer * self.layer_stride + kv * self.kv_stride + start * self.block_stride
                    )
                    out.append(
                        (off, StridedDesc(n * rows_per_block, self.head_bytes, self.head_stride))
                    )
        return out

    @staticmethod
    def _check(name: str, v: int, n: int) -> None:
        if not isinstance(v, int) or not 0 <= v < n:
            raise ParamInvalid(f"{name}={v!r} is out of range 0..{n - 1}")
