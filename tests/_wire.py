"""A minimal encoder of hixl's wire format (crates/hixl-core/src/wire.rs), for tests that
speak raw bytes to a listener. Little-endian; header: magic "HX", version, kind, payload
length (u32), tag (u64), bulk length (u64)."""

from __future__ import annotations

import socket
import struct

VERSION = 2
HELLO, WELCOME, WRITE, READ, READ_RESP, ACK, NOTIFY = 1, 2, 3, 4, 5, 6, 7
HEARTBEAT, HEARTBEAT_ACK, ERROR, BYE, REGIONS_UPDATE = 8, 9, 10, 11, 14
WRITE_STRIDED, READ_STRIDED, AUTH_CHALLENGE, AUTH_RESPONSE = 16, 17, 18, 19
MAX_PAYLOAD = 4 << 20
MAX_DESCS = 1 << 16


def header(
    kind: int,
    payload_len: int,
    tag: int = 0,
    bulk: int = 0,
    magic: bytes = b"HX",
    version: int = VERSION,
) -> bytes:
    return struct.pack("<2sBBIQQ", magic, version, kind, payload_len, tag, bulk)


def frame(kind: int, payload: bytes = b"", tag: int = 0, bulk: int = 0) -> bytes:
    return header(kind, len(payload), tag, bulk) + payload


def text(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<I", len(b)) + b


def hello(
    engine: str = "raw-client",
    host: str = "elsewhere",
    index: int = 0,
    auth_nonce: bytes = bytes(32),
) -> bytes:
    return frame(HELLO, text(engine) + text(host) + struct.pack("<QHH", 1, index, 1) + auth_nonce)


def segs(pairs: list[tuple[int, int]]) -> bytes:
    return struct.pack("<I", len(pairs)) + b"".join(struct.pack("<QQ", a, n) for a, n in pairs)


def strided(addr: int, count: int, size: int, stride: int) -> bytes:
    return struct.pack("<QQQQ", addr, count, size, stride)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(kind, tag, bulk_len, payload); the bulk is left on the socket."""
    magic, version, kind, plen, tag, bulk = struct.unpack("<2sBBIQQ", recv_exact(sock, 24))
    assert magic == b"HX" and version == VERSION, (magic, version)
    return kind, tag, bulk, recv_exact(sock, plen)


def status_of(payload: bytes) -> tuple[int, str]:
    """Status and message of an Ack, ReadResp or Error payload."""
    status, n = struct.unpack("<II", payload[:8])
    return status, payload[8 : 8 + n].decode()
