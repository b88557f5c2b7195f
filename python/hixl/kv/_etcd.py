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

etcd's answers are parsed strictly (``hixl._peertext``): an answer that is not what etcd
sends (not JSON, a number that is not one, a field of the wrong type) is an EtcdError naming
the call, never another exception, so that the threads calling etcd keep going whatever it
answers.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import _peertext as pt

log = logging.getLogger("hixl.discovery")

#: the largest answer read from etcd (a range of a large prefix included)
MAX_ANSWER_BYTES = 64 << 20
MAX_ID = (1 << 63) - 1


class EtcdError(Exception):
    """etcd could not be reached, or answered with an error (the message says which)."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: Any) -> bytes:
    """The bytes of etcd's base64 field `s`; Malformed when it is not base64 text."""
    if not isinstance(s, str):
        raise pt.Malformed(f"{pt.shown(s)} is not base64 text")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise pt.Malformed(f"{pt.shown(s)} is not base64") from None


@contextmanager
def answer(what: str) -> Iterator[None]:
    """Turns a malformed answer of etcd to `what` into an EtcdError naming it."""
    try:
        yield
    except (pt.Malformed, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise EtcdError(f"etcd {what}: malformed answer ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class KV:
    """A key's value as etcd reports it: the lease it is attached to (0: none) and the
    revision at which the key was created."""

    value: bytes
    lease: int
    created: int


def parse_kv(kv: Any) -> tuple[bytes, KV]:
    """(key, KV) of one of etcd's key-value objects; Malformed when it is not one."""
    kv = pt.obj(kv, "kv")
    return unb64(kv.get("key", "")), KV(
        unb64(kv.get("value", "")),
        pt.decimal(kv.get("lease", 0), "lease", 0, MAX_ID),
        pt.decimal(kv.get("create_revision", 0), "create_revision", 0, MAX_ID),
    )


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
                    doc = pt.obj(pt.loads(text, "etcd's error"), "etcd's error")
                    msg = pt.shown(doc.get("error") or doc.get("message") or text)
                except pt.Malformed:
                    msg = pt.shown(text)
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
                text = resp.read(MAX_ANSWER_BYTES + 1)
            except (OSError, http.client.HTTPException) as exc:
                raise EtcdError(f"etcd /v3/{path}: {exc}", unreachable=True) from exc
            finally:
                conn.close()
            with answer(f"/v3/{path}"):
                doc = pt.obj(pt.loads(text, "answer", MAX_ANSWER_BYTES), "answer")
                # a streaming method (lease/keepalive) wraps its one answer in "result"
                return pt.obj(doc.get("result", doc), "result")
        raise AssertionError("unreachable")

    def authenticate(self) -> None:
        out = self.call("auth/authenticate", {"name": self.user, "password": self.password or ""})
        with answer("auth/authenticate"):
            self.token = pt.text(out["token"], "token")

    # -- the calls discovery makes -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return dict(self.call("maintenance/status", {}))

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted, at least its minimum)."""
        out = self.call("lease/grant", {"TTL": ttl_s})
        if out.get("error"):
            raise EtcdError(f"etcd lease/grant: {pt.shown(out['error'])}")
        with answer("lease/grant"):
            return pt.decimal(out["ID"], "ID", 1, MAX_ID), pt.decimal(out["TTL"], "TTL", 1, MAX_ID)

    def keepalive(self, lease: int) -> int:
        """Refreshes the lease; its TTL, 0 when the lease no longer exists."""
        out = self.call("lease/keepalive", {"ID": str(lease)})
        with answer("lease/keepalive"):
            return pt.decimal(out.get("TTL", 0), "TTL", -1, MAX_ID)

    def revoke(self, lease: int, timeout_s: float | None = None) -> None:
        self.call("lease/revoke", {"ID": str(lease)}, timeout_s)

    def create(self, key: bytes, value: bytes, lease: int) -> tuple[int, KV | None]:
        """Puts the key only if it does not exist: (the revision that created it, None), or
        (0, what the key holds)."""
        return self._txn(key, "CREATE", {"create_revision": "0"}, value, lease)

    def put_if_created(self, key: bytes, value: bytes, lease: int, created: int) -> bool:
        """Puts the key only while it is the key created at revision `created`; whether it
        did (not when the key was deleted or created again meanwhile)."""
        done, _ = self._txn(key, "CREATE", {"create_revision": str(created)}, value, lease)
        return done != 0

    def _txn(
        self, key: bytes, target: str, compare: dict[str, str], value: bytes, lease: int
    ) -> tuple[int, KV | None]:
        out = self.call(
            "kv/txn",
            {
                "compare": [{"key": b64(key), "target": target, **compare}],
                "success": [
                    {"request_put": {"key": b64(key), "value": b64(value), "lease": str(lease)}}
                ],
                "failure": [{"request_range": {"key": b64(key)}}],
            },
        )
        with answer("kv/txn"):
            if out.get("succeeded"):
                rev = pt.obj(out["header"], "header")["revision"]
                return pt.decimal(rev, "revision", 1, MAX_ID), None
            resp = pt.array(out.get("responses", []), "responses", 1)
            rng = pt.obj(pt.obj(resp[0], "response").get("response_range", {}), "range")
            kvs = pt.array(rng.get("kvs", []), "kvs", 1)
            return 0, (parse_kv(kvs[0])[1] if kvs else None)

    def put(self, key: bytes, value: bytes, lease: int) -> None:
        self.call("kv/put", {"key": b64(key), "value": b64(value), "lease": str(lease)})

    def get(self, key: bytes) -> bytes | None:
        got = self.get_leased(key)
        return got.value if got is not None else None

    def get_leased(self, key: bytes) -> KV | None:
        """The key's value, lease and create revision, or None if absent."""
        out = self.call("kv/range", {"key": b64(key)})
        with answer("kv/range"):
            kvs = pt.array(out.get("kvs", []), "kvs", 1)
            return parse_kv(kvs[0])[1] if kvs else None

    def range_prefix(self, prefix: bytes) -> tuple[dict[bytes, bytes], int]:
        """Every key under `prefix` with its value, and the store's revision."""
        kvs, rev = self.range_leased(prefix)
        return {k: v.value for k, v in kvs.items()}, rev

    def range_leased(self, prefix: bytes) -> tuple[dict[bytes, KV], int]:
        """Every key under `prefix` with its value, lease and create revision, and the
        store's revision."""
        out = self.call("kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        with answer("kv/range"):
            kvs = dict(parse_kv(kv) for kv in pt.array(out.get("kvs", []), "kvs", 1 << 20))
            rev = pt.decimal(pt.obj(out["header"], "header")["revision"], "revision", 0, MAX_ID)
            return kvs, rev

    def lease_ttl(self, lease: int) -> int:
        """The seconds the lease has left; -1 when it does not exist (expired or revoked)."""
        out = self.call("lease/timetolive", {"ID": str(lease)})
        with answer("lease/timetolive"):
            return pt.decimal(out.get("TTL", -1), "TTL", -1, MAX_ID)

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


Event = tuple[str, bytes, KV, int]


def parse_watch(line: bytes) -> tuple[list[Event], int]:
    """(events, header revision) of one message of a watch stream; each event (type, key, KV,
    mod revision). EtcdError when etcd reports an error or cancels the watch, or when the
    message is malformed; a malformed event in a well-formed message is logged and dropped."""
    with answer("watch"):
        doc = pt.obj(pt.loads(line, "watch message", MAX_ANSWER_BYTES), "watch message")
        if "error" in doc:
            raise EtcdError(f"etcd watch: {pt.shown(doc['error'])}")
        res = pt.obj(doc.get("result", {}), "result")
        if res.get("canceled") or res.get("compact_revision"):
            why = pt.shown(res.get("cancel_reason") or "compacted")
            raise EtcdError(f"etcd cancelled the watch ({why})")
        header = pt.obj(res.get("header", {}), "header")
        rev = pt.decimal(header.get("revision", 0), "revision", 0, MAX_ID)
        raw = pt.array(res.get("events", []), "events", 1 << 20)
    events = []
    for ev in raw:
        try:
            ev = pt.obj(ev, "event")
            kind = ev.get("type", "PUT")
            if kind not in ("PUT", "DELETE"):
                raise pt.Malformed(f"event type {pt.shown(kind)}")
            kv = pt.obj(ev.get("kv", {}), "kv")
            key, value = parse_kv(kv)
            mod = pt.decimal(kv.get("mod_revision", 0), "mod_revision", 0, MAX_ID)
        except (pt.Malformed, KeyError, TypeError, AttributeError) as exc:
            log.warning("discovery: dropping a malformed watch event %s: %s", pt.shown(ev), exc)
            continue
        events.append((kind, key, value, mod))
    return events, rev


class Watch:
    """An open watch stream; iterate for lists of events (type, key, KV, mod revision)."""

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

    def batches(self) -> Iterator[tuple[list[Event], int]]:
        """Yields (events, header revision) per message; raises EtcdError when the stream
        ends or etcd cancels it (a compacted start revision: the caller reads again), and
        socket.timeout when nothing came for the idle time given to watch()."""
        while True:
            try:
                line = self.resp.readline(MAX_ANSWER_BYTES + 1)
            except TimeoutError:
                raise
            except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
                # (AttributeError: http.client, when close() ran on another thread meanwhile)
                raise EtcdError(f"etcd watch stream broke: {exc}", unreachable=True) from exc
            if not line:
                raise EtcdError("etcd closed the watch stream", unreachable=True)
            yield parse_watch(line)
