"""The Ray node's IP address, when this process runs inside an initialized Ray worker or driver.

Ray is never imported here: only a process that imported it already (a Ray worker always has)
is asked, so importing hixl stays free of Ray."""

from __future__ import annotations

import sys


def ray_node_ip() -> str | None:
    """Ray's node IP (``ray.util.get_node_ip_address()``) when ``ray`` is imported and
    initialized in this process; None otherwise, or when Ray cannot say."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        util = sys.modules.get("ray.util") or __import__("ray.util").util
        ip = util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - a Ray that cannot say leaves the default in place
        return None
    return str(ip) if ip else None


def listen_host(ip: str) -> str:
    """`ip` as the host part of an ``ip:port`` listen address (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip
