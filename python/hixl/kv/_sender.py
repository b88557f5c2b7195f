"""Who sent a notification: the engine id the engine reports for the connection it came on
(``NotifyDesc.peer``), compared with the address this rank knows for a rank. A notification's
text can name any rank; only its connection says who sent it ("Notifications' sender" in
https://github.com/hixl/hixl/blob/main/docs/RELIABILITY.md)."""

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
    if sender == address:
        return True
    ids = _ids(address)
    return sender in ids or _same_loopback_port(sender, ids)


def _same_loopback_port(sender: str, ids: frozenset[str]) -> bool:
    """A loopback sender and a loopback address with the same port: one engine of this host
    (every loopback address reaches the same listener on 0.0.0.0, and a connection to
    127.0.0.2 leaves from 127.0.0.1)."""
    host, _, port = sender.rpartition(":")
    if not _is_loopback(host):
        return False
    return any(i.rpartition(":")[2] == port and _is_loopback(i.rpartition(":")[0]) for i in ids)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Unresolved(Exception):
    """A host name that did not resolve now (never cached: it may resolve later)."""


def _ids(address: str) -> frozenset[str]:
    """The engine ids an address stands for: the address written as engines write theirs
    (IPv4-mapped as IPv4, IPv6 in brackets), one per resolved address for a host name; empty
    when it is no address or its host name does not resolve now."""
    try:
        return _resolved_ids(address)
    except _Unresolved:
        return frozenset()


@lru_cache(maxsize=256)
def _resolved_ids(address: str) -> frozenset[str]:
    """`_ids`, cached; raises `_Unresolved` (not cached) when a host name fails to resolve."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return frozenset()
    host = host.strip("[]")
    try:
        ips = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _Unresolved(host) from exc
        ips = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    out = set()
    for ip in ips:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        out.add(f"[{ip}]:{port}" if isinstance(ip, ipaddress.IPv6Address) else f"{ip}:{port}")
    return frozenset(out)
