"""hixl.nixl: NIXL's Python agent API (``nixl._api``) implemented on hixl.

    from hixl.nixl import nixl_agent, nixl_agent_config

Unchanged programs that do ``from nixl._api import nixl_agent`` can get this implementation
through the shim directory (``python -m hixl.nixl.shim`` prints it; put it on PYTHONPATH).
The coverage table and what is not supported: https://github.com/hixl/hixl/blob/main/docs/NIXL.md.
"""

from __future__ import annotations

from . import _bindings
from ._api import (
    NETWORK_BACKENDS,
    REFUSED_BACKENDS,
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)
from ._bindings import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixlBackendError,
    nixlCancelledError,
    nixlError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRemoteDList,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlXferDList,
    nixlXferTelemetry,
)

nixl_backend_handle = int

__all__ = [
    "DEFAULT_COMM_PORT",
    "NETWORK_BACKENDS",
    "NIXL_INIT_AGENT",
    "REFUSED_BACKENDS",
    "_bindings",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_xfer_handle",
]
