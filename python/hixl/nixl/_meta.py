"""Agent metadata (what ``get_agent_metadata`` returns) and the listen-thread side channel.

Metadata is ``b"HIXLNIXL1\\n"`` followed by UTF-8 JSON: the agent's name, its hixl engine's
address ("ip:port"), and the DRAM regions it registered as ``[addr, len, dev_id]`` rows.
Partial metadata (``get_partial_agent_metadata``) carries only some regions, and the address
only when asked to.

The side channel is a small TCP protocol of our own (NIXL's listener speaks another one): each
message is ``b"HXNM"``, one kind byte, a little-endian u32 length and that many payload bytes.
Kinds: ``S`` here is my metadata (the receiver loads it), ``F`` send me yours (answered by
``M`` with the metadata, or ``E`` with an error text), ``I`` forget the agent named in the
payload. Every socket operation has a timeout; one connection carries one request.
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

from ._bindings import nixlInvalidParamError

log = logging.getLogger("hixl.nixl")

MAGIC = b"HIXLNIXL1\n"
# NIXL's own serializer starts its metadata with this tag.
NIXL_NATIVE_TAG = b"nixlSerDes|"
FRAME = struct.Struct("<4scI")
FRAME_MAGIC = b"HXNM"
MAX_FRAME = 64 << 20
IO_TIMEOUT_S = 5.0
# Connections the listen thread serves at once (nixl_agent_config's hixl_listen_thread_max_conns).
MAX_CONNS = 16


def encode(name: str, engine: str | None, regions: list[list[int]], partial: bool = False) -> bytes:
    doc: dict[str, Any] = {"name": name, "regions": regions, "partial": partial}
    if engine is not None:
        doc["engine"] = engine
    return MAGIC + json.dumps(doc, separators=(",", ":")).encode()


def decode(md: Any) -> dict[str, Any]:
    """The parsed metadata; anything not written by `encode` raises nixlInvalidParamError
    saying what it looks like."""
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
        doc = json.loads(md[len(MAGIC) :])
        name = doc["name"]
        regions = doc["regions"]
        engine = doc.get("engine")
        ok = (
            isinstance(name, str)
            and name
            and (engine is None or isinstance(engine, str))
            and isinstance(regions, list)
            and all(
                isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) for v in r)
                for r in regions
            )
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise nixlInvalidParamError(f"hixl.nixl agent metadata is corrupt: {e}") from None
    if not ok:
        raise nixlInvalidParamError("hixl.nixl agent metadata is corrupt: bad fields")
    return dict(doc)


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


def send_frame(s: socket.socket, kind: bytes, payload: bytes) -> None:
    s.sendall(FRAME.pack(FRAME_MAGIC, kind, len(payload)) + payload)


def recv_frame(s: socket.socket, deadline: float | None = None) -> tuple[bytes, bytes]:
    magic, kind, n = FRAME.unpack(_recv_exact(s, FRAME.size, deadline))
    if magic != FRAME_MAGIC:
        raise ConnectionError(f"side channel: not a hixl.nixl listener (got {magic!r})")
    if n > MAX_FRAME:
        raise ConnectionError(f"side channel: frame of {n} bytes is over the limit")
    return kind, _recv_exact(s, n, deadline)


def request(
    ip: str, port: int, kind: bytes, payload: bytes, want_reply: bool
) -> tuple[bytes, bytes] | None:
    """One request to a listener at ip:port; its reply when `want_reply`."""
    with socket.create_connection((ip, port), timeout=IO_TIMEOUT_S) as s:
        s.settimeout(IO_TIMEOUT_S)
        send_frame(s, kind, payload)
        if want_reply:
            return recv_frame(s)
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


class Listener:
    """The listen thread: serves this agent's metadata and loads what peers send.

    At most `max_conns` connections are served at once, each by a thread of its own, and each
    must deliver its whole request within `timeout_s`. A connection over the cap closes the
    oldest one still sending its request (or, when every one is past that, is closed itself),
    so idle connections cost at most `max_conns` threads for at most `timeout_s` each.
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
    ) -> None:
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
        self._thread = threading.Thread(target=self._run, name="hixl-nixl-listen", daemon=True)
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
            t = threading.Thread(
                target=self._serve, args=(conn, peer), name="hixl-nixl-serve", daemon=True
            )
            with self._lock:
                self._serving = {x for x in self._serving if x.is_alive()}
                self._serving.add(t)
            t.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with conn:
                kind, payload = recv_frame(conn, time.monotonic() + self.timeout_s)
                with self._lock:
                    if conn not in self._conns:
                        return  # evicted while its last bytes arrived
                    self._conns[conn] = False
                conn.settimeout(self.timeout_s)
                if kind == b"F":
                    try:
                        send_frame(conn, b"M", self._metadata())
                    except Exception as e:  # the agent is closing
                        send_frame(conn, b"E", str(e).encode())
                elif kind == b"S":
                    self._load(payload, peer)
                elif kind == b"I":
                    conn.close()  # the sender need not wait for the check below
                    self._forget(payload.decode(), peer)
                else:
                    log.warning("hixl.nixl listener: unknown request %r from %s", kind, peer)
        except (OSError, ConnectionError) as e:  # cut, slow or gone: the peer's doing
            with self._lock:
                cut = conn not in self._conns
            if not cut:
                log.info("hixl.nixl listener: connection from %s closed: %s", peer, e)
        except Exception as e:
            log.warning("hixl.nixl listener: request from %s failed: %s", peer, e)
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
