"""Agent metadata (what ``get_agent_metadata`` returns) and the listen-thread side channel.

Metadata is ``b"HIXLNIXL1\\n"`` followed by UTF-8 JSON: the agent's name, its hixl engine's
address ("ip:port"), and the DRAM regions it registered as ``[addr, len, dev_id]`` rows.
Partial metadata (``get_partial_agent_metadata``) carries only some regions, and the address
only when asked to. `decode` reads it with the bounded parsers of ``hixl._peertext``: it returns
the document or raises ``nixlInvalidParamError``, nothing else.

The side channel is a small TCP protocol of our own (NIXL's listener speaks another one): each
message is ``b"HXNM"``, one kind byte, a little-endian u32 length and that many payload bytes.
Kinds: ``S`` here is my metadata (the receiver loads it), ``F`` send me yours (answered by
``M`` with the metadata, or ``E`` with an error text), ``I`` forget the agent named in the
payload. Every socket operation has a timeout; one connection carries one request. A frame is
at most `frame_cap` of the regions the listener takes (``hixl_listen_thread_max_regions``).
With a cluster secret the request is preceded by the challenge-response of ``_auth`` (``H``,
``C``, ``P``) and the request and its reply end with a MAC (https://github.com/hixl/hixl/blob/main/docs/PROTOCOL.md).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _peertext, _place
from . import _auth
from ._bindings import nixlInvalidParamError

log = logging.getLogger("hixl.nixl")

MAGIC = b"HIXLNIXL1\n"
# NIXL's own serializer starts its metadata with this tag.
NIXL_NATIVE_TAG = b"nixlSerDes|"
FRAME = struct.Struct("<4scI")
FRAME_MAGIC = b"HXNM"
IO_TIMEOUT_S = 5.0
# Connections the listen thread serves at once (nixl_agent_config's hixl_listen_thread_max_conns).
MAX_CONNS = 16
# Agents loaded from the listener at once, and regions one of them may hold
# (hixl_listen_thread_max_agents, hixl_listen_thread_max_regions).
MAX_AGENTS = 64
MAX_REGIONS = 4096
# The most regions an engine holds (its region table): the bound on metadata a program loads.
ENGINE_MAX_REGIONS = 65536
# Metadata besides its regions: name (at most 1019 UTF-8 bytes, 3 JSON characters a byte at
# worst), engine address, keys; then one row "[u64,u64,u64]," a region.
_FIXED_BYTES = 16 << 10
_ROW_BYTES = 72
MAX_NAME_BYTES = 1019
_U64 = (1 << 64) - 1


def frame_cap(max_regions: int) -> int:
    """The largest frame that metadata of `max_regions` regions can need (plus a MAC)."""
    return _FIXED_BYTES + _ROW_BYTES * max_regions + _auth.LEN


def encode(name: str, engine: str | None, regions: list[list[int]], partial: bool = False) -> bytes:
    doc: dict[str, Any] = {"name": name, "regions": regions, "partial": partial}
    if engine is not None:
        doc["engine"] = engine
    return MAGIC + json.dumps(doc, separators=(",", ":")).encode()


def decode(md: Any, max_regions: int = ENGINE_MAX_REGIONS) -> dict[str, Any]:
    """The parsed metadata, with at most `max_regions` regions; anything else (not written by
    `encode`, corrupt, over a bound) raises nixlInvalidParamError saying what it looks like.
    Never raises anything else, whatever the bytes."""
    if isinstance(md, str):
        md = md.encode("latin-1", "replace")
    if not isinstance(md, (bytes, bytearray, memoryview)):
        raise nixlInvalidParamError(f"agent metadata must be bytes, not {type(md).__name__}")
    md = bytes(md)
    if not md.startswith(MAGIC):
        if md.startswith(NIXL_NATIVE_TAG) or b"nixlSerDes" in md[:64]:
            raise nixlInvalidParamError(
                "this metadata comes from a real NIXL agent (its own serialization); hixl.nixl "
                "agents can only load the metadata of hixl.nixl agents, and NIXL's UCX/"
                "LIBFABRIC wire protocols are not spoken by hixl"
            )
        raise nixlInvalidParamError(
            f"not hixl.nixl agent metadata ({len(md)} bytes starting {md[:16]!r}; expected "
            f"the prefix {MAGIC!r})"
        )
    try:
        what = "hixl.nixl agent metadata"
        doc = _peertext.obj(_peertext.loads(md[len(MAGIC) :], what, frame_cap(max_regions)), what)
        name = _peertext.text(doc.get("name"), "agent name", MAX_NAME_BYTES)
        if not name or len(name.encode(errors="replace")) > MAX_NAME_BYTES:
            raise _peertext.Malformed(f"agent name {_peertext.shown(name)} is not 1..1019 bytes")
        engine = doc.get("engine")
        if engine is not None:
            engine = _peertext.text(engine, "engine address", 512)
        for field, v in (("agent name", name), ("engine address", engine or "")):
            try:
                v.encode()
            except UnicodeEncodeError:
                raise _peertext.Malformed(f"{field} {_peertext.shown(v)} is not Unicode") from None
        partial = doc.get("partial", False)
        if not isinstance(partial, bool):
            raise _peertext.Malformed(
                f"partial must be true or false, not {_peertext.shown(partial)}"
            )
        rows = []
        where = "regions"
        if max_regions != ENGINE_MAX_REGIONS:
            where = f"regions (hixl_listen_thread_max_regions={max_regions})"
        for i, row in enumerate(_peertext.array(doc.get("regions"), where, max_regions)):
            row = _peertext.array(row, f"region {i}", 3)
            if len(row) != 3:
                raise _peertext.Malformed(f"region {i} has {len(row)} items, not 3")
            a, n, d = row
            a = _peertext.integer(a, f"region {i} address", 0, _U64)
            n = _peertext.integer(n, f"region {i} length", 0, _U64 - a)
            rows.append([a, n, _peertext.integer(d, f"region {i} device", 0, _U64)])
    except _peertext.Malformed as e:
        raise nixlInvalidParamError(f"hixl.nixl agent metadata is refused: {e}") from None
    out: dict[str, Any] = {"name": name, "regions": rows, "partial": partial}
    if engine is not None:
        out["engine"] = engine
    return out


# --- side channel --------------------------------------------------------------------------


def _recv_exact(s: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with `deadline` (a `time.monotonic()` value) the whole read must end by then,
    so a peer that trickles bytes cannot hold the connection longer than one timeout."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("side channel: request not complete within the timeout")
            s.settimeout(left)
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("side channel: peer closed the connection early")
        buf += chunk
    return bytes(buf)


def send_frame(
    s: socket.socket,
    kind: bytes,
    payload: bytes,
    seal: _auth.Session | None = None,
    from_client: bool = False,
) -> None:
    """One frame; with `seal`, its MAC appended to the payload."""
    if seal is not None:
        payload = payload + seal.seal(from_client, kind, payload)
    s.sendall(FRAME.pack(FRAME_MAGIC, kind, len(payload)) + payload)


def recv_header(
    s: socket.socket, deadline: float | None, max_frame: int, limit: str
) -> tuple[bytes, int]:
    """A frame's kind and length, refusing a length over `max_frame` (`limit` names the
    option that sets it) before any byte of the payload is read."""
    magic, kind, n = FRAME.unpack(_recv_exact(s, FRAME.size, deadline))
    if magic != FRAME_MAGIC:
        raise ConnectionError(f"side channel: not a hixl.nixl listener (got {magic!r})")
    if n > max_frame:
        raise ConnectionError(
            f"side channel: frame of {n} bytes is over the limit of {max_frame} ({limit})"
        )
    return kind, n


def recv_frame(
    s: socket.socket,
    deadline: float | None = None,
    max_frame: int = frame_cap(MAX_REGIONS),
    limit: str = f"hixl_listen_thread_max_regions={MAX_REGIONS}",
    seal: _auth.Session | None = None,
    from_client: bool = False,
) -> tuple[bytes, bytes]:
    """One frame; with `seal`, its MAC is checked and removed (ConnectionError when wrong)."""
    kind, n = recv_header(s, deadline, max_frame, limit)
    payload = _recv_exact(s, n, deadline)
    if seal is not None:
        body, tag = payload[: -_auth.LEN], payload[-_auth.LEN :]
        if len(payload) < _auth.LEN or not seal.same(tag, seal.seal(from_client, kind, body)):
            raise ConnectionError("side channel: a frame's MAC does not verify")
        payload = body
    return kind, payload


def handshake_client(s: socket.socket, key: _auth.Key, deadline: float | None) -> _auth.Session:
    """The client's side of the challenge-response: raises ConnectionError unless the listener
    proves that it has the secret; then proves it too."""
    ni = key.nonce()
    send_frame(s, b"H", ni)
    try:
        kind, n = recv_header(s, deadline, 2 * _auth.LEN, "a challenge")
        body = _recv_exact(s, n, deadline)
    except ConnectionError as e:
        raise ConnectionError(
            f"side channel: the listener did not answer the cluster-secret challenge (does it "
            f"have the secret?): {e}"
        ) from None
    if kind != b"C" or n != 2 * _auth.LEN:
        raise ConnectionError(f"side channel: expected a challenge, got {kind!r} of {n} bytes")
    nt, proof = body[: _auth.LEN], body[_auth.LEN :]
    sess = key.session(ni, nt, _auth.peer_of(s))
    if not sess.same(proof, sess.listener_proof()):
        raise ConnectionError(
            "side channel: the listener's proof of the cluster secret does not verify (another "
            "secret, or not the listener that was dialled)"
        )
    send_frame(s, b"P", sess.client_proof())
    return sess


def request(
    ip: str,
    port: int,
    kind: bytes,
    payload: bytes,
    want_reply: bool,
    key: _auth.Key | None = None,
    max_regions: int = MAX_REGIONS,
) -> tuple[bytes, bytes] | None:
    """One request to a listener at ip:port; its reply when `want_reply`. With `key` (the
    cluster secret's), the listener and this client prove it to each other first."""
    with socket.create_connection((ip, port), timeout=IO_TIMEOUT_S) as s:
        s.settimeout(IO_TIMEOUT_S)
        sess = handshake_client(s, key, time.monotonic() + IO_TIMEOUT_S) if key else None
        send_frame(s, kind, payload, sess, True)
        if want_reply:
            limit = f"hixl_listen_thread_max_regions={max_regions}"
            return recv_frame(s, None, frame_cap(max_regions), limit, sess, False)
        # Wait for the listener to close: it has then handled the request.
        try:
            s.recv(1)
        except OSError:
            pass
    return None


def bind_host(engine: str) -> str:
    """The host part of an engine address ("ip:port" or "[v6]:port"): where the listen thread
    binds by default, so that it is reachable exactly where the engine is."""
    if "#" in engine:  # a client-only engine ("ip#pid") has no port
        return engine.split("#", 1)[0]
    host = engine.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class Unauthenticated(Exception):
    """A connection that did not prove the cluster secret; the message says how."""


def check_count(option: str, v: object, most: int) -> int:
    """`v` when it is an int in [1, most]; else nixlInvalidParamError naming `option`."""
    if type(v) is not int or not 1 <= v <= most:
        raise nixlInvalidParamError(f"{option} must be an integer in [1, {most}], not {v!r}")
    return v


class Listener:
    """The listen thread: serves this agent's metadata and loads what peers send.

    At most `max_conns` connections are served at once, each by a thread of its own, and each
    must deliver its whole request within `timeout_s`. A connection over the cap closes the
    oldest one still sending its request (or, when every one is past that, is closed itself),
    so idle connections cost at most `max_conns` threads for at most `timeout_s` each. A
    request longer than `frame_cap(max_regions)` is refused from its header, before any of its
    payload is read. With `key` (derived from the cluster secret) a connection must pass the
    challenge-response of ``_auth`` before its request is read: one that sends anything else
    first is closed after the 9 bytes of that frame's header.
    `load` and `forget` get the payload and the peer's address ("ip:port", for the log)."""

    def __init__(
        self,
        host: str,
        port: int,
        metadata: Callable[[], bytes],
        load: Callable[[bytes, str], object],
        forget: Callable[[str, str], object],
        max_conns: int = MAX_CONNS,
        timeout_s: float = IO_TIMEOUT_S,
        max_regions: int = MAX_REGIONS,
        key: _auth.Key | None = None,
    ) -> None:
        check_count("hixl_listen_thread_max_regions", max_regions, ENGINE_MAX_REGIONS)
        if isinstance(max_conns, bool) or not isinstance(max_conns, int) or max_conns < 1:
            raise nixlInvalidParamError(
                f"hixl_listen_thread_max_conns must be an integer >= 1, not {max_conns!r}"
            )
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (0 < timeout_s <= 3600)
        ):
            raise nixlInvalidParamError(
                f"hixl_listen_thread_timeout_s must be seconds in (0, 3600], not {timeout_s!r}"
            )
        self._metadata, self._load, self._forget = metadata, load, forget
        self.max_conns, self.timeout_s = max_conns, float(timeout_s)
        self.max_regions, self.max_frame = max_regions, frame_cap(max_regions)
        self._limit = f"hixl_listen_thread_max_regions={max_regions}"
        self._key = key
        self._refused: dict[str, list[float]] = {}  # why -> [count, next warning at]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(0.2)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Connections being served -> whether each is still reading its request (evictable).
        self._conns: dict[socket.socket, bool] = {}
        self._cuts, self._warn_at = 0, 0.0
        self._serving: set[threading.Thread] = set()
        self._thread = _place.thread(self._run, name="hixl-nixl-listen")
        self._thread.start()

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        """Makes room for `conn` under the cap; False when every slot is past its read."""
        with self._lock:
            if len(self._conns) < self.max_conns:
                self._conns[conn] = True
                return True
            oldest = next((c for c, reading in self._conns.items() if reading), None)
            if oldest is not None:
                del self._conns[oldest]
                self._conns[conn] = True
            self._cuts += 1
            warn = time.monotonic() >= self._warn_at  # at most one line per 10 s
            if warn:
                self._warn_at = time.monotonic() + 10.0
        if warn:
            log.warning(
                "hixl.nixl listener: %d connections open (hixl_listen_thread_max_conns): %s "
                "(%d so far)",
                self.max_conns,
                f"the oldest still sending its request closed to admit {peer}"
                if oldest is not None
                else f"every one is being handled, {peer} closed",
                self._cuts,
            )
        if oldest is None:
            return False
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # wakes its thread, which then closes it
        except OSError:
            pass
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}"
            if not self._admit(conn, peer):
                conn.close()
                continue
            t = _place.thread(self._serve, args=(conn, peer), name="hixl-nixl-serve")
            with self._lock:
                self._serving = {x for x in self._serving if x.is_alive()}
                self._serving.add(t)
            t.start()

    def _refuse(self, why: str, peer: str, detail: object) -> None:
        """Logs a refused connection: one WARN per reason per 10 s, with the count."""
        with self._lock:
            n, at = self._refused.get(why, [0.0, 0.0])
            now = time.monotonic()
            self._refused[why] = [n + 1, now + 10.0 if now >= at else at]
        if now >= at:
            log.warning(
                "hixl.nixl listener: %s from %s refused: %s (%d so far)",
                why,
                peer,
                _peertext.shown(str(detail)),
                n + 1,
            )

    def _authenticate(self, conn: socket.socket, deadline: float) -> _auth.Session:
        """The listener's side of the challenge-response; ConnectionError when the client
        does not prove the secret (nothing but the fixed-size `H` and `P` is read before)."""
        assert self._key is not None
        magic, kind, n = FRAME.unpack(_recv_exact(conn, FRAME.size, deadline))
        if magic != FRAME_MAGIC or kind != b"H" or n != _auth.LEN:
            raise Unauthenticated(
                f"no cluster-secret hello ({kind!r} of {n} bytes first): it does not have the "
                "secret, its request is not read"
            )
        ni = _recv_exact(conn, n, deadline)
        nt = self._key.nonce()
        sess = self._key.session(ni, nt, _auth.local_of(conn))
        send_frame(conn, b"C", nt + sess.listener_proof())
        magic, kind, n = FRAME.unpack(_recv_exact(conn, FRAME.size, deadline))
        ok = magic == FRAME_MAGIC and kind == b"P" and n == _auth.LEN
        proof = _recv_exact(conn, n, deadline) if ok else b""
        if not sess.same(proof, sess.client_proof()):
            raise Unauthenticated("its proof of the cluster secret does not verify")
        return sess

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                deadline = time.monotonic() + self.timeout_s
                sess = self._authenticate(conn, deadline) if self._key is not None else None
                kind, payload = recv_frame(conn, deadline, self.max_frame, self._limit, sess, True)
                with self._lock:
                    if conn not in self._conns:
                        return  # evicted while its last bytes arrived
                    self._conns[conn] = False
                conn.settimeout(self.timeout_s)
                if kind == b"F":
                    try:
                        send_frame(conn, b"M", self._metadata(), sess)
                    except Exception as e:  # the agent is closing
                        send_frame(conn, b"E", str(e).encode(), sess)
                elif kind == b"S":
                    try:
                        self._load(payload, peer)
                    except Exception as e:  # refused: over a cap, re-pointing, corrupt
                        self._refuse("metadata", peer, e)
                elif kind == b"I":
                    conn.close()  # the sender need not wait for the check below
                    name = _peertext.text(
                        payload.decode(errors="replace"), "agent name", MAX_NAME_BYTES
                    )
                    self._forget(name, peer)
                else:
                    self._refuse("unknown request", peer, kind)
        except Unauthenticated as e:
            self._refuse("unauthenticated connection", peer, e)
        except (OSError, ConnectionError) as e:  # cut, slow or gone: the peer's doing
            with self._lock:
                cut = conn not in self._conns
            if not cut:
                if "over the limit" in str(e):
                    self._refuse("request", peer, e)
                else:
                    log.info("hixl.nixl listener: connection from %s closed: %s", peer, e)
        except Exception as e:
            log.warning("hixl.nixl listener: request from %s failed: %r", peer, e)
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def close(self) -> None:
        """Stops accepting and waits for the requests being served: none may still be inside
        the engine when it is finalized (or when the interpreter exits)."""
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=2.0)
        with self._lock:
            serving = list(self._serving)
            reading = [c for c, r in self._conns.items() if r]
        for c in reading:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in serving:
            t.join(timeout=2 * self.timeout_s + 5.0)
