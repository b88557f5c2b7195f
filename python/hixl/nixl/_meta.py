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


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("side channel: peer closed the connection early")
        buf += chunk
    return bytes(buf)


def send_frame(s: socket.socket, kind: bytes, payload: bytes) -> None:
    s.sendall(FRAME.pack(FRAME_MAGIC, kind, len(payload)) + payload)


def recv_frame(s: socket.socket) -> tuple[bytes, bytes]:
    magic, kind, n = FRAME.unpack(_recv_exact(s, FRAME.size))
    if magic != FRAME_MAGIC:
        raise ConnectionError(f"side channel: not a hixl.nixl listener (got {magic!r})")
    if n > MAX_FRAME:
        raise ConnectionError(f"side channel: frame of {n} bytes is over the limit")
    return kind, _recv_exact(s, n)


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


class Listener:
    """The listen thread: serves this agent's metadata and loads what peers send."""

    def __init__(
        self,
        port: int,
        metadata: Callable[[], bytes],
        load: Callable[[bytes], object],
        forget: Callable[[str], object],
    ) -> None:
        self._metadata, self._load, self._forget = metadata, load, forget
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("0.0.0.0", port))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._serving: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hixl-nixl-listen", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._serving = {x for x in self._serving if x.is_alive()}
                self._serving.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(IO_TIMEOUT_S)
                kind, payload = recv_frame(conn)
                if kind == b"F":
                    try:
                        send_frame(conn, b"M", self._metadata())
                    except Exception as e:  # the agent is closing
                        send_frame(conn, b"E", str(e).encode())
                elif kind == b"S":
                    self._load(payload)
                elif kind == b"I":
                    self._forget(payload.decode())
                else:
                    log.warning("hixl.nixl listener: unknown request %r ignored", kind)
            except Exception as e:
                log.warning("hixl.nixl listener: request failed: %s", e)

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
        for t in serving:
            t.join(timeout=IO_TIMEOUT_S + 5.0)
