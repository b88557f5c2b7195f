"""CacheManager (``LLMDataDist.cache_manager``) and KvCacheManager (the older
``kv_cache_manager``): caches in registered host memory, moved one-sidedly by hixl.

CacheManager is put together from one class per responsibility, each in its own module:
``_keys`` (the base: lifetime, argument checks, cache keys), ``_alloc`` (allocation and
registration), ``_transfer`` (pulls, pushes, layerwise sends) and ``_copy`` (local copies and
swaps), with the offset planning they share in ``_plan``. Every name this module held before
that split is still importable from it.
"""

from __future__ import annotations

# Besides what it uses, this module re-exports (``import x as x``) every name it held before
# the split into the modules named above: programs may import any of them from here.
import copy as copy
import ctypes as ctypes
import threading as threading
from collections.abc import Sequence as Sequence
from typing import Any as Any

from .._hixl import TransferOp as TransferOp
from .._kvcore._plan import block_runs as block_runs
from .._layout import aligned_empty as aligned_empty
from ._alloc import _Allocation
from ._alloc import _host_only as _host_only
from ._cache import Cache as Cache
from ._cache import CacheTask as CacheTask
from ._cache import KvCache
from ._cache import create_tensors as create_tensors
from ._copy import _Copies
from ._keys import _key_ok as _key_ok
from ._node import KeyIdent as KeyIdent
from ._node import Local as Local
from ._node import Node as Node
from ._node import RemoteCache as RemoteCache
from ._node import RemoteView as RemoteView
from ._plan import Offsets as Offsets
from ._plan import _block_bytes as _block_bytes
from ._plan import _block_offsets as _block_offsets
from ._plan import _entry as _entry
from ._plan import _entry_offsets as _entry_offsets
from ._plan import _entry_to_blocks as _entry_to_blocks
from ._plan import _flip as _flip
from ._plan import _pairs as _pairs
from ._plan import _tensor_pairs as _tensor_pairs
from ._status import LLMException as LLMException
from ._status import LLMStatusCode as LLMStatusCode
from ._status import check as check
from ._status import code_of as code_of
from ._status import fail as fail
from ._status import wrap as wrap
from ._transfer import _Transfers
from ._types import INVALID_ID as INVALID_ID
from ._types import TENSORS_PER_LAYER as TENSORS_PER_LAYER
from ._types import BlocksCacheKey as BlocksCacheKey
from ._types import CacheDesc as CacheDesc
from ._types import CacheKey as CacheKey
from ._types import CacheKeyByIdAndIndex as CacheKeyByIdAndIndex
from ._types import LayerSynchronizer as LayerSynchronizer
from ._types import MemInfo as MemInfo
from ._types import Placement as Placement
from ._types import TransferConfig as TransferConfig
from ._types import TransferWithCacheKeyConfig as TransferWithCacheKeyConfig
from ._types import check_int as check_int
from ._types import check_ints as check_ints
from ._types import check_layer_range as check_layer_range


class CacheManager(_Allocation, _Transfers, _Copies):
    """Allocates, registers and moves caches. Every failure raises LLMException with an
    LLMStatusCode. How each call maps to hixl: https://github.com/hixl/hixl/blob/main/docs/LLM_DATADIST.md."""


class KvCacheManager(CacheManager):
    """The older API (``LLMDataDist.kv_cache_manager``, without enable_cache_manager): the
    same operations, with KvCache handles."""

    _cache_cls = KvCache


__all__ = ["CacheManager", "KvCacheManager"]
