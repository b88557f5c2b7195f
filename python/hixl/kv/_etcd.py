"""A small etcd v3 client over etcd's own JSON gateway (``/v3/...``), standard library only.

Why not a client package: the maintained Python etcd v3 clients are gRPC based (``etcd3``
pins an old protobuf and is unmaintained; the others pull in grpcio, a large native wheel,
for a few calls made every few seconds). Every etcd since 3.4 (Debian bookworm's included)
serves the same API as JSON over HTTP on its client port, so hixl speaks that with
``http.client``: keys and values are base64, ``lease/grant`` and ``lease/keepalive`` keep a
lease alive, ``kv/txn`` publishes a key only when it is free, ``kv/range`` with a range end
reads a prefix, and ``watch`` is one streaming POST whose response is one JSON object per
line. TLS (``etcds://``, a CA, a client certificate) and etcd's user/password auth are
options. Several endpoints (an etcd cluster) are tried in order; the one that answered is
tried first next time.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class EtcdError(Exception):
    """etcd could not be reached, or answered with an error (the message says which)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with `prefix` (etcd's convention)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\0"


@dataclass
class Tls:
    """TLS towards etcd: the CA file that signs etcd's certificate (the system's when
    None), and a client certificate and key when etcd asks for one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


class EtcdClient:
    """Calls to one etcd cluster. Thread safe: each call opens its own connection."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        tls: Tls | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout_s: float = 3.0,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self.tls = tls
        self.ssl = tls.context() if tls is not None else None
        self.user, self.password = user, password
        self.timeout_s = timeout_s
        self.token: str | None = None
        self.lock = threading.Lock()

    def describe(self) -> str:
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.endpoints)

    def _conn(self, host: str, port: int, timeout: float | None) -> http.client.HTTPConnection:
        if self.ssl is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self.ssl)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.token:
            h["Authorization"] = self.token
        return h

    def _open(
        self, path: str, body: dict[str, Any], timeout: float | None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POSTs to the first endpoint that answers; returns the open connection and its
        response (status 200). Raises EtcdError (unreachable=True when none answered)."""
        data = json.dumps(body).encode()
        errors = []
        with self.lock:
            order = list(self.endpoints)
        for host, port in order:
            conn = self._conn(host, port, timeout)
            try:
                conn.request("POST", "/v3/" + path, data, self._headers())
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                continue
            if resp.status != 200:
                text = resp.read(4096).decode(errors="replace").strip()
                conn.close()
                try:
                    msg = json.loads(text).get("error") or json.loads(text).get("message") or text
                except ValueError:
                    msg = text
                raise EtcdError(f"etcd at {host}:{port} refused /v3/{path}: {msg}")
            with self.lock:  # the one that answered goes first from now on
                if self.endpoints[0] != (host, port):
                    self.endpoints.remove((host, port))
                    self.endpoints.insert(0, (host, port))
            return conn, resp
        raise EtcdError(
            f"cannot reach etcd at {self.describe()} ({'; '.join(errors)})", unreachable=True
        )

    def call(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """One request/response call; re-authenticates once when the token expired."""
        for attempt in (0, 1):
            if self.user and (self.token is None or attempt == 1) and path != "auth/authenticate":
                self.authenticate()
            try:
                conn, resp = self._open(path, body, timeout or self.timeout_s)
            except EtcdError as exc:
                if attempt == 0 and self.user and "token" in str(exc).lower():
                    continue
                raise
            try:
                text = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                raise EtcdError(f"etcd /v3/{path}: {exc}", unreachable=True) from exc
            finally:
                conn.close()
            doc = json.loads(text)
            # a streaming method (lease/keepalive) wraps its one answer in "result"
            return doc.get("result", doc) if isinstance(doc, dict) else doc
        raise AssertionError("unreachable")

    def authenticate(self) -> None:
        out = self.call("auth/authenticate", {"name": self.user, "password": self.password or ""})
        self.token = str(out["token"])

    # -- the calls discovery makes -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return dict(self.call("maintenance/status", {}))

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted, at least its minimum)."""
        out = self.call("lease/grant", {"TTL": ttl_s})
        if out.get("error"):
            raise EtcdError(f"etcd lease/grant: {out['error']}")
        return int(out["ID"]), int(out["TTL"])

    def keepalive(self, lease: int) -> int:
        """Refreshes the lease; its TTL, 0 when the lease no longer exists."""
        out = self.call("lease/keepalive", {"ID": str(lease)})
        return int(out.get("TTL", 0))

    def revoke(self, lease: int, timeout_s: float | None = None) -> None:
        self.call("lease/revoke", {"ID": str(lease)}, timeout_s)

    def create(self, key: bytes, value: bytes, lease: int) -> tuple[bool, bytes | None]:
        """Puts the key only if it does not exist: (True, None), or (False, its value)."""
        out = self.call(
            "kv/txn",
            {
                "compare": [{"key": b64(key), "target": "CREATE", "create_revision": "0"}],
                "success": [
                    {"request_put": {"key": b64(key), "value": b64(value), "lease": str(lease)}}
                ],
                "failure": [{"request_range": {"key": b64(key)}}],
            },
        )
        if out.get("succeeded"):
            return True, None
        kvs = out.get("responses", [{}])[0].get("response_range", {}).get("kvs", [])
        return False, (unb64(kvs[0].get("value", "")) if kvs else b"")

    def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.call("kv/put", {"key": b64(key), "value": b64(value), "lease": str(lease)})

    def get(self, key: bytes) -> bytes | None:
        got = self.get_leased(key)
        return got[0] if got is not None else None

    def get_leased(self, key: bytes) -> tuple[bytes, int] | None:
        """The key's value and the lease it is attached to (0: none), or None if absent."""
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs", [])
        return (unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None

    def range_prefix(self, prefix: bytes) -> tuple[dict[bytes, bytes], int]:
        """Every key under `prefix` with its value, and the store's revision."""
        kvs, rev = self.range_leased(prefix)
        return {k: v for k, (v, _) in kvs.items()}, rev

    def range_leased(self, prefix: bytes) -> tuple[dict[bytes, tuple[bytes, int]], int]:
        """Every key under `prefix` with its value and lease (0: none), and the revision."""
        out = self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        kvs = {
            unb64(kv["key"]): (unb64(kv.get("value", "")), int(kv.get("lease", 0)))
            for kv in out.get("kvs", [])
        }
        return kvs, int(out["header"]["revision"])

    def lease_ttl(self, lease: int) -> int:
        """The seconds the lease has left; -1 when it does not exist (expired or revoked)."""
        return int(self.call("lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    def watch(self, prefix: bytes, start_revision: int, idle_s: float) -> Watch:
        """A watch of every key under `prefix` from `start_revision` on."""
        if self.user and self.token is None:
            self.authenticate()
        req = {
            "create_request": {
                "key": b64(prefix),
                "range_end": b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        conn, resp = self._open("watch", req, idle_s)
        return Watch(conn, resp)


class Watch:
    """An open watch stream; iterate for lists of events (type, key, value, mod revision,
    lease: 0 when the key is attached to none)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.conn, self.resp = conn, resp

    def close(self) -> None:
        """Ends the stream, also from another thread blocked reading it."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conn.close()

    def batches(self) -> Iterator[tuple[list[tuple[str, bytes, bytes, int, int]], int]]:
        """Yields (events, header revision) per message; raises EtcdError when the stream
        ends or etcd cancels it (a compacted start revision: the caller reads again), and
        socket.timeout when nothing came for the idle time given to watch()."""
        while True:
            try:
                line = self.resp.readline()
            except TimeoutError:
                raise
            except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
                # (AttributeError: http.client, when close() ran on another thread meanwhile)
                raise EtcdError(f"etcd watch stream broke: {exc}", unreachable=True) from exc
            if not line:
                raise EtcdError("etcd closed the watch stream", unreachable=True)
            doc = json.loads(line)
            if "error" in doc:
                raise EtcdError(f"etcd watch: {doc['error']}")
            res = doc.get("result", {})
            if res.get("canceled") or res.get("compact_revision"):
                raise EtcdError(
                    f"etcd cancelled the watch ({res.get('cancel_reason') or 'compacted'})"
                )
            events = []
            for ev in res.get("events", []):
                kv = ev.get("kv", {})
                events.append(
                    (
                        ev.get("type", "PUT"),
                        unb64(kv.get("key", "")),
                        unb64(kv.get("value", "")),
                        int(kv.get("mod_revision", 0)),
                        int(kv.get("lease", 0)),
                    )
                )
            yield events, int(res.get("header", {}).get("revision", 0))
