"""hixl's KV-cache layer: ranks, caches, and cache/block/layerwise transfers between a
prefill ("prompt") and a decode ("decoder") process, plus ``KVLayout`` for strided
transfers.

This is the home of the KV API: ``hixl.kv.init``, ``hixl.kv.allocate_cache``,
``hixl.kv.receive_cache_async``, ... (none of them is a top-level ``hixl`` name: the top level
is the engine's API). ``hixl.llm_datadist`` is the LLM-DataDist compatible face of the same
machinery; no class here shares a name with a different class there (``RegisteredCache``,
``CacheTransferConfig``, ``PeerRank``, ``LayerTracker``, ``KVError``).
"""

from __future__ import annotations

from .._layout import KVLayout
from ._cache import CacheInfo, RegisteredCache
from ._context import (
    PeerRank,
    allocate_cache,
    deallocate_cache,
    engine,
    finalize,
    init,
    link,
    ranks,
    unlink,
)
from ._errors import (
    HIXL_001001,
    HIXL_001002,
    HIXL_001003,
    LLM_CACHE_NOT_FOUND,
    LLM_NOT_LINKED,
    LLM_ROLE_MISMATCH,
    LLM_SUCCESS,
    LLM_TOO_LARGE,
    KVError,
)
from ._layerwise import LayerTracker, receive_cache_async, transfer_cache_async
from ._transfer import (
    CacheTransferConfig,
    TransferResult,
    TransferTask,
    pull_blocks,
    pull_cache,
    push_blocks,
    push_cache,
)

__all__ = [
    "KVLayout",
    "HIXL_001001",
    "HIXL_001002",
    "HIXL_001003",
    "LLM_CACHE_NOT_FOUND",
    "LLM_NOT_LINKED",
    "LLM_ROLE_MISMATCH",
    "LLM_SUCCESS",
    "LLM_TOO_LARGE",
    "CacheInfo",
    "CacheTransferConfig",
    "KVError",
    "LayerTracker",
    "PeerRank",
    "RegisteredCache",
    "TransferResult",
    "TransferTask",
    "allocate_cache",
    "deallocate_cache",
    "engine",
    "finalize",
    "init",
    "link",
    "pull_blocks",
    "pull_cache",
    "push_blocks",
    "push_cache",
    "ranks",
    "receive_cache_async",
    "transfer_cache_async",
    "unlink",
]
