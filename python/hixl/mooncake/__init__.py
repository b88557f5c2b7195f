"""Mooncake's Python transfer engine (``mooncake.engine`` of ``mooncake-transfer-engine``
0.3.13) on hixl: ``TransferEngine``, ``TransferOpcode``, ``TransferNotify``.

Programs written for Mooncake (SGLang's and vLLM's Mooncake backends, ...) run on hixl with
``from hixl.mooncake import TransferEngine`` instead of ``from mooncake.engine import
TransferEngine``, or unchanged through the shim: ``PYTHONPATH=$(python -m hixl.mooncake.shim)``.
The porting steps and what each call does here: https://github.com/hixl/hixl/blob/main/docs/MOONCAKE.md.
"""

from __future__ import annotations

from ._codes import (
    CHECK_COMPLETED,
    CHECK_FAILED,
    CHECK_PENDING,
    CHECK_TIMEOUT,
    DEFAULT_RPC_PORT,
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    ERR_DEVICE_NOT_FOUND,
    ERR_INVALID_ARGUMENT,
    ERR_PROBE_FAILED,
    OK,
    P2P_HANDSHAKE,
)
from ._engine import TransferEngine
from ._types import TransferNotify, TransferOpcode

#: Module-level aliases, as ``mooncake.engine`` has them.
Read = TransferOpcode.Read
Write = TransferOpcode.Write

__all__ = [
    "CHECK_COMPLETED",
    "CHECK_FAILED",
    "CHECK_PENDING",
    "CHECK_TIMEOUT",
    "DEFAULT_RPC_PORT",
    "ERR_ADDRESS_NOT_REGISTERED",
    "ERR_ADDRESS_OVERLAPPED",
    "ERR_DEVICE_NOT_FOUND",
    "ERR_INVALID_ARGUMENT",
    "ERR_PROBE_FAILED",
    "OK",
    "P2P_HANDSHAKE",
    "Read",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "Write",
]
