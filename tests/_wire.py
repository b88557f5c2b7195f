"""An independent encoder of hixl's wire format (docs/PROTOCOL.md), for tests that speak raw
bytes to a listener or play a hostile target. Little-endian; header: magic "HX", version,
kind, payload length (u32), tag (u64), bulk length (u64).

Protocol version 4 by default. HIXL_WIRE_VERSION=3 or =2 switches every layout (and, for 2,
the handshake math) to that version, so that the attack tests can be run against an engine
built before v4 (or before v3) and show what differs there.

Region entries are `Region` values, whatever the version: v4 writes them whole (flags,
domain, name, backend keys); v3 and v2 write the `shm` key as their `fd` field (-1 without
one), and their decoders turn a descriptor >= 0 back into an `shm` key. A Welcome carries
capabilities (v4) or a local socket (v3); `welcome_payload` derives either from the other.

Besides frames this module does the handshake math (transcript hash, proofs, session keys)
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

import blake3

VERSION = int(os.environ.get("HIXL_WIRE_VERSION", "4"))
HELLO, WELCOME, WRITE, READ, READ_RESP, ACK, NOTIFY = 1, 2, 3, 4, 5, 6, 7
HEARTBEAT, HEARTBEAT_ACK, ERROR, BYE, REGIONS_QUERY = 8, 9, 10, 11, 12
REGIONS_TABLE, REGIONS_UPDATE, REGIONS_ACK = 13, 14, 15
WRITE_STRIDED, READ_STRIDED, AUTH_CHALLENGE, AUTH_RESPONSE = 16, 17, 18, 19
REGIONS_DELTA = 20  # v4
# What a target sends unprompted on a link's stream 0 when its registry changes.
TABLE_CHANGES = (REGIONS_UPDATE, REGIONS_DELTA) if VERSION >= 4 else (REGIONS_UPDATE,)
MAX_PAYLOAD = 4 << 20
# Welcome, RegionsTable, RegionsUpdate, RegionsDelta (v4: 16 MiB; before: MAX_PAYLOAD).
MAX_TABLE_PAYLOAD = 16 << 20 if VERSION >= 4 else MAX_PAYLOAD
# Most bytes a registry's encoded entries may take (v4; a bigger registration is refused).
MAX_TABLE_BYTES = MAX_TABLE_PAYLOAD - (64 << 10)
MAX_HELLO = 4096
MAX_DESCS = 1 << 16
MAX_NAME = 1024  # engine ids, host, capability param
MAC_LEN = 16
FLAG_DATA_MAC = 1
FLAG_DATA_PATH = 2  # v4: a data-path stream (no region table, no table updates)
HEADER = struct.Struct("<2sBBIQQ")

# v4 region tables and capabilities.
HOST, DEVICE = 0, 1  # memory domains
CUDA = 0x80  # cuda:N is CUDA + N, N <= 127
DOMAINS = (HOST, DEVICE, *range(CUDA, CUDA + 128))
REGION_WRITABLE = 1  # region-entry flag bit 0; the other bits must be 0
MAX_REGIONS = 1 << 16  # entries in one list, ids in one delta's removed list
MAX_REGION_NAME = 255
MAX_KEYS = 8
MAX_BACKEND_NAME = 32
MAX_KEY_LEN = 256
MAX_CAPABILITIES = 16
MAX_DOMAIN_PAIRS = 16


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


# --- Region tables and capabilities ----------------------------------------------------------

# One backend's registration key of a region: (backend name, key bytes).
Key = tuple[str, bytes]


def shm_key(fd: int) -> Key:
    """The `shm` key of engine-allocated memory: the owner's memfd number, i32 LE."""
    return ("shm", struct.pack("<i", fd))


@dataclass(frozen=True)
class Region:
    """A region-table entry. The encoder writes the fields as given (a hostile target may
    offer any domain byte or backend name); the decoder checks them as the spec says."""

    addr: int
    len: int
    id: int
    writable: bool = True
    domain: int = HOST
    name: str = ""
    keys: tuple[Key, ...] = ()

    def __post_init__(self) -> None:
        # Catches a caller still building the 5-tuple of v3, (addr, len, id, fd, writable).
        if not isinstance(self.writable, bool):
            raise TypeError(f"Region.writable must be a bool, not {self.writable!r}")
        if isinstance(self.domain, bool) or not isinstance(self.domain, int):
            raise TypeError(f"Region.domain must be an int, not {self.domain!r}")
        object.__setattr__(self, "keys", tuple((b, bytes(k)) for b, k in self.keys))

    def key(self, backend: str) -> bytes | None:
        """The key `backend` registered for this region, if any."""
        return next((k for b, k in self.keys if b == backend), None)

    @property
    def fd(self) -> int:
        """The owner's memfd number from the `shm` key (what v2/v3 carried), else -1."""
        k = self.key("shm")
        return int(struct.unpack("<i", k)[0]) if k is not None and len(k) == 4 else -1


class Capability(NamedTuple):
    """A data path a target offers in a v4 Welcome: the backend's name, the (initiator's
    domain, target's domain) pairs it serves, and what an initiator needs to open it (the
    same-host socket's name for `shm` and `self`). A plain 3-tuple works wherever one goes."""

    backend: str
    pairs: tuple[tuple[int, int], ...] = ((HOST, HOST),)
    param: str = ""


def default_capabilities(local_socket: str = "") -> list[Capability]:
    """What an engine with `hixl.backends=auto` offers: `self` and `shm` (param: the same-host
    socket's name) when it has a same-host socket, then `tcp`; each for (host, host)."""
    same_host = [Capability("self", param=local_socket), Capability("shm", param=local_socket)]
    return (same_host if local_socket else []) + [Capability("tcp")]


def local_socket_of(capabilities: Iterable[tuple[str, Any, str]]) -> str:
    """The same-host socket's name: the param of the `shm` capability, else of `self`."""
    params = {backend: param for backend, _, param in capabilities}
    return params.get("shm") or params.get("self") or ""


def _short(s: str | bytes, what: str) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    if len(b) > 255:
        raise ValueError(f"{what} of {len(b)} bytes does not fit its u8 length")
    return bytes([len(b)]) + b


def region_entry(r: Region) -> bytes:
    """One entry as this VERSION writes it."""
    if VERSION < 4:
        return struct.pack("<QQQiI", r.addr, r.len, r.id, r.fd, 1 if r.writable else 0)
    name, flags = r.name.encode(), REGION_WRITABLE if r.writable else 0
    out = struct.pack("<QQQBBH", r.addr, r.len, r.id, flags, r.domain, len(name)) + name
    out += bytes([len(r.keys)])
    for backend, key in r.keys:
        out += _short(backend, "backend name") + struct.pack("<H", len(key)) + key
    return out


def regions_payload(regions: Sequence[Region]) -> bytes:
    """A region list: u32 n, then n entries."""
    return struct.pack("<I", len(regions)) + b"".join(region_entry(r) for r in regions)


def capabilities_payload(
    capabilities: Sequence[tuple[str, Iterable[tuple[int, int]], str]],
) -> bytes:
    """u8 count, then per capability: backend name, domain pairs, param (v4)."""
    out = bytes([len(capabilities)])
    for backend, pairs, param in capabilities:
        ps = list(pairs)
        out += _short(backend, "backend name") + bytes([len(ps)])
        out += b"".join(bytes([local, remote]) for local, remote in ps) + text(param)
    return out


def welcome_payload(
    engine_id: str,
    host: str,
    regions: Sequence[Region],
    *,
    capabilities: Sequence[tuple[str, Iterable[tuple[int, int]], str]] | None = None,
    local_socket: str | None = None,
    table_version: int = 1,
    pid: int = 0,
    probe_addr: int = 0,
    probe_token: int = 0,
) -> bytes:
    """A Welcome. v4 carries the capabilities (default: `default_capabilities(local_socket)`,
    i.e. only `tcp` without a local socket) and the table version; v3 the local socket
    (default: the one `capabilities` name) and the table version; v2 the pid and the probe
    (what an imposter replays)."""
    if VERSION >= 4:
        caps = default_capabilities(local_socket or "") if capabilities is None else capabilities
        head = text(engine_id) + text(host) + struct.pack("<Q", table_version)
        return head + capabilities_payload(caps) + regions_payload(regions)
    if VERSION == 3:
        if local_socket is None:
            local_socket = local_socket_of(capabilities or [])
        head = text(engine_id) + text(host) + text(local_socket)
        return head + struct.pack("<Q", table_version) + regions_payload(regions)
    head = text(engine_id) + text(host)
    return head + struct.pack("<IQQ", pid, probe_addr, probe_token) + regions_payload(regions)


def regions_table_payload(version: int, regions: Sequence[Region]) -> bytes:
    """Payload of a RegionsTable or a RegionsUpdate."""
    if VERSION >= 3:
        return struct.pack("<Q", version) + regions_payload(regions)
    return regions_payload(regions)


regions_update_payload = regions_table_payload


def regions_delta_payload(
    from_version: int, version: int, added: Sequence[Region] = (), removed: Sequence[int] = ()
) -> bytes:
    """Payload of a RegionsDelta (v4, kind 20). Not checked: a hostile target may send
    from_version >= version."""
    out = struct.pack("<QQ", from_version, version) + regions_payload(added)
    return out + struct.pack("<I", len(removed)) + b"".join(struct.pack("<Q", i) for i in removed)


class Reader:
    """Reads a payload, checking every field as the spec says (ValueError when one is wrong)."""

    def __init__(self, b: bytes) -> None:
        self.b = b

    def take(self, n: int) -> bytes:
        if len(self.b) < n:
            raise ValueError(f"truncated: need {n} bytes, have {len(self.b)}")
        out, self.b = self.b[:n], self.b[n:]
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def end(self) -> None:
        if self.b:
            raise ValueError(f"{len(self.b)} bytes after the payload's last field")

    def count(self, what: str, limit: int) -> int:
        n = self.u32()
        if n > limit:
            raise ValueError(f"{what} {n}, over {limit}")
        return n

    def backend(self) -> str:
        n = self.u8()
        if not 1 <= n <= MAX_BACKEND_NAME:
            raise ValueError(f"a backend name of {n} bytes")
        b = self.take(n)
        if not b.isascii():
            raise ValueError(f"backend name {b!r} is not ASCII")
        return b.decode()

    def domain(self) -> int:
        d = self.u8()
        if d not in DOMAINS:
            raise ValueError(f"memory domain {d}")
        return d

    def region(self) -> Region:
        if VERSION < 4:
            addr, n, rid, fd, flags = struct.unpack("<QQQiI", self.take(32))
            keys = (shm_key(fd),) if fd >= 0 else ()
            return Region(addr, n, rid, flags == 1, keys=keys)
        addr, n, rid = self.u64(), self.u64(), self.u64()
        flags = self.u8()
        if flags & ~REGION_WRITABLE:
            raise ValueError(f"region flags {flags:#x}")
        domain = self.domain()
        if n == 0 or addr + n >= 1 << 64:
            raise ValueError(f"region [{addr:#x}, +{n:#x})")
        name_len = self.u16()
        if name_len > MAX_REGION_NAME:
            raise ValueError(f"a region name of {name_len} bytes")
        name = self.take(name_len).decode()
        nkeys = self.u8()
        if nkeys > MAX_KEYS:
            raise ValueError(f"{nkeys} region keys")
        found: list[Key] = []
        for _ in range(nkeys):
            backend = self.backend()
            klen = self.u16()
            if klen > MAX_KEY_LEN:
                raise ValueError(f"a region key of {klen} bytes")
            found.append((backend, self.take(klen)))
        return Region(addr, n, rid, flags == REGION_WRITABLE, domain, name, tuple(found))

    def regions(self) -> list[Region]:
        return [self.region() for _ in range(self.count("region count", MAX_REGIONS))]

    def ids(self) -> list[int]:
        return [self.u64() for _ in range(self.count("removed count", MAX_REGIONS))]

    def capabilities(self) -> list[Capability]:
        n = self.u8()
        if n > MAX_CAPABILITIES:
            raise ValueError(f"{n} capabilities")
        out = []
        for _ in range(n):
            backend = self.backend()
            npairs = self.u8()
            if npairs > MAX_DOMAIN_PAIRS:
                raise ValueError(f"{npairs} domain pairs")
            pairs = tuple((self.domain(), self.domain()) for _ in range(npairs))
            out.append(Capability(backend, pairs, self.str(MAX_NAME)))
        return out

    # Defined last: in the methods after it, `str` in an annotation would name this method.
    def str(self, limit: int | None = None) -> str:
        n = self.u32()
        if limit is not None and n > limit:
            raise ValueError(f"a string of {n} bytes, over {limit}")
        return self.take(n).decode()


def decode_hello(payload: bytes) -> dict[str, Any]:
    r = Reader(payload)
    d: dict[str, Any] = {"engine_id": r.str(), "host": r.str()}
    d["link_nonce"], d["stream_index"], d["stream_count"] = r.u64(), r.u16(), r.u16()
    d["auth_nonce"] = r.take(32)
    d["flags"], d["dialled"] = (r.u32(), r.str()) if VERSION >= 3 else (0, "")
    return d


def decode_welcome(payload: bytes) -> dict[str, Any]:
    """engine_id, host, regions; v4: table_version, capabilities, and local_socket (derived:
    the shm/self capability's param, "" without one); v3: local_socket, table_version; v2:
    pid, probe_addr, probe_token."""
    r = Reader(payload)
    d: dict[str, Any] = {"engine_id": r.str(MAX_NAME), "host": r.str(MAX_NAME)}
    if VERSION >= 4:
        d["table_version"], d["capabilities"] = r.u64(), r.capabilities()
        d["local_socket"] = local_socket_of(d["capabilities"])
    elif VERSION == 3:
        d["local_socket"], d["table_version"] = r.str(), r.u64()
    else:
        d["pid"], d["probe_addr"], d["probe_token"] = r.u32(), r.u64(), r.u64()
    d["regions"] = r.regions()
    r.end()
    return d


def decode_regions_table(payload: bytes) -> tuple[int, list[Region]]:
    """(version, regions) of a RegionsTable or RegionsUpdate (v2: version 0)."""
    r = Reader(payload)
    version = r.u64() if VERSION >= 3 else 0
    regions = r.regions()
    r.end()
    return version, regions


def decode_regions_delta(payload: bytes) -> dict[str, Any]:
    """from_version, version, added (regions), removed (ids) of a RegionsDelta (v4)."""
    r = Reader(payload)
    d: dict[str, Any] = {"from_version": r.u64(), "version": r.u64()}
    if d["from_version"] >= d["version"]:
        raise ValueError(f"delta from version {d['from_version']} to {d['version']}")
    d["added"], d["removed"] = r.regions(), r.ids()
    r.end()
    return d


def apply_regions_delta(
    version: int, regions: Sequence[Region], delta: dict[str, Any]
) -> tuple[int, list[Region]]:
    """Table `version` after a decoded delta, as an initiator applies it: a delta not newer
    than the table is ignored; one that starts after the table is a protocol error
    (ValueError); else the removed ids go, then the added entries are inserted or replaced by
    id, and the table takes the delta's version."""
    if delta["version"] <= version:
        return version, list(regions)
    if delta["from_version"] > version:
        raise ValueError(f"a delta from version {delta['from_version']} to a table of {version}")
    removed = set(delta["removed"])
    table = {r.id: r for r in regions if r.id not in removed}
    for r in delta["added"]:
        table[r.id] = r
    return delta["version"], list(table.values())


def decode_challenge(payload: bytes) -> tuple[bytes, bytes, str]:
    """(target nonce, target proof, target engine id); v2 sent no engine id."""
    r = Reader(payload)
    nt, proof = r.take(32), r.take(32)
    return nt, proof, (r.str() if VERSION >= 3 else "")


def status_of(payload: bytes) -> tuple[int, str]:
    """Status and message of an Ack, ReadResp or Error payload."""
    status, n = struct.unpack("<II", payload[:8])
    return status, payload[8 : 8 + n].decode()


# --- The handshake of v3 and v4 (docs/PROTOCOL.md "Handshake"); v2's proofs --------------


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
    (after an authenticated v3/v4 handshake), passes frames through unsealed otherwise."""

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
        """Status, message and bulk of the next Ack/ReadResp, skipping region-table changes."""
        while True:
            kind, _, bulk, payload = self.recv()
            if kind in TABLE_CHANGES:
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
