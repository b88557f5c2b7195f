"""LLM-DataDist's Python API (Ascend CANN ``llm_datadist``) on hixl.

Programs written for LLM-DataDist port by changing ``from llm_datadist import ...`` to
``from hixl.llm_datadist import ...`` and their device lines (NPU tensors -> CPU tensors,
``Placement.DEVICE`` -> ``Placement.HOST``, device IPs -> host addresses). Unchanged
programs can keep ``import llm_datadist``: call ``hixl.llm_datadist.install()`` first, or run
them with ``PYTHONPATH=$(python -m hixl.llm_datadist)``. What is implemented, ignored or
refused, and how each call maps to hixl: https://github.com/hixl/hixl/blob/main/docs/LLM_DATADIST.md.

This module's ``LayerSynchronizer`` is LLM-DataDist's (producer side, subclassed by the
user); ``hixl.kv.LayerTracker`` is hixl's own consumer-side class.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ._cache import Cache, CacheTask, KvCache, create_npu_tensors, create_tensors
from ._config import LLMClusterInfo, LLMConfig, LlmConfig
from ._datadist import LLMDataDist
from ._manager import CacheManager, KvCacheManager
from ._status import LLMException, LLMStatusCode, Status
from ._types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMRole,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

#: A directory holding an ``llm_datadist`` package that re-exports this module: put it on
#: PYTHONPATH (``python -m hixl.llm_datadist`` prints it) to run unchanged programs.
SHIM_PATH = str(Path(__file__).with_name("shim"))


def install() -> None:
    """Makes ``import llm_datadist`` (and ``from llm_datadist import ...``) give this module."""
    sys.modules["llm_datadist"] = sys.modules[__name__]


__all__ = [
    "SHIM_PATH",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataType",
    "KvCache",
    "KvCacheManager",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LayerSynchronizer",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "create_npu_tensors",
    "create_tensors",
    "install",
]
