"""hixl: one-sided, batched, zero-copy transfers between processes and hosts.

Engines register memory and then READ or WRITE each other's registered memory in batches; the
target runs no application code. See README.md for the full API, options and status codes.
"""

from __future__ import annotations

from . import kv
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
    Hixl,
    MemDesc,
    MemHandle,
    MemType,
    NotifyDesc,
    ShmBuffer,
    StridedDesc,
    TransferOp,
    TransferOpDesc,
    TransferReq,
    TransferStatus,
    __version__,
    get_log_level,
    option_keys,
    set_log_level,
)
from ._layout import KVLayout, aligned_empty

__all__ = [
    "AlreadyConnected",
    "AsyncConnectStatus",
    "Failed",
    "Hixl",
    "HixlError",
    "KVLayout",
    "MemDesc",
    "MemHandle",
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
    "kv",
    "option_keys",
    "set_log_level",
]
