"""Who sent a notification: the engine id the engine reports for the connection it came on
(``NotifyDesc.peer``), compared with the address this rank knows for a rank. A notification's
text can name any rank; only its connection says who sent it (docs/RELIABILITY.md,
"Notifications' sender")."""

from __future__ import annotations

import ipaddress
import socket
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._context import Context


def rank_address(ctx: Context, rank: int) -> str | None:
    """The address this rank knows for `rank`: its link, else ``peers=`` / discovery."""
    with ctx.lock:
        p = ctx.peers.get(rank)
        return p.address if p is not None else ctx.known.get(rank)


def same_engine(sender: str, address: str) -> bool:
    """Whether `sender` (an engine id as ``NotifyDesc.peer`` gives it) is the engine listening
    at `address` ("ip:port", "[v6]:port", or "host:port" resolved to its addresses)."""
    if not sender or sender.startswith("?"):
        return False  # no engine id: it can be no rank's engine
    return sender == address or sender in _ids(address)


@lru_cache(maxsize=256)
def _ids(address: str) -> frozenset[str]:
    """The engine ids an address stands for: the address written as engines write theirs
    (IPv4-mapped as IPv4, IPv6 in brackets), one per resolved address for a host name."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return frozenset()
    host = host.strip("[]")
    try:
        ips = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return frozenset()
        ips = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    out = set()
    for ip in ips:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        out.add(f"[{ip}]:{port}" if isinstance(ip, ipaddress.IPv6Address) else f"{ip}:{port}")
    return frozenset(out)
