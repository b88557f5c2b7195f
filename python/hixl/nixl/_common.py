"""What every part of ``nixl_agent`` shares: the plugin tables, the agent's base state and small
helpers (agent names, notification payloads, the inside-a-region check).

``nixl_agent`` (``_api``: configuration, lifetime, plugins and backends) is put together from
one class per responsibility, each in its own module and each built on the ones below it:
``_AgentBase`` here; ``_memory._Memory`` (descriptor lists and memory registration) on it;
``_metadata._Metadata`` (agent metadata, remote agents, the listen-thread side channel) on that;
``_xfer._Transfers`` (transfers and their handles) and ``_notifs._Notifs`` (notifications) on
that. ``nixl_agent`` derives from the last two.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from .._hixl import Hixl, TransferOp, backends
from ._bindings import nixlInvalidParamError

log = logging.getLogger("hixl.nixl")

U64 = npt.NDArray[np.uint64]


def _own_plugins() -> dict[str, str]:
    """hixl's own plugin names, one per backend of this build (``HIXL_TCP``, ``HIXL_SHM``,
    ...): each forces that backend, and one that serves only this host keeps ``self`` (this
    process's engines, served faster) ahead of it."""
    own = {}
    for b in backends():
        name = b["name"]
        own[f"HIXL_{name.upper()}"] = f"self,{name}" if b["reach"] == "host" else name
    return own


# NIXL plugin name -> the hixl backends (option hixl.backends) it stands for.
NETWORK_BACKENDS = {
    "UCX": "auto",
    "UCX_MO": "auto",
    "LIBFABRIC": "auto",
    "UCCL": "auto",
    "Mooncake": "auto",
    "HIXL": "auto",
    **_own_plugins(),
}
# NIXL plugins hixl does not provide (storage, GPU-initiated): refused with a clear error.
REFUSED_BACKENDS = {
    "GDS": "GPUDirect Storage",
    "GDS_MT": "GPUDirect Storage",
    "POSIX": "file storage",
    "OBJ": "object storage",
    "HF3FS": "3FS storage",
    "GUSLI": "block storage",
    "INFINIA": "object storage",
    "AZURE_BLOB": "object storage",
    "GPUNETIO": "GPU-initiated networking (device memory)",
}
_OPS = {"WRITE": TransferOp.WRITE, "READ": TransferOp.READ}
_NOTIF_PREFIX = "nixl:"
_CONNECT_WAIT_S = 10.0


def _name(agent: Any) -> str:
    """An agent name given as str or bytes (NIXL returns bytes from add_remote_agent)."""
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if isinstance(agent, str):
        return agent
    raise nixlInvalidParamError(f"agent name must be str or bytes, not {type(agent).__name__}")


def _msg(m: Any) -> bytes:
    if m is None:
        return b""
    if isinstance(m, str):
        return m.encode()
    if isinstance(m, (bytes, bytearray, memoryview)):
        return bytes(m)
    raise nixlInvalidParamError(f"notification must be bytes or str, not {type(m).__name__}")


def _first_outside(addrs: U64, lens: U64, starts: U64, ends: U64) -> int:
    """Index of the first range [addr, addr+len) not inside one region, or -1."""
    n = addrs.shape[0]
    if n == 0:
        return -1
    if starts.shape[0] == 0:
        return 0
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = idx >= 0
    ok &= (addrs + lens) <= ends[np.maximum(idx, 0)]
    if ok.all():
        return -1
    return int(np.argmin(ok))


class _AgentBase:
    """The state that more than one part of the agent uses (set by ``nixl_agent.__init__``)."""

    name: str
    backends: dict[str, int]
    _lock: threading.RLock
    _engine: Hixl
    _addr: str
    _notif_name: str
    _threads: list[threading.Thread]
