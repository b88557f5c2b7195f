"""Challenge-response for the listen-thread side channel when the cluster has a secret.

The engine's own handshake (crates/hixl-core/src/auth.rs) is the model; this is the same idea
for the side channel, under labels of its own, so that no proof or key of one can stand for one
of the other (domain separation). "The NIXL listener" in
https://github.com/hixl/hixl/blob/main/docs/PROTOCOL.md has the byte layout:

1. the client sends ``H`` with a fresh 32-byte nonce ``ni``;
2. the listener answers ``C``: a fresh nonce ``nt`` and its proof;
3. the client checks that proof and answers ``P``: its own proof;
4. the listener checks it and only then reads the request, which, like the reply, carries a
   MAC under a key of its direction.

Proofs are HMAC-SHA256, under ``K = HMAC-SHA256(secret, KEY_LABEL)``, over a label and the
SHA-256 of the transcript: both nonces and the address the client reached, each side using the
address as it sees it (the client its socket's peer, the listener its socket's own address). A
proof relayed from another connection or to another address does not verify, and the secret
never crosses the wire. Comparisons are constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from .._secret import cluster_secret as cluster_secret

KEY_LABEL = b"hixl-v1 nixl listener key"
LISTENER_LABEL = b"hixl-v1 nixl listener proof"
CLIENT_LABEL = b"hixl-v1 nixl listener client proof"
SEAL_CL_LABEL = b"hixl-v1 nixl listener seal client->listener"
SEAL_LC_LABEL = b"hixl-v1 nixl listener seal listener->client"
#: bytes of a nonce, a proof and a MAC
LEN = 32


def address(sockaddr: tuple[object, ...]) -> str:
    """``ip:port`` (``[v6]:port``) of a socket address; an IPv4-mapped IPv6 address is shown
    as the IPv4 one, so both sides of a dual-stack connection name it alike."""
    host, port = str(sockaddr[0]), int(str(sockaddr[1]))
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Key:
    """The side channel's key, derived from the cluster secret (never shown)."""

    def __init__(self, secret: str) -> None:
        self._k = hmac.new(secret.encode(), KEY_LABEL, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "Key(<derived from the cluster secret>)"

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(LEN)

    def session(self, ni: bytes, nt: bytes, dialled: str) -> Session:
        h = hashlib.sha256()
        for part in (ni, nt, dialled.encode()):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        return Session(self._k, h.digest())


class Session:
    """The proofs and MACs of one connection, bound to its transcript."""

    def __init__(self, key: bytes, transcript: bytes) -> None:
        self._k, self._t = key, transcript

    def _mac(self, label: bytes, *parts: bytes) -> bytes:
        m = hmac.new(self._k, label, hashlib.sha256)
        m.update(self._t)
        for p in parts:
            m.update(len(p).to_bytes(4, "little"))
            m.update(p)
        return m.digest()

    def listener_proof(self) -> bytes:
        return self._mac(LISTENER_LABEL)

    def client_proof(self) -> bytes:
        return self._mac(CLIENT_LABEL)

    def seal(self, from_client: bool, kind: bytes, payload: bytes) -> bytes:
        """The MAC of one frame sent after the proofs, under its direction's label."""
        return self._mac(SEAL_CL_LABEL if from_client else SEAL_LC_LABEL, kind, payload)

    @staticmethod
    def same(a: bytes, b: bytes) -> bool:
        return hmac.compare_digest(a, b)


def peer_of(s: socket.socket) -> str:
    """The address the client reached, as the client sees it."""
    return address(s.getpeername())


def local_of(s: socket.socket) -> str:
    """The address the client reached, as the listener sees it."""
    return address(s.getsockname())
