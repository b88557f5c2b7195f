"""Value types of LLM-DataDist's API: roles, data types, placements, cache descriptions and
keys, transfer configurations, and the producer-side LayerSynchronizer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum
from typing import Any

import numpy as np

from .._kvcore._cache import Geometry, axis_pieces
from ._status import LLMStatusCode, check

#: LLM-DataDist's "no id" value (a CacheKey without req_id or prefix_id).
INVALID_ID = 2**64 - 1
#: Tensors per layer unless told otherwise (K and V).
TENSORS_PER_LAYER = 2


class LLMRole(Enum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


#: LLMRole -> the role string of hixl's KV-cache layer (it refuses prompt<->prompt links).
ROLE_NAMES = {LLMRole.PROMPT: "prompt", LLMRole.DECODER: "decoder", LLMRole.MIX: "mix"}


class Placement(Enum):
    HOST = 0
    DEVICE = 1


class RegisterMemStatus(Enum):
    OK = 0
    PREPARING = 1
    FAILED = 2


class Memtype(Enum):
    MEM_TYPE_DEVICE = 0
    MEM_TYPE_HOST = 1


class MemInfo:
    """A memory range (used by remap_registered_memory, which hixl refuses)."""

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        self.mem_type, self.addr, self.size = mem_type, addr, size

    def __repr__(self) -> str:
        return f"MemInfo({self.mem_type.name}, addr={self.addr:#x}, size={self.size})"


class DataType(Enum):
    """Element types (values are GE's data type numbers)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


#: numpy storage of each type. numpy has no bfloat16: its elements are held as uint16 (the
#: bytes are what moves; torch views them as bfloat16, see tensors()).
NP_DTYPES: dict[DataType, Any] = {
    DataType.DT_FLOAT: np.float32,
    DataType.DT_FLOAT16: np.float16,
    DataType.DT_BF16: np.uint16,
    DataType.DT_INT8: np.int8,
    DataType.DT_INT16: np.int16,
    DataType.DT_UINT16: np.uint16,
    DataType.DT_UINT8: np.uint8,
    DataType.DT_INT32: np.int32,
    DataType.DT_INT64: np.int64,
    DataType.DT_UINT32: np.uint32,
    DataType.DT_UINT64: np.uint64,
    DataType.DT_BOOL: np.bool_,
    DataType.DT_DOUBLE: np.float64,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_int(name: str, v: Any, lo: int = 0, hi: int = 2**64 - 1) -> int:
    check(_is_int(v) and lo <= int(v) <= hi, f"{name}={v!r} must be an integer in [{lo}, {hi}]")
    return int(v)


def check_ints(name: str, v: Any) -> list[int]:
    check(
        isinstance(v, (list, tuple)) and all(_is_int(x) and int(x) >= 0 for x in v),
        f"{name}={v!r} must be a list or tuple of integers >= 0",
    )
    return [int(x) for x in v]


class CacheDesc:
    """A cache: `num_tensors` tensors of the same `shape` and `data_type`. For a blocks cache
    the first dimension counts blocks; for a plain cache `batch_dim_index` is the batch."""

    def __init__(
        self,
        num_tensors: int,
        shape: Sequence[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_int("num_tensors", num_tensors, 1, 2**32 - 1)
        check(
            isinstance(shape, (list, tuple)) and len(shape) > 0 and all(_is_int(d) for d in shape),
            f"shape={shape!r} must be a non-empty list or tuple of integers",
        )
        check(all(int(d) > 0 for d in shape), f"shape={list(shape)} has a dimension <= 0")
        check(isinstance(data_type, DataType), f"data_type={data_type!r} must be a DataType")
        check(
            data_type in NP_DTYPES,
            f"data_type={data_type.name}: no fixed-size element type; not supported",
        )
        check(isinstance(placement, Placement), f"placement={placement!r} must be a Placement")
        check(
            _is_int(batch_dim_index) and 0 <= batch_dim_index < len(shape),
            f"batch_dim_index={batch_dim_index!r} is out of range for shape {list(shape)}",
        )
        self._num_tensors = int(num_tensors)
        self._shape = [int(d) for d in shape]
        self._data_type = data_type
        self._placement = placement
        self._batch_dim_index = int(batch_dim_index)
        self._seq_len_dim_index = int(seq_len_dim_index)
        self._kv_tensor_format = kv_tensor_format
        self._is_blocks = False

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def shape(self) -> list[int]:
        return list(self._shape)

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        check(0 <= dim_index < len(self._shape), f"dim_index={dim_index} is out of range")
        check_int("dim_value", dim_value, 1)
        self._shape[dim_index] = int(dim_value)

    @property
    def data_type(self) -> DataType:
        return self._data_type

    @property
    def np_dtype(self) -> np.dtype:
        """hixl: the numpy dtype of the elements."""
        return np.dtype(NP_DTYPES[self._data_type])

    @property
    def batch_dim(self) -> int:
        return self._batch_dim_index

    @property
    def batch_size(self) -> int:
        return self._shape[self._batch_dim_index]

    @property
    def seq_len_dim_index(self) -> int:
        return self._seq_len_dim_index

    @property
    def size(self) -> int:
        """Bytes of one tensor."""
        return self.geometry.nbytes

    @property
    def geometry(self) -> Geometry:
        """hixl: one tensor's byte geometry in the KV core's model (a blocks cache's blocks
        are its batch dimension)."""
        b = self._batch_dim_index
        return Geometry(tuple(self._shape), self.np_dtype.itemsize, None, b)

    @property
    def kv_tensor_format(self) -> str | None:
        return self._kv_tensor_format

    @property
    def placement(self) -> Placement:
        return self._placement

    def batch_pieces(self, index: int) -> list[tuple[int, int]]:
        """hixl: (byte offset, length) of the contiguous pieces of one batch entry (one block
        of a blocks cache) within each tensor."""
        return axis_pieces(
            self.geometry.shape, self.geometry.itemsize, self._batch_dim_index, index
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self._num_tensors,
            "shape": self._shape,
            "dtype": self._data_type.value,
            "batch_dim": self._batch_dim_index,
            "blocks": self._is_blocks,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheDesc:
        out = cls(
            int(d["n"]),
            [int(x) for x in d["shape"]],
            DataType(int(d["dtype"])),
            Placement.HOST,
            int(d["batch_dim"]),
        )
        out._is_blocks = bool(d["blocks"])
        return out

    def __repr__(self) -> str:
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, shape={self._shape}, "
            f"data_type={self._data_type.name}, placement={self._placement.name}, "
            f"batch_dim_index={self._batch_dim_index})"
        )


def _key_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str], what: str
) -> dict[str, Any]:
    check(len(args) + len(kwargs) <= len(names) + 1, f"{what}: too many arguments")
    for name, v in zip(names, args, strict=False):
        kwargs[name] = v
    if "prompt_cluster_id" in kwargs:
        check("cluster_id" not in kwargs, f"{what}: give cluster_id or prompt_cluster_id, not both")
        kwargs["cluster_id"] = kwargs.pop("prompt_cluster_id")
    bad = [k for k in kwargs if k not in names]
    check(not bad, f"{what}: unknown argument {bad[0] if bad else ''!r}")
    check("cluster_id" in kwargs, f"{what}: cluster_id (or prompt_cluster_id) is required")
    return kwargs


class CacheKey:
    """A request's KV cache on a prompt cluster: CacheKey(prompt_cluster_id, req_id,
    model_id=0, prefix_id=INVALID). Registered with allocate_cache / register_cache; a
    successful pull_cache by this key releases it (the prompt cannot be pulled twice)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kw = _key_args(args, kwargs, ["cluster_id", "req_id", "model_id", "prefix_id"], "CacheKey")
        self._cluster_id = check_int("cluster_id", kw["cluster_id"])
        self._req_id = check_int("req_id", kw.get("req_id", INVALID_ID))
        self._model_id = check_int("model_id", kw.get("model_id", 0))
        self._prefix_id = check_int("prefix_id", kw.get("prefix_id", INVALID_ID))

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def req_id(self) -> int:
        return self._req_id

    @property
    def prefix_id(self) -> int:
        return self._prefix_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def ident(self) -> list[int]:
        """hixl: how the key is published: [cluster_id, req_id, model_id, prefix_id]."""
        return [self._cluster_id, self._req_id, self._model_id, self._prefix_id]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self.ident() == other.ident()

    def __hash__(self) -> int:
        return hash(tuple(self.ident()))

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"model_id={self._model_id}, prefix_id={self._prefix_id})"
        )


class CacheKeyByIdAndIndex:
    """A remote cache by its cache_id, and one batch index of it."""

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        self._cluster_id = check_int("cluster_id", cluster_id)
        self._cache_id = check_int("cache_id", cache_id, -(2**63), 2**63 - 1)
        self._batch_index = check_int("batch_index", batch_index, 0, 2**32 - 1)

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def batch_index(self) -> int:
        return self._batch_index

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, cache_id={self._cache_id}, "
            f"batch_index={self._batch_index})"
        )


class BlocksCacheKey:
    """A blocks cache on a cluster: BlocksCacheKey(prompt_cluster_id, model_id=0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kw = _key_args(args, kwargs, ["cluster_id", "model_id"], "BlocksCacheKey")
        self._cluster_id = check_int("cluster_id", kw["cluster_id"])
        self._model_id = check_int("model_id", kw.get("model_id", 0))

    @property
    def prompt_cluster_id(self) -> int:
        return self._cluster_id

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    @property
    def model_id(self) -> int:
        return self._model_id

    def __repr__(self) -> str:
        return f"BlocksCacheKey(cluster_id={self._cluster_id}, model_id={self._model_id})"


def check_layer_range(name: str, r: Any, allow_none: bool = True) -> range | None:
    if r is None:
        check(allow_none, f"{name} is required")
        return None
    check(
        isinstance(r, range) and r.step == 1 and 0 <= r.start < r.stop,
        f"{name}={r!r} must be a range(start, stop) with 0 <= start < stop and step 1",
    )
    return r


class TransferConfig:
    """One destination of transfer_cache_async by address: the remote cluster, the address
    of each destination tensor (one per source tensor of `src_layer_range`), the source
    layers (default all) and the source batch index."""

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: Sequence[int],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        self.dst_cluster_id = dst_cluster_id
        self.dst_addrs = dst_addrs  # type: ignore[assignment]
        self.src_layer_range = src_layer_range
        self.src_batch_index = src_batch_index

    @property
    def dst_cluster_id(self) -> int:
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, v: int) -> None:
        self._dst_cluster_id = check_int("dst_cluster_id", v)

    @property
    def dst_addrs(self) -> list[int]:
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, v: Sequence[int]) -> None:
        addrs = check_ints("dst_addrs", v)
        check(len(addrs) > 0 and all(a != 0 for a in addrs), "dst_addrs must be non-zero")
        self._dst_addrs = addrs

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, v: range | None) -> None:
        self._src_layer_range = check_layer_range("src_layer_range", v)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, v: int) -> None:
        self._src_batch_index = check_int("src_batch_index", v, 0, 2**32 - 1)

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
            f"dst_addrs=[{', '.join(hex(a) for a in self._dst_addrs)}], "
            f"src_layer_range={self._src_layer_range}, src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """One destination of transfer_cache_async by key (remote cache accessible mode): a
    BlocksCacheKey or CacheKeyByIdAndIndex of the destination cache, the source and
    destination layer ranges (same length), and the source batch index."""

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        self.cache_key = cache_key
        self.src_layer_range = src_layer_range
        self.dst_layer_range = dst_layer_range
        if src_layer_range is not None and dst_layer_range is not None:
            check(
                len(src_layer_range) == len(dst_layer_range),
                f"src_layer_range={src_layer_range} and dst_layer_range={dst_layer_range} "
                "differ in length",
            )
        self.src_batch_index = src_batch_index

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        return self._cache_key

    @cache_key.setter
    def cache_key(self, v: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check(
            isinstance(v, (BlocksCacheKey, CacheKeyByIdAndIndex)),
            f"cache_key={v!r} must be a BlocksCacheKey or CacheKeyByIdAndIndex",
        )
        self._cache_key = v

    @property
    def src_layer_range(self) -> range | None:
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, v: range | None) -> None:
        self._src_layer_range = check_layer_range("src_layer_range", v)

    @property
    def dst_layer_range(self) -> range | None:
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, v: range | None) -> None:
        self._dst_layer_range = check_layer_range("dst_layer_range", v)

    @property
    def src_batch_index(self) -> int:
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, v: int) -> None:
        self._src_batch_index = check_int("src_batch_index", v, 0, 2**32 - 1)

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig({self._cache_key!r}, src_layer_range="
            f"{self._src_layer_range}, dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


class LayerSynchronizer(ABC):
    """LLM-DataDist's producer-side callback (subclass it): transfer_cache_async calls
    ``synchronize_layer(k, timeout_in_millis)`` before it sends layer k; it returns True once
    layer k is computed (False, or an exception, fails the task).

    Not hixl.kv.LayerTracker, which is consumer-side
    (https://github.com/hixl/hixl/blob/main/docs/LLM_DATADIST.md)."""

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        raise NotImplementedError


__all__ = [
    "INVALID_ID",
    "BlocksCacheKey",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "DataType",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
]
