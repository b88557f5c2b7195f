"""A registered KV cache: its geometry (layers, blocks) and the byte ranges they occupy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import ParamInvalid
from .._hixl import MemHandle
from .._kvcore._cache import Geometry
from .._kvcore._plan import Pieces
from .._kvcore._plan import block_runs as block_runs


@dataclass(frozen=True)
class CacheInfo:
    """What peers know of a cache: name, shape, dtype, address and the axes that matter."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    addr: int
    nbytes: int
    layer_axis: int
    block_axis: int | None
    #: A cache of one tensor per layer (vLLM's): each layer's address, in layer order. Its
    #: ``shape`` is then (layers, *one layer's shape) with layer_axis 0, and a byte offset
    #: ``o`` of the whole is ``layer_addrs[o // layer_bytes] + o % layer_bytes``; ``addr`` is
    #: layer 0's. Empty for a cache of one tensor.
    layer_addrs: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "addr": self.addr,
            "nbytes": self.nbytes,
            "layer_axis": self.layer_axis,
            "block_axis": self.block_axis,
        }
        if self.layer_addrs:
            out["layer_addrs"] = list(self.layer_addrs)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheInfo:
        return cls(
            str(d["name"]),
            tuple(int(x) for x in d["shape"]),
            str(d["dtype"]),
            int(d["addr"]),
            int(d["nbytes"]),
            int(d["layer_axis"]),
            None if d["block_axis"] is None else int(d["block_axis"]),
            tuple(int(a) for a in d.get("layer_addrs", ())),
        )

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of a cache of one tensor per layer (the whole otherwise)."""
        return self.nbytes // len(self.layer_addrs) if self.layer_addrs else self.nbytes

    def locate(self, offset: int) -> tuple[int, int]:
        """The address of byte `offset` of the cache and how many bytes from there on are
        contiguous (to the end of its layer's tensor, or of the cache)."""
        if not 0 <= offset < self.nbytes:
            raise ParamInvalid(f"offset {offset} is outside cache {self.name!r} ({self.nbytes} B)")
        if not self.layer_addrs:
            return self.addr + offset, self.nbytes - offset
        k, o = divmod(offset, self.layer_bytes)
        return self.layer_addrs[k] + o, self.layer_bytes - o

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    @property
    def geometry(self) -> Geometry:
        """Its byte geometry in the KV core's model (one tensor)."""
        return Geometry(self.shape, self.itemsize, self.layer_axis, self.block_axis)

    @property
    def num_layers(self) -> int:
        return self.shape[self.layer_axis]

    def layer_ranges(self, layer: int) -> list[tuple[int, int]]:
        """(byte offset, length) of every contiguous piece of one layer: one piece when the
        layer axis is the first, one per index of the axes before it otherwise."""
        return self.geometry.layer_ranges(layer)

    @property
    def num_blocks(self) -> int:
        if self.block_axis is None:
            raise ParamInvalid(
                f"cache {self.name!r} has no block axis (shape {self.shape}, block_axis=None)"
            )
        return self.shape[self.block_axis]

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    def block_pieces(self) -> int:
        """Contiguous pieces of one block: one per index of the axes before the block axis
        (layers x K/V for the usual paged layout)."""
        return self.geometry.block_pieces


@dataclass(eq=False)
class RegisteredCache:
    """A KV cache registered with the process's engine (zero copy: the caller's memory).

    ``name`` is how peers address it; ``layer_ranges(k)`` are the byte ranges of layer k.
    A cache given as a list of per-layer tensors has ``array`` that list and one engine
    region (handle) a layer."""

    info: CacheInfo
    array: Any = field(repr=False)
    handles: tuple[MemHandle, ...] = field(repr=False)

    @property
    def handle(self) -> MemHandle:
        """The engine region of the cache (of its first layer for a list of layers)."""
        return self.handles[0]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.info.dtype)

    @property
    def num_layers(self) -> int:
        return self.info.num_layers

    @property
    def addr(self) -> int:
        return self.info.addr

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def layer_ranges(self, layer: int) -> list[tuple[int, int]]:
        return self.info.layer_ranges(layer)


def addr_pairs(src: CacheInfo, dst: CacheInfo, pieces: Pieces) -> Pieces:
    """(source, destination, length) byte offsets of two caches as addresses, a piece cut
    where either side's memory stops being contiguous (a layer's tensor ends)."""
    if not src.layer_addrs and not dst.layer_addrs:
        return [(src.addr + s, dst.addr + d, n) for s, d, n in pieces]
    out: Pieces = []
    for s, d, n in pieces:
        while n > 0:
            (sa, sn), (da, dn) = src.locate(s), dst.locate(d)
            m = min(n, sn, dn)
            out.append((sa, da, m))
            s, d, n = s + m, d + m, n - m
    return out


def as_array(obj: Any) -> np.ndarray:
    """A numpy view of `obj` (numpy array, torch CPU tensor, or any writable buffer)."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif hasattr(obj, "data_ptr") and hasattr(obj, "device"):
        if getattr(obj.device, "type", "cpu") != "cpu":
            raise ParamInvalid(
                f"tensor on device {obj.device}: allocate_cache(..., mem_type='device') "
                "registers device memory"
            )
        arr = obj.detach().numpy() if hasattr(obj, "detach") else obj.numpy()
    else:
        try:
            arr = np.frombuffer(memoryview(obj), np.uint8)
        except TypeError as exc:
            raise ParamInvalid(
                f"cache of type {type(obj).__name__} is not an array, tensor or buffer"
            ) from exc
    if not arr.flags.c_contiguous:
        raise ParamInvalid(f"cache array of shape {arr.shape} is not C-contiguous")
    if arr.nbytes == 0:
        raise ParamInvalid("cache array is empty (0 bytes)")
    return arr


@dataclass(frozen=True)
class DeviceArray:
    """What the KV layer needs of a device array (torch CUDA tensor, CuPy array, anything with
    the CUDA Array Interface): its shape, dtype and memory. ``obj`` is what gets registered."""

    obj: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    addr: int
    nbytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def as_device_array(obj: Any) -> DeviceArray:
    """`obj` as a C-contiguous device array, read from its `__cuda_array_interface__` (no
    torch or CuPy import)."""
    try:
        cai = obj.__cuda_array_interface__
    except (AttributeError, RuntimeError) as exc:
        raise ParamInvalid(
            f"mem_type='device' needs a CUDA array (torch CUDA tensor, CuPy array, "
            f"hixl.cuda_alloc, or anything with __cuda_array_interface__); got "
            f"{type(obj).__name__} ({exc})"
        ) from exc
    shape = tuple(int(x) for x in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        want, expect = [], dtype.itemsize
        for n in reversed(shape):
            want.append(expect)
            expect *= n
        if any(n != 1 and s != w for n, s, w in zip(shape, strides, reversed(want), strict=True)):
            raise ParamInvalid(f"device cache of shape {shape} is not C-contiguous")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        raise ParamInvalid("cache array is empty (0 bytes)")
    return DeviceArray(obj, shape, dtype, int(cai["data"][0]), nbytes)


#: allocate_cache's block_axis when the caller gave none (None is a value: no block axis)
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<not given>"})()


def axes(
    shape: tuple[int, ...], dtype: Any, layout: Any, layer_axis: int | None, block_axis: Any
) -> tuple[int, int | None]:
    """The (layer axis, block axis) of a cache of `shape`, from `layout` (a KVLayout: axes 0
    and 2 of its ``shape``) or from both axes given; ParamInvalid naming what is missing or
    wrong. Nothing is guessed: a guessed block axis moves wrong bytes under a success status."""
    from .._layout import KVLayout

    if layout is not None:
        if not isinstance(layout, KVLayout):
            raise ParamInvalid(f"layout={layout!r} must be a hixl.kv.KVLayout")
        if tuple(shape) != layout.shape or np.dtype(dtype) != np.dtype(layout.dtype):
            raise ParamInvalid(
                f"the cache ({tuple(shape)}, {np.dtype(dtype)}) is not layout's "
                f"({layout.shape}, {np.dtype(layout.dtype)}): allocate it with layout.array()"
            )
        if (layer_axis, block_axis) not in ((None, UNSET), (0, 2)):
            raise ParamInvalid(
                f"layer_axis={layer_axis!r} and block_axis={block_axis!r} contradict layout= "
                "(its layer axis is 0 and its block axis 2): give one or the other"
            )
        return 0, 2
    if block_axis is UNSET:
        raise ParamInvalid(
            "allocate_cache needs the cache's layout: layout=KVLayout(...) for the shape "
            "KVLayout.array() builds, or both layer_axis= and block_axis= (block_axis=None for "
            "a cache without blocks); block_axis is not guessed, since a wrong guess moves the "
            "wrong bytes"
        )
    if layer_axis is None:
        raise ParamInvalid(
            f"block_axis={block_axis!r} was given without layer_axis: give both (or layout=)"
        )
    nd = len(shape)
    for what, ax in (("layer_axis", layer_axis), ("block_axis", block_axis)):
        if ax is None and what == "block_axis":
            continue
        if not isinstance(ax, int) or isinstance(ax, bool) or not -nd <= ax < nd:
            raise ParamInvalid(f"{what}={ax!r} is not an axis of shape {tuple(shape)}")
    la = layer_axis % nd
    ba = None if block_axis is None else block_axis % nd
    if ba is not None and ba == la:
        raise ParamInvalid(f"layer_axis={layer_axis} and block_axis={block_axis} are one axis")
    return la, ba


def describe(
    name: str, arr: np.ndarray | DeviceArray, layer_axis: int, block_axis: int | None
) -> CacheInfo:
    """What peers will know of `arr` registered as `name`, with axes checked by `axes`."""
    return CacheInfo(
        name,
        tuple(int(x) for x in arr.shape),
        arr.dtype.str,
        arr.addr if isinstance(arr, DeviceArray) else int(arr.ctypes.data),
        int(arr.nbytes),
        layer_axis,
        block_axis,
    )


def layer_axes(shape: tuple[int, ...], layout: Any, layer_axis: Any, block_axis: Any) -> int | None:
    """The block axis of one layer's tensor (of `shape`) of a cache given as a list of
    per-layer tensors: `block_axis` (None: no blocks); ParamInvalid for layout= or layer_axis=
    (the list is the layer axis) or an axis the shape lacks."""
    if layout is not None or layer_axis is not None:
        raise ParamInvalid(
            f"a cache given as a list of per-layer tensors has its layers as the list: give "
            f"block_axis= only (of one layer's shape {tuple(shape)}), not layout={layout!r} "
            f"or layer_axis={layer_axis!r}"
        )
    if block_axis is UNSET:
        raise ParamInvalid(
            f"allocate_cache of a list of per-layer tensors needs block_axis= (the axis of "
            f"blocks in one layer's shape {tuple(shape)}; None for a cache without blocks)"
        )
    if block_axis is None:
        return None
    nd = len(shape)
    if (
        not isinstance(block_axis, int)
        or isinstance(block_axis, bool)
        or not -nd <= block_axis < nd
    ):
        raise ParamInvalid(f"block_axis={block_axis!r} is not an axis of shape {tuple(shape)}")
    return block_axis % nd


def describe_layers(name: str, arrs: list[Any], block_axis: int | None) -> CacheInfo:
    """What peers will know of per-layer tensors `arrs` (one shape and dtype, checked here)
    registered as one cache `name`: shape (layers, *one layer's shape), layer axis 0."""
    first = arrs[0]
    for k, a in enumerate(arrs):
        if tuple(a.shape) != tuple(first.shape) or a.dtype != first.dtype:
            raise ParamInvalid(
                f"layer {k} of cache {name!r} is {tuple(a.shape)} {a.dtype}, layer 0 "
                f"{tuple(first.shape)} {first.dtype}: every layer's tensor must be alike"
            )
    addrs = tuple(a.addr if isinstance(a, DeviceArray) else int(a.ctypes.data) for a in arrs)
    return CacheInfo(
        name,
        (len(arrs), *(int(x) for x in first.shape)),
        first.dtype.str,
        addrs[0],
        int(first.nbytes) * len(arrs),
        0,
        None if block_axis is None else block_axis + 1,
        addrs,
    )
