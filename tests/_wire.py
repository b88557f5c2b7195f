"""An independent encoder of hixl's wire format (docs/PROTOCOL.md), for tests that speak raw
bytes to a listener or play a hostile target. Little-endian; header: magic "HX", version,
kind, payload length (u32), tag (u64), bulk length (u64).

Protocol version 3 by default; HIXL_WIRE_VERSION=2 switches every layout (and the handshake
math) to version 2, so that the attack tests can be run against an engine built before v3 and
show that the attacks succeed there.

Besides frames this module does the v3 handshake math (transcript hash, proofs, session keys)
and seals/opens frames on an authenticated stream (`Stream`), so that a test can be an
initiator that knows the secret, or an attacker on the path that does not.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import struct
from typing import Any, Self

import blake3

VERSION = int(os.environ.get("HIXL_WIRE_VERSION", "3"))
HELLO, WELCOME, WRITE, READ, READ_RESP, ACK, NOTIFY = 1, 2, 3, 4, 5, 6, 7
HEARTBEAT, HEARTBEAT_ACK, ERROR, BYE, REGIONS_QUERY = 8, 9, 10, 11, 12
REGIONS_TABLE, REGIONS_UPDATE, REGIONS_ACK = 13, 14, 15
WRITE_STRIDED, READ_STRIDED, AUTH_CHALLENGE, AUTH_RESPONSE = 16, 17, 18, 19
MAX_PAYLOAD = 4 << 20
MAX_HELLO = 4096
MAX_DESCS = 1 << 16
MAC_LEN = 16
FLAG_DATA_MAC = 1
HEADER = struct.Struct("<2sBBIQQ")


def header(
    kind: int,
    payload_len: int,
    tag: int = 0,
    bulk: int = 0,
    magic: bytes = b"HX",
    version: int = VERSION,
) -> bytes:
    return HEADER.pack(magic, version, kind, payload_len, tag, bulk)


def frame(kind: int, payload: bytes = b"", tag: int = 0, bulk: int = 0) -> bytes:
    return header(kind, len(payload), tag, bulk) + payload


def text(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<I", len(b)) + b


def addr_text(addr: tuple[Any, ...]) -> str:
    """A socket address as the protocol writes it: `127.0.0.1:4000`, `[::1]:4000`; an
    IPv4-mapped IPv6 address as IPv4."""
    ip = ipaddress.ip_address(addr[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv6Address):
        return f"[{ip}]:{addr[1]}"
    return f"{ip}:{addr[1]}"


def dialled_of(sock: socket.socket) -> str:
    """What an initiator puts in Hello's `dialled`: the address its socket is connected to."""
    return addr_text(sock.getpeername())


def hello_payload(
    engine: str = "raw-client",
    host: str = "elsewhere",
    index: int = 0,
    auth_nonce: bytes = bytes(32),
    link_nonce: int = 1,
    count: int = 1,
    flags: int = 0,
    dialled: str = "",
) -> bytes:
    p = text(engine) + text(host) + struct.pack("<QHH", link_nonce, index, count) + auth_nonce
    if VERSION >= 3:
        p += struct.pack("<I", flags) + text(dialled)
    return p


def hello(
    engine: str = "raw-client",
    host: str = "elsewhere",
    index: int = 0,
    auth_nonce: bytes = bytes(32),
    link_nonce: int = 1,
    count: int = 1,
    flags: int = 0,
    dialled: str = "",
) -> bytes:
    return frame(
        HELLO, hello_payload(engine, host, index, auth_nonce, link_nonce, count, flags, dialled)
    )


def segs(pairs: list[tuple[int, int]]) -> bytes:
    return struct.pack("<I", len(pairs)) + b"".join(struct.pack("<QQ", a, n) for a, n in pairs)


def strided(addr: int, count: int, size: int, stride: int) -> bytes:
    return struct.pack("<QQQQ", addr, count, size, stride)


def status_payload(status: int, message: str = "") -> bytes:
    """Payload of an Ack, ReadResp or Error."""
    return struct.pack("<I", status) + text(message)


# A region-table entry: (addr, len, id, fd, writable).
Region = tuple[int, int, int, int, bool]


def regions_payload(regions: list[Region]) -> bytes:
    out = struct.pack("<I", len(regions))
    for addr, n, rid, fd, writable in regions:
        out += struct.pack("<QQQiI", addr, n, rid, fd, 1 if writable else 0)
    return out


def welcome_payload(
    engine_id: str,
    host: str,
    regions: list[Region],
    local_socket: str = "",
    table_version: int = 1,
    pid: int = 0,
    probe_addr: int = 0,
    probe_token: int = 0,
) -> bytes:
    """A Welcome: v3 names the local socket and the table version; v2 carried the pid and the
    probe (what an imposter replays)."""
    if VERSION >= 3:
        head = text(engine_id) + text(host) + text(local_socket)
        return head + struct.pack("<Q", table_version) + regions_payload(regions)
    head = text(engine_id) + text(host)
    return head + struct.pack("<IQQ", pid, probe_addr, probe_token) + regions_payload(regions)


def regions_table_payload(version: int, regions: list[Region]) -> bytes:
    if VERSION >= 3:
        return struct.pack("<Q", version) + regions_payload(regions)
    return regions_payload(regions)


class Reader:
    def __init__(self, b: bytes) -> None:
        self.b = b

    def take(self, n: int) -> bytes:
        if len(self.b) < n:
            raise ValueError(f"truncated: need {n} bytes, have {len(self.b)}")
        out, self.b = self.b[:n], self.b[n:]
        return out

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def str(self) -> str:
        return self.take(self.u32()).decode()

    def regions(self) -> list[Region]:
        out = []
        for _ in range(self.u32()):
            addr, n, rid, fd, flags = struct.unpack("<QQQiI", self.take(32))
            out.append((addr, n, rid, fd, flags == 1))
        return out


def decode_hello(payload: bytes) -> dict[str, Any]:
    r = Reader(payload)
    d: dict[str, Any] = {"engine_id": r.str(), "host": r.str()}
    d["link_nonce"], d["stream_index"], d["stream_count"] = r.u64(), r.u16(), r.u16()
    d["auth_nonce"] = r.take(32)
    d["flags"], d["dialled"] = (r.u32(), r.str()) if VERSION >= 3 else (0, "")
    return d


def decode_welcome(payload: bytes) -> dict[str, Any]:
    r = Reader(payload)
    d: dict[str, Any] = {"engine_id": r.str(), "host": r.str()}
    if VERSION >= 3:
        d["local_socket"], d["table_version"] = r.str(), r.u64()
    else:
        d["pid"], d["probe_addr"], d["probe_token"] = r.u32(), r.u64(), r.u64()
    d["regions"] = r.regions()
    return d


def decode_challenge(payload: bytes) -> tuple[bytes, bytes, str]:
    """(target nonce, target proof, target engine id); v2 sent no engine id."""
    r = Reader(payload)
    nt, proof = r.take(32), r.take(32)
    return nt, proof, (r.str() if VERSION >= 3 else "")


def status_of(payload: bytes) -> tuple[int, str]:
    """Status and message of an Ack, ReadResp or Error payload."""
    status, n = struct.unpack("<II", payload[:8])
    return status, payload[8 : 8 + n].decode()


# --- The v3 handshake (docs/PROTOCOL.md "Handshake") -----------------------------------------


def lp(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<I", len(b)) + b


def transcript(
    ni: bytes,
    nt: bytes,
    initiator: str,
    target: str,
    dialled: str,
    link_nonce: int,
    stream_index: int,
    flags: int,
) -> bytes:
    """h: SHA-256 over every field of the handshake, each length-prefixed."""
    fields = [
        ni,
        nt,
        initiator.encode(),
        target.encode(),
        dialled.encode(),
        struct.pack("<Q", link_nonce),
        struct.pack("<H", stream_index),
        struct.pack("<I", flags),
    ]
    return hashlib.sha256(b"".join(lp(f) for f in fields)).digest()


def _hm(secret: str, label: bytes, h: bytes) -> bytes:
    return hmac.new(secret.encode(), label + h, hashlib.sha256).digest()


def target_proof(secret: str, h: bytes) -> bytes:
    return _hm(secret, b"hixl-v3 target proof", h)


def initiator_proof(secret: str, h: bytes) -> bytes:
    return _hm(secret, b"hixl-v3 initiator proof", h)


def session_keys(secret: str, h: bytes) -> tuple[bytes, bytes]:
    """(key_IT, key_TI)."""
    return (
        _hm(secret, b"hixl-v3 key initiator->target", h),
        _hm(secret, b"hixl-v3 key target->initiator", h),
    )


def v2_proofs(secret: str, ni: bytes, nt: bytes) -> tuple[bytes, bytes]:
    """(target proof, initiator proof) of protocol v2: nonces and a label, nothing else."""

    def m(label: bytes) -> bytes:
        return hmac.new(secret.encode(), label + ni + nt, hashlib.sha256).digest()

    return m(b"hixl-auth-v1 target proof"), m(b"hixl-auth-v1 initiator proof")


def mac(key: bytes, seq: int, *parts: bytes) -> bytes:
    """A frame MAC: BLAKE3-keyed(key, le64(seq) | header | payload)[0..16]."""
    return blake3.blake3(struct.pack("<Q", seq) + b"".join(parts), key=key).digest()[:MAC_LEN]


def data_mac(key: bytes, seq: int, bulk: bytes) -> bytes:
    """The MAC after a frame's bulk (Hello flag bit 0)."""
    return mac(key, seq, b"bulk", bulk)


# --- Streams ---------------------------------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(kind, tag, bulk_len, payload) of an unsealed frame; the bulk is left on the socket."""
    magic, version, kind, plen, tag, bulk = HEADER.unpack(recv_exact(sock, 24))
    assert magic == b"HX" and version == VERSION, (magic, version)
    return kind, tag, bulk, recv_exact(sock, plen)


class MacError(Exception):
    """A frame from the peer did not carry the right MAC."""


class Refused(Exception):
    """The listener answered the handshake with an Error frame."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class Stream:
    """One end of a stream: seals what it sends and checks what it reads when it has keys
    (after an authenticated v3 handshake), passes frames through unsealed otherwise."""

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes | None = None,
        recv_key: bytes | None = None,
        data_macs: bool = False,
    ) -> None:
        self.sock = sock
        self.send_key, self.recv_key = send_key, recv_key
        self.data_macs = data_macs and send_key is not None
        self.send_seq = 0
        self.recv_seq = 0
        self.last_recv_seq = 0

    @property
    def sealed(self) -> bool:
        return self.send_key is not None

    def seal(self, kind: int, payload: bytes = b"", tag: int = 0, bulk_len: int = 0) -> bytes:
        """Header + payload + MAC of the next frame this end sends (counts it)."""
        f = header(kind, len(payload), tag, bulk_len) + payload
        if self.send_key is not None:
            f += mac(self.send_key, self.send_seq, f)
            self.send_seq += 1
        return f

    def encode(self, kind: int, payload: bytes = b"", tag: int = 0, bulk: bytes = b"") -> bytes:
        """A whole frame as it goes on the wire: sealed head, bulk, data MAC if on."""
        seq = self.send_seq
        out = self.seal(kind, payload, tag, len(bulk)) + bulk
        if self.data_macs and self.send_key is not None and bulk:
            out += data_mac(self.send_key, seq, bulk)
        return out

    def send(self, kind: int, payload: bytes = b"", tag: int = 0, bulk: bytes = b"") -> bytes:
        out = self.encode(kind, payload, tag, bulk)
        self.sock.sendall(out)
        return out

    def recv(self) -> tuple[int, int, int, bytes]:
        """(kind, tag, bulk_len, payload) of the next frame, its MAC checked."""
        head = recv_exact(self.sock, 24)
        magic, version, kind, plen, tag, bulk = HEADER.unpack(head)
        assert magic == b"HX" and version == VERSION, (magic, version)
        payload = recv_exact(self.sock, plen)
        if self.recv_key is not None:
            got = recv_exact(self.sock, MAC_LEN)
            if not hmac.compare_digest(got, mac(self.recv_key, self.recv_seq, head, payload)):
                raise MacError(f"frame {self.recv_seq} (kind {kind}) has a wrong MAC")
            self.last_recv_seq = self.recv_seq
            self.recv_seq += 1
        return kind, tag, bulk, payload

    def recv_bulk(self, n: int) -> bytes:
        data = recv_exact(self.sock, n)
        if self.data_macs and self.recv_key is not None and n:
            got = recv_exact(self.sock, MAC_LEN)
            if got != data_mac(self.recv_key, self.last_recv_seq, data):
                raise MacError("wrong data MAC")
        return data

    def answer(self, want: int) -> tuple[int, str, bytes]:
        """Status, message and bulk of the next Ack/ReadResp, skipping region updates."""
        while True:
            kind, _, bulk, payload = self.recv()
            if kind == REGIONS_UPDATE:
                continue
            if kind == ERROR:
                raise Refused(*status_of(payload))
            assert kind == want, kind
            status, message = status_of(payload)
            return status, message, self.recv_bulk(bulk) if bulk else b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def handshake(
    sock: socket.socket,
    secret: str | None = None,
    engine: str = "raw-client",
    host: str = "elsewhere",
    index: int = 0,
    count: int = 1,
    link_nonce: int = 1,
    flags: int = 0,
    dialled: str | None = None,
) -> tuple[Stream, dict[str, Any]]:
    """Does an initiator's handshake on a connected socket (authenticating with `secret` when
    the target challenges); returns the stream, sealed when authenticated, and the Welcome.
    Raises Refused when the target answers with an Error."""
    ni = os.urandom(32)
    d = dialled_of(sock) if dialled is None else dialled
    sock.sendall(hello(engine, host, index, ni, link_nonce, count, flags, d))
    kind, _, _, payload = read_frame(sock)
    st = Stream(sock)
    if kind == AUTH_CHALLENGE:
        if secret is None:
            raise Refused(0, "the target asks for a secret")
        nt, proof, target = decode_challenge(payload)
        if VERSION >= 3:
            h = transcript(ni, nt, engine, target, d, link_nonce, index, flags)
            if not hmac.compare_digest(proof, target_proof(secret, h)):
                raise Refused(0, "the target's proof is wrong")
            sock.sendall(frame(AUTH_RESPONSE, initiator_proof(secret, h)))
            kit, kti = session_keys(secret, h)
            st = Stream(sock, kit, kti, bool(flags & FLAG_DATA_MAC))
        else:
            pt, pi = v2_proofs(secret, ni, nt)
            if not hmac.compare_digest(proof, pt):
                raise Refused(0, "the target's proof is wrong")
            sock.sendall(frame(AUTH_RESPONSE, pi))
        kind, _, _, payload = st.recv()
    if kind == ERROR:
        raise Refused(*status_of(payload))
    assert kind == WELCOME, kind
    return st, decode_welcome(payload)


def connect(
    addr: tuple[str, int],
    secret: str | None = None,
    source: str | None = None,
    timeout: float = 5.0,
    **kw: Any,
) -> tuple[Stream, dict[str, Any]]:
    """A new TCP connection to `addr` (from `source` if given) with the handshake done."""
    sock = socket.socket()
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect(addr)
        return handshake(sock, secret, **kw)
    except BaseException:
        sock.close()
        raise


def host_id() -> str:
    """This machine's identity as engines write it in Hello and Welcome (boot id/host name)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.uname().nodename}"
