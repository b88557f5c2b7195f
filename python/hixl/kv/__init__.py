"""hixl's KV-cache layer: ranks, caches, and cache/block/layerwise transfers between a
prefill ("prompt") and a decode ("decoder") process, plus ``KVLayout`` for strided
transfers.

This is the home of the KV API: ``hixl.kv.init``, ``hixl.kv.allocate_cache``,
``hixl.kv.receive_cache_async``, ... The same names at the top level (``hixl.kv.init``, ...) and
in ``hixl.datadist`` still work for one release, with a DeprecationWarning.
``hixl.llm_datadist`` is the LLM-DataDist compatible face of the same machinery.
"""

from .._layout import KVLayout
from ._cache import Cache, CacheInfo
from ._context import (
    LLMClusterInfo,
    allocate_cache,
    deallocate_cache,
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
    LLMError,
)
from ._layerwise import LayerSynchronizer, receive_cache_async, transfer_cache_async
from ._transfer import (
    TransferConfig,
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
    "Cache",
    "CacheInfo",
    "LLMClusterInfo",
    "LLMError",
    "LayerSynchronizer",
    "TransferConfig",
    "TransferResult",
    "TransferTask",
    "allocate_cache",
    "deallocate_cache",
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
