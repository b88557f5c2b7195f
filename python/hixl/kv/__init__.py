"""hixl's KV-cache layer: ranks, caches, and cache/block/layerwise transfers between a
prefill ("prompt") and a decode ("decoder") process, plus ``KVLayout`` for strided
transfers.

This is the home of the KV API: ``hixl.kv.init``, ``hixl.kv.allocate_cache``,
``hixl.kv.receive_cache_async``, ... The same names at the top level (``hixl.kv.init``, ...) and
in ``hixl.datadist`` still work for one release, with a DeprecationWarning.
``hixl.llm_datadist`` is the LLM-DataDist compatible face of the same machinery.

Five classes had the names of LLM-DataDist's different ones and were renamed:
``RegisteredCache`` (was ``Cache``), ``CacheTransferConfig`` (``TransferConfig``),
``PeerRank`` (``LLMClusterInfo``), ``LayerTracker`` (``LayerSynchronizer``) and ``KVError``
(``LLMError``). The old names still give the same classes for one release, with a
DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from .._layout import KVLayout
from ._cache import CacheInfo, RegisteredCache
from ._context import (
    PeerRank,
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

#: The old names of the renamed classes (old name -> new name): they resolve, with a
#: DeprecationWarning, for one release.
RENAMED = {
    "Cache": "RegisteredCache",
    "TransferConfig": "CacheTransferConfig",
    "LLMClusterInfo": "PeerRank",
    "LayerSynchronizer": "LayerTracker",
    "LLMError": "KVError",
}


def __getattr__(name: str) -> Any:
    """Resolves an old name of a renamed class, warning that it is deprecated."""
    new = RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"hixl.kv.{name} is deprecated and goes in the next release: use hixl.kv.{new} "
        "(the same class)",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
