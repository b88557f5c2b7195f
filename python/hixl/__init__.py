"""hixl: one-sided, batched, zero-copy transfers between processes and hosts.

Engines register memory and then READ or WRITE each other's registered memory in batches; the
target runs no application code. The API reference (every call, its arguments, defaults,
errors and GIL behaviour) is https://github.com/hixl/hixl/blob/main/docs/API.md;
``help(hixl.Hixl)`` and the docstrings of each method say the same. The README
(https://github.com/hixl/hixl#readme, also the package's description) has the options, status
codes and the KV-cache layer (``hixl.kv``; ``hixl.llm_datadist`` is its LLM-DataDist face).
"""

from __future__ import annotations

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
