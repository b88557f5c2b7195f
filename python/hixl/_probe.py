"""Whether anything still listens at an engine's address: one TCP connect, closed at once.

An engine's address reaches its peers (NIXL agent metadata, Ray's tensor metadata) only after
the engine listens there, so a refused connect to it means that engine is gone: the faces report
such a peer dead at once instead of waiting for it to come up. A hixl listener takes a stream
that closes before its handshake silently."""

from __future__ import annotations

import socket


def refuses(engine: str, timeout_s: float = 0.2) -> bool:
    """True when a TCP connect to `engine` ("ip:port", IPv6 in brackets) is refused; False when
    it connects, times out or fails otherwise (the peer may be slow, not gone)."""
    host, _, port = engine.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
