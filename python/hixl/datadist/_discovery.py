"""Discovery through etcd: ``hixl.init(discovery="etcd://host:2379/prefix")``.

Each rank publishes one key, ``<prefix>/ranks/<rank>``, whose value is a JSON object (rank,
role, engine address, device id, cache names, host name, pid), attached to a lease of
``hixl.discovery.ttl_s`` seconds that a background thread keeps alive (every ttl/3). A
second thread watches ``<prefix>/ranks/`` and keeps the view of the cluster current: a rank
that starts appears at once, one that ends (hixl.finalize revokes its lease) or dies (its
lease expires) disappears, and a link to it is dropped. Nothing links at start: a transfer
to a rank in the view links to it on first use.

If etcd goes away later, both threads keep retrying and nothing else changes: links stay
up, the view stays as it was. When etcd answers again, the lease is renewed (or, if it
expired meanwhile, this rank publishes itself again) and the view is read afresh.

Options (``hixl.init(options=...)``, next to the engine's; or the environment variable in
brackets): ``hixl.discovery.ttl_s`` (HIXL_DISCOVERY_TTL_S, default 10),
``hixl.discovery.advertise`` (HIXL_DISCOVERY_ADVERTISE: the "ip:port" to publish when the
engine listens on a wildcard address), ``hixl.discovery.ca``, ``hixl.discovery.cert``,
``hixl.discovery.key`` (TLS, with ``etcds://``), ``hixl.discovery.user`` and
``hixl.discovery.password`` (etcd auth), ``hixl.discovery.timeout_s`` (each call to etcd,
default 3).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from .._errors import NotConnected, ParamInvalid
from ._etcd import EtcdClient, EtcdError, Tls

log = logging.getLogger("hixl.discovery")

OPTION_PREFIX = "hixl.discovery."
OPTIONS = {
    "ttl_s": "10",
    "advertise": "",
    "ca": "",
    "cert": "",
    "key": "",
    "user": "",
    "password": "",
    "timeout_s": "3",
}


@dataclass
class Member:
    """A rank as published in etcd."""

    rank: int
    role: str
    address: str
    device_id: int = 0
    caches: tuple[str, ...] = ()
    host: str = ""
    pid: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "role": self.role,
                "address": self.address,
                "device_id": self.device_id,
                "caches": list(self.caches),
                "host": self.host,
                "pid": self.pid,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Member:
        d = json.loads(raw)
        return cls(
            int(d["rank"]),
            str(d["role"]),
            str(d["address"]),
            int(d.get("device_id", 0)),
            tuple(str(c) for c in d.get("caches", [])),
            str(d.get("host", "")),
            int(d.get("pid", 0)),
        )


@dataclass
class Config:
    url: str
    endpoints: list[tuple[str, int]]
    prefix: str
    ttl_s: int
    advertise: str | None
    tls: Tls | None
    user: str | None
    password: str | None
    timeout_s: float


def split_options(options: Mapping[str, str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """(the engine's options, the discovery options without their prefix)."""
    engine, disc = {}, {}
    for k, v in (options or {}).items():
        if k.startswith(OPTION_PREFIX):
            name = k[len(OPTION_PREFIX) :]
            if name not in OPTIONS:
                raise ParamInvalid(
                    f"unknown option {k!r}: the discovery options are "
                    + ", ".join(OPTION_PREFIX + n for n in OPTIONS)
                )
            disc[name] = str(v)
        else:
            engine[k] = v
    return engine, disc


def parse(url: str, given: Mapping[str, str], env: Mapping[str, str]) -> Config:
    """The discovery configuration from the URL ("etcd://h1:2379,h2:2379/prefix", or etcds://
    for TLS), the options given and the environment (HIXL_DISCOVERY_<NAME>)."""

    def opt(name: str) -> str:
        if name in given:
            return given[name]
        return env.get("HIXL_DISCOVERY_" + name.upper(), OPTIONS[name])

    u = urlsplit(url)
    if u.scheme not in ("etcd", "etcds"):
        raise ParamInvalid(
            f"discovery={url!r}: only etcd://host:port[,host:port...]/prefix (or etcds:// for "
            "TLS) is supported"
        )
    endpoints = []
    for part in filter(None, u.netloc.rpartition("@")[2].split(",")):
        host, sep, port = part.rpartition(":")
        if not sep:
            host, port = part, "2379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ParamInvalid(f"discovery={url!r}: {part!r} is not host:port")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ParamInvalid(f"discovery={url!r} names no etcd endpoint (etcd://host:2379/prefix)")
    prefix = "/" + u.path.strip("/") if u.path.strip("/") else "/hixl"
    user, password = opt("user") or None, opt("password") or None
    if "@" in u.netloc:
        creds = u.netloc.rpartition("@")[0]
        name, _, pw = creds.partition(":")
        user, password = unquote(name) or user, unquote(pw) or password
    try:
        ttl = int(opt("ttl_s"))
        timeout_s = float(opt("timeout_s"))
    except ValueError:
        raise ParamInvalid(
            f"hixl.discovery.ttl_s={opt('ttl_s')!r} / hixl.discovery.timeout_s="
            f"{opt('timeout_s')!r} must be numbers"
        ) from None
    if ttl < 1 or timeout_s <= 0:
        raise ParamInvalid(f"hixl.discovery.ttl_s={ttl} must be >= 1 and timeout_s > 0")
    tls = None
    if u.scheme == "etcds" or opt("ca") or opt("cert"):
        tls = Tls(opt("ca") or None, opt("cert") or None, opt("key") or None)
    return Config(
        url, endpoints, prefix, ttl, opt("advertise") or None, tls, user, password, timeout_s
    )


def advertised(listen: str, cfg: Config) -> str:
    """The address peers should dial: the engine's, or when it listens on a wildcard address
    the one given by hixl.discovery.advertise, else the local address that routes to etcd."""
    if cfg.advertise:
        return cfg.advertise
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host not in ("0.0.0.0", "::", ""):
        if _loopback(host) and not all(_loopback(h) for h, _ in cfg.endpoints):
            log.warning(
                "discovery: publishing %s, a loopback address, in an etcd other hosts use: "
                "only this host can reach it (set HIXL_LISTEN or hixl.discovery.advertise)",
                listen,
            )
        return listen
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(cfg.endpoints[0])  # no packet is sent: this only picks the route
        return f"{s.getsockname()[0]}:{port}"


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


class Discovery:
    """This rank's registration and its view of the cluster."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        try:
            self.client = EtcdClient(
                cfg.endpoints, cfg.tls, cfg.user, cfg.password, timeout_s=cfg.timeout_s
            )
        except OSError as exc:  # a CA, certificate or key file that cannot be used
            raise ParamInvalid(f"discovery TLS files: {exc}") from None
        self.dir = (cfg.prefix + "/ranks/").encode()
        self.members: dict[int, Member] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.lease = 0
        self.me: Member | None = None
        self.on_join: Callable[[Member], None] = lambda m: None
        self.on_leave: Callable[[Member], None] = lambda m: None
        self.watch: Any = None
        self.etcd_ok = True
        self.wake = threading.Event()  # update() or close(): the lease thread has work
        self.dirty = False  # this rank's entry changed since it was last published

    def check(self) -> None:
        """Raises NotConnected, with what to do, when etcd does not answer."""
        try:
            self.client.status()
        except EtcdError as exc:
            if exc.unreachable:
                raise NotConnected(
                    f"discovery: etcd at {self.client.describe()} does not answer ({exc}). "
                    f"Start etcd there, or fix discovery= / HIXL_DISCOVERY ({self.cfg.url!r})"
                ) from None
            raise NotConnected(
                f"discovery: {exc} (with auth on, give hixl.discovery.user and .password, "
                "or HIXL_DISCOVERY_USER and HIXL_DISCOVERY_PASSWORD)"
            ) from None

    def key(self, rank: int) -> bytes:
        return self.dir + str(rank).encode()

    def start(self, me: Member, deadline: float) -> None:
        """Publishes this rank (waiting until `deadline` for an earlier process of the same
        rank whose lease has not expired yet), reads the view and starts both threads."""
        self.me = me
        try:
            self.lease, granted = self.client.grant(self.cfg.ttl_s)
            if granted != self.cfg.ttl_s:
                log.info("etcd granted a lease of %d s (asked %d s)", granted, self.cfg.ttl_s)
            while True:
                ok, other = self.client.create(self.key(me.rank), me.to_json(), self.lease)
                if ok:
                    break
                if time.monotonic() >= deadline:
                    raise ParamInvalid(
                        f"cluster_id={me.rank} is already published in etcd under "
                        f"{self.cfg.prefix!r} by {(other or b'').decode(errors='replace')}: "
                        "another process has this rank (a dead one's entry expires after its TTL)"
                    )
                time.sleep(0.2)
            view, rev = self.client.range_prefix(self.dir)
        except BaseException as exc:
            if self.lease:  # do not leave the entry behind for a TTL
                try:
                    self.client.revoke(self.lease, timeout_s=min(1.0, self.cfg.timeout_s))
                except EtcdError:
                    pass
            if isinstance(exc, EtcdError):
                raise NotConnected(f"discovery: etcd at {self.client.describe()}: {exc}") from None
            raise
        self._replace(view)
        for name, fn in (
            ("hixl-discovery-lease", self._keepalive_loop),
            ("hixl-discovery-watch", lambda: self._watch_loop(rev + 1)),
        ):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def update(self, caches: list[str]) -> None:
        """Publishes this rank's cache names again, from the lease thread (so that
        allocate_cache never waits for etcd; while etcd is away, once it is back)."""
        if self.me is None:
            return
        with self.lock:
            self.me.caches = tuple(caches)
            self.dirty = True
        self.wake.set()

    def _republish(self) -> None:
        log.warning("discovery: the entry of rank %d is gone from etcd; publishing again",
                    self.me.rank if self.me else -1)  # fmt: skip
        with self.lock:
            self.dirty = True
        self.wake.set()

    def close(self) -> None:
        """Stops both threads and removes this rank from etcd (revokes its lease)."""
        self.stop.set()
        self.wake.set()
        w = self.watch
        if w is not None:
            w.close()
        if self.lease:
            try:
                self.client.revoke(self.lease, timeout_s=min(1.0, self.cfg.timeout_s))
            except EtcdError as exc:
                log.info("discovery: could not revoke lease (it expires by itself): %s", exc)
        for t in self.threads:
            t.join(timeout=self.cfg.timeout_s + 1)

    def lookup(self, rank: int) -> Member | None:
        """The rank from the view, else read from etcd now (it may have just started)."""
        with self.lock:
            m = self.members.get(rank)
        if m is not None:
            return m
        try:
            raw = self.client.get(self.key(rank))
        except EtcdError:
            return None
        if raw is None:
            return None
        try:
            m = Member.from_json(raw)
        except (ValueError, KeyError, TypeError):
            return None
        # not put into the view: the watch does that, in order (this read may be older
        # than a DELETE the watch has applied meanwhile)
        return m if m.rank == rank else None

    def view(self) -> list[Member]:
        with self.lock:
            return sorted(self.members.values(), key=lambda m: m.rank)

    # -- the view ------------------------------------------------------------------------

    def _rank_of(self, key: bytes) -> int | None:
        tail = key[len(self.dir) :]
        return int(tail) if key.startswith(self.dir) and tail.isdigit() else None

    def _apply(self, kind: str, key: bytes, value: bytes) -> None:
        rank = self._rank_of(key)
        if rank is None:
            return
        if self.me is not None and rank == self.me.rank:
            if kind == "DELETE" and not self.stop.is_set():
                self._republish()  # someone removed this rank's entry: put it back
            return
        if kind == "DELETE":
            with self.lock:
                old = self.members.pop(rank, None)
            if old is not None:
                log.info("discovery: rank %d (%s) left", rank, old.address)
                self.on_leave(old)
            return
        try:
            m = Member.from_json(value)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("discovery: ignoring malformed entry %r: %s", key, exc)
            return
        if m.rank != rank:
            log.warning("discovery: ignoring entry %r that claims rank %d", key, m.rank)
            return
        with self.lock:
            old = self.members.get(rank)
            self.members[rank] = m
        if old is None or old.address != m.address:
            if old is not None:
                self.on_leave(old)
            log.info("discovery: rank %d (%s, %s) joined", rank, m.role, m.address)
            self.on_join(m)

    def _replace(self, view: dict[bytes, bytes]) -> None:
        """Makes the view what etcd holds now (after a start or a broken watch)."""
        present = {self._rank_of(k) for k in view}
        if self.me is not None and self.me.rank not in present and self.threads:
            self._republish()  # gone while etcd was away (or etcd lost its data)
        with self.lock:
            gone = [r for r in self.members if r not in present]
        for r in gone:
            self._apply("DELETE", self.key(r), b"")
        for k, v in view.items():
            self._apply("PUT", k, v)

    def _watch_loop(self, rev: int) -> None:
        idle = max(2.0, float(self.cfg.ttl_s))
        while not self.stop.is_set():
            try:
                if rev == 0:  # (re)read everything first
                    view, at = self.client.range_prefix(self.dir)
                    self._replace(view)
                    rev = at + 1
                self.watch = self.client.watch(self.dir, rev, idle)
                if self.stop.is_set():
                    self.watch.close()
                    return
                for events, _ in self.watch.batches():
                    for kind, key, value, mod in events:
                        self._apply(kind, key, value)
                        rev = max(rev, mod + 1)
            except TimeoutError:
                pass  # quiet: open the watch again from where it was
            except (EtcdError, OSError, ValueError) as exc:
                if self.stop.is_set():
                    return
                self._etcd_lost(exc)
                # read the whole view again: the watch was cancelled (compacted), or etcd
                # was away and may be a new store whose revisions start over
                rev = 0
                self.stop.wait(0.5)
            finally:
                w, self.watch = self.watch, None
                if w is not None:
                    w.close()

    def _keepalive_loop(self) -> None:
        """Refreshes the lease every ttl/3 (every 0.5 s while etcd is away) and publishes
        this rank's entry again when update() changed it or the lease was lost."""
        every = max(0.5, self.cfg.ttl_s / 3)
        due = time.monotonic() + every
        while True:
            self.wake.wait(max(0.0, due - time.monotonic()))
            self.wake.clear()
            if self.stop.is_set():
                return
            assert self.me is not None
            try:
                with self.lock:
                    dirty, self.dirty = self.dirty, False
                    entry = self.me.to_json()
                if dirty:
                    try:
                        self.client.put(self.key(self.me.rank), entry, self.lease)
                    except EtcdError:
                        with self.lock:
                            self.dirty = True  # again, once etcd answers
                        due = 0.0  # and see now whether etcd or the lease is gone
                if time.monotonic() < due:
                    continue
                if self.client.keepalive(self.lease) <= 0:
                    # the lease expired while etcd was away (or etcd lost its data)
                    log.warning(
                        "discovery: the lease of rank %d is gone; publishing again", self.me.rank
                    )
                    self.lease, _ = self.client.grant(self.cfg.ttl_s)
                    self.client.put(self.key(self.me.rank), entry, self.lease)
                self._etcd_back()
                due = time.monotonic() + every
            except EtcdError as exc:
                if self.stop.is_set():
                    return
                self._etcd_lost(exc)
                due = time.monotonic() + 0.5

    def _etcd_lost(self, exc: BaseException) -> None:
        if self.etcd_ok:
            self.etcd_ok = False
            log.warning(
                "discovery: etcd at %s is away (%s); existing links keep working, "
                "retrying every 0.5 s",
                self.client.describe(),
                exc,
            )

    def _etcd_back(self) -> None:
        if not self.etcd_ok:
            self.etcd_ok = True
            log.warning("discovery: etcd at %s answers again", self.client.describe())


def from_init(
    url: str | None, options: Mapping[str, str] | None, env: Mapping[str, str] | None = None
) -> tuple[Config | None, dict[str, str]]:
    """hixl.init's discovery= (or HIXL_DISCOVERY) and options: (the configuration or None,
    the options left for the engine)."""
    env = os.environ if env is None else env
    engine_opts, disc_opts = split_options(options)
    url = url or env.get("HIXL_DISCOVERY") or None
    if url is None:
        if disc_opts:
            raise ParamInvalid(
                f"options {sorted(OPTION_PREFIX + k for k in disc_opts)} need discovery= "
                "(or HIXL_DISCOVERY)"
            )
        return None, engine_opts
    return parse(url, disc_opts, env), engine_opts
