"""Mooncake's ``protocol``, ``local_hostname`` and session strings, in hixl's terms."""

from __future__ import annotations

import logging
import os

from .._hixl import _rdma_info, backends, cuda_info
from ._codes import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RPC_PORT,
    ENV_BACKENDS,
    ENV_CONNECT_TIMEOUT,
    ENV_STRICT,
)

log = logging.getLogger("hixl.mooncake")

#: Mooncake protocols hixl serves with a backend of its own, by the device each needs.
_RDMA = ("rdma", "efa", "barex")
_CUDA = ("nvlink", "nvlink_intra", "cuda", "mnnvl", "hip")
#: Mooncake protocols with no hixl counterpart (storage, other accelerators' fabrics).
_NONE = ("nvmeof", "cxl", "ascend", "hccl", "ubshmem")


def strict() -> bool:
    """Whether ``HIXL_MOONCAKE_STRICT=1``: an unavailable protocol fails ``initialize``."""
    return os.environ.get(ENV_STRICT, "") == "1"


def _rdma_usable() -> bool:
    info = _rdma_info("verbs")
    return info.startswith("devices:") and "active" in info


def backends_for(protocol: str) -> tuple[str | None, str]:
    """hixl's ``hixl.backends`` for Mooncake's ``protocol``, and why (a WARNING text, or "").

    Returns ``(None, reason)`` when the protocol is unavailable and ``HIXL_MOONCAKE_STRICT=1``
    is set. ``HIXL_MOONCAKE_BACKENDS`` overrides the mapping. hixl's own names are accepted
    too: ``"auto"`` (every backend hixl has, fastest first) and each backend's name (Mooncake's
    ``"tcp"`` is hixl's ``tcp``).
    """
    forced = os.environ.get(ENV_BACKENDS, "").strip()
    if forced:
        return forced, ""
    p = (protocol or "").strip().lower()
    if p in ("auto", "hixl"):
        return "auto", ""
    if p in _RDMA:
        if _rdma_usable():
            return "auto", ""
        why = f"protocol {protocol!r}: no usable RDMA device ({_rdma_info('verbs')})"
    elif p in _CUDA:
        cuda = cuda_info()
        if cuda.get("available"):
            return "auto", ""
        why = f"protocol {protocol!r}: CUDA not usable ({cuda.get('reason', 'no device')})"
    elif p in {b["name"] for b in backends()}:
        return p, ""  # Mooncake's "tcp", or any other hixl backend by its own name
    elif p in _NONE:
        why = f"protocol {protocol!r} has no hixl backend"
    else:
        why = f"unknown protocol {protocol!r}"
    if strict():
        return None, why + f" and {ENV_STRICT}=1"
    return "auto", why + "; using hixl's best available backends (hixl.backends=auto)"


def split_host(hostname: str) -> tuple[str, int | None]:
    """``"host:port"``, ``"[v6]:port"``, ``"host"`` -> ``(host, port or None)``.

    Raises ``ValueError`` naming the string when it does not parse.
    """
    s = (hostname or "").strip()
    if not s:
        raise ValueError(f"empty hostname {hostname!r}")
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"hostname {hostname!r} does not parse")
        port_s = rest[1:] if rest else ""
    elif s.count(":") == 1:
        host, _, port_s = s.partition(":")
    else:  # a bare name, IPv4 or (unbracketed) IPv6 address
        host, port_s = s, ""
    if not host:
        raise ValueError(f"hostname {hostname!r} names no host")
    if not port_s:
        return host, None
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"hostname {hostname!r}: port {port_s!r} is not 0..65535")
    return host, int(port_s)


def join(host: str, port: int) -> str:
    """``host`` and ``port`` as an address hixl parses (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def session_addr(session: str) -> str:
    """The hixl engine address of a Mooncake session ``"host:rpc_port"`` (``"host"`` alone
    means Mooncake's default RPC port, 12001)."""
    host, port = split_host(session)
    return join(host, DEFAULT_RPC_PORT if port is None else port)


def warn_once(text: str) -> None:
    """Logs ``text`` as the one WARNING of an ``initialize`` about its protocol."""
    log.warning("%s", text)


def connect_timeout_s() -> float:
    """Seconds a first contact with a session may take: ``HIXL_MOONCAKE_CONNECT_TIMEOUT_S``."""
    raw = os.environ.get(ENV_CONNECT_TIMEOUT, "")
    try:
        value = float(raw) if raw else DEFAULT_CONNECT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning(
            "%s=%r is not a positive number; using %s",
            ENV_CONNECT_TIMEOUT,
            raw,
            DEFAULT_CONNECT_TIMEOUT_S,
        )
        return DEFAULT_CONNECT_TIMEOUT_S
    return value
