"""hixl: one-sided, batched, zero-copy transfers between processes and hosts.

Engines register memory and then READ or WRITE each other's registered memory in batches; the
target runs no application code. ``docs/API.md`` in the repository is the API reference (every
call, its arguments, defaults, errors and GIL behaviour); ``help(hixl.Hixl)`` and the
docstrings of each method say the same. README.md has the options, status codes and the
KV-cache layer (``hixl.kv``; ``hixl.llm_datadist`` is its LLM-DataDist face).
"""

from __future__ import annotations

import warnings
from typing import Any

from . import aio, kv, metrics
from ._errors import (
    AlreadyConnected,
    Failed,
    HixlError,
    NotConnected,
    NotifyFailed,
    ParamInvalid,
    ResourceExhausted,
    Status,
    Timeout,
    Unsupported,
)
from ._hixl import (
    AsyncConnectStatus,
    DeviceBuffer,
    Hixl,
    MemDesc,
    MemHandle,
    MemType,
    NotifyDesc,
    RemoteRegion,
    ShmBuffer,
    StridedDesc,
    TransferOp,
    TransferOpDesc,
    TransferReq,
    TransferStatus,
    __version__,
    backends,
    cuda_alloc,
    cuda_info,
    get_log_level,
    hixl_option_keys,
    log_dropped,
    option_keys,
    status_codes,
    transfer_states,
)
from ._layout import KVLayout, aligned_empty
from ._logging import set_log_level

__all__ = [
    "AlreadyConnected",
    "AsyncConnectStatus",
    "Failed",
    "Hixl",
    "HixlError",
    "KVLayout",
    "MemDesc",
    "MemHandle",
    "RemoteRegion",
    "MemType",
    "NotConnected",
    "NotifyDesc",
    "NotifyFailed",
    "ParamInvalid",
    "ResourceExhausted",
    "ShmBuffer",
    "StridedDesc",
    "Status",
    "Timeout",
    "TransferOp",
    "TransferOpDesc",
    "TransferReq",
    "TransferStatus",
    "Unsupported",
    "__version__",
    "aligned_empty",
    "get_log_level",
    "log_dropped",
    "aio",
    "kv",
    "metrics",
    "option_keys",
    "backends",
    "status_codes",
    "transfer_states",
    "hixl_option_keys",
    "set_log_level",
    "DeviceBuffer",
    "cuda_alloc",
    "cuda_info",
]

#: The KV-cache names that were exported here before they moved to ``hixl.kv`` (all of
#: ``hixl.kv`` but the names that were never here): they still resolve, with a
#: DeprecationWarning, for one release.
_MOVED_TO_KV = (frozenset(kv.__all__) | frozenset(kv.RENAMED)) - {
    *kv.RENAMED.values(),  # renamed in hixl.kv: the top level had them under the old names
    "KVLayout",
    "CacheInfo",
    "LLM_CACHE_NOT_FOUND",
    "LLM_NOT_LINKED",
    "LLM_ROLE_MISMATCH",
    "LLM_SUCCESS",
    "LLM_TOO_LARGE",
}


#: The moved KV names that read like an engine call, and that call: the top level is the
#: engine's API, so the warning says that these are the KV layer's and not the engine's.
_NOT_THE_ENGINES = {
    "init": "Hixl.initialize",
    "finalize": "Hixl.finalize",
    "link": "Hixl.connect",
    "unlink": "Hixl.disconnect",
}


def __getattr__(name: str) -> Any:
    """Resolves a KV-cache name that moved to ``hixl.kv`` (``hixl.init``, ``hixl.Cache``, ...),
    warning that it is deprecated here."""
    if name in _MOVED_TO_KV:
        new = kv.RENAMED.get(name, name)
        also = f" (hixl.kv.{name} until then)" if new != name else ""
        engines = _NOT_THE_ENGINES.get(name)
        note = f" (the KV-cache layer's {name}, not {engines})" if engines else ""
        use = f"hixl.kv.{new}{also}{note}"
        warnings.warn(
            f"hixl.{name} is deprecated and goes in the next release: use {use}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(kv, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
