"""Discovery through etcd: ``hixl.kv.init(discovery="etcd://host:2379/prefix")``.

Each rank publishes one key, ``<prefix>/ranks/<rank>``, whose value is a JSON object (rank,
role, engine address, device id, cache names, host name, pid), attached to a lease of
``hixl.discovery.ttl_s`` seconds that a background thread keeps alive (every ttl/3). A
second thread watches ``<prefix>/ranks/`` and keeps the view of the cluster current: a rank
that starts appears at once, one that ends (hixl.kv.finalize revokes its lease) or dies (its
lease expires) disappears, and a link to it is dropped. Nothing links at start: a transfer
to a rank in the view links to it on first use.

If etcd goes away later, both threads keep retrying and nothing else changes: links stay
up, the view stays as it was. When etcd answers again, the lease is renewed (or, if it
expired meanwhile, this rank publishes itself again) and the view is read afresh.

etcd is not trusted to hold only what ranks wrote (``_entries``): an entry not attached to a
lease, naming another rank, written for an earlier life of its key (a dead rank's, put back)
or malformed is ignored, and with a cluster secret so is one whose MAC does not verify; each
is logged once, and the rank stays in the view as it was (until its own lease ends). A rank
whose own key holds anything but its own entry writes it back. No watch event can end the
watch: one whose handling fails is logged and dropped.

Options (``hixl.kv.init(options=...)``, next to the engine's; or the environment variable in
brackets): ``hixl.discovery.ttl_s`` (HIXL_DISCOVERY_TTL_S, default 10),
``hixl.discovery.advertise`` (HIXL_DISCOVERY_ADVERTISE: the "ip:port" to publish when the
engine listens on a wildcard address), ``hixl.discovery.ca``, ``hixl.discovery.cert``,
``hixl.discovery.key`` (TLS, with ``etcds://``), ``hixl.discovery.user`` and
``hixl.discovery.password`` (etcd auth), ``hixl.discovery.timeout_s`` (each call to etcd,
default 3).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from .. import _peertext as pt
from .. import _place
from .._errors import NotConnected, ParamInvalid
from .._redact import redact_url
from .._typing import Options, OptionValue
from ._entries import EntryKey, Member, Pending, Refused, cluster_secret, open_entry, seal
from ._etcd import KV, EtcdClient, EtcdError, Tls

__all__ = ["Config", "Discovery", "Member", "advertised", "from_init", "parse"]

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
class Config:
    #: the discovery URL as it may be shown: a password in it is replaced by ***
    url: str
    endpoints: list[tuple[str, int]]
    prefix: str
    ttl_s: int
    advertise: str | None
    tls: Tls | None
    user: str | None
    password: str | None = field(repr=False)
    timeout_s: float
    #: the cluster secret (the engine's): entries are MACed and checked under a key from it
    secret: str | None = field(default=None, repr=False)


def split_options(
    options: Options | None,
) -> tuple[dict[str, OptionValue], dict[str, str]]:
    """(the engine's options, the discovery options without their prefix)."""
    engine: dict[str, OptionValue] = {}
    disc: dict[str, str] = {}
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


def parse(
    url: str, given: Mapping[str, str], env: Mapping[str, str], secret: str | None = None
) -> Config:
    """The discovery configuration from the URL ("etcd://h1:2379,h2:2379/prefix", or etcds://
    for TLS), the options given and the environment (HIXL_DISCOVERY_<NAME>). Errors show the
    URL with its password replaced by ***."""

    def opt(name: str) -> str:
        if name in given:
            return given[name]
        return env.get("HIXL_DISCOVERY_" + name.upper(), OPTIONS[name])

    shown = redact_url(url)
    try:
        u = urlsplit(url)
    except ValueError as exc:
        raise ParamInvalid(f"discovery={shown!r} is not a URL ({exc})") from None
    if u.scheme not in ("etcd", "etcds"):
        raise ParamInvalid(
            f"discovery={shown!r}: only etcd://host:port[,host:port...]/prefix (or etcds:// for "
            "TLS) is supported"
        )
    endpoints = []
    for part in filter(None, u.netloc.rpartition("@")[2].split(",")):
        host, sep, port = part.rpartition(":")
        if not sep:
            host, port = part, "2379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ParamInvalid(f"discovery={shown!r}: {part!r} is not host:port")
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ParamInvalid(f"discovery={shown!r} names no etcd endpoint (etcd://host:2379/prefix)")
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
        shown, endpoints, prefix, ttl, opt("advertise") or None, tls, user, password, timeout_s,
        secret,
    )  # fmt: skip


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
        self.entry_key = EntryKey(cfg.secret) if cfg.secret else None
        #: the values this rank wrote under its key lately (the watch may still show older)
        self.mine: collections.deque[bytes] = collections.deque(maxlen=8)
        #: keys whose refused entry was logged (once, until a good entry shows up there)
        self.refused: set[bytes] = set()
        #: ranks of the view whose key now holds a refused entry: rank -> the lease of the
        #: entry the view keeps, checked every keepalive (the rank leaves when it is gone)
        self.contested: dict[int, int] = {}
        self.leases: dict[int, int] = {}  # rank -> the lease of its entry in the view

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

    def _entry(self, lease: int, created: int) -> bytes:
        """This rank's entry, attached to `lease`, for its key created at revision `created`
        (0: the pending entry that creates the key), MACed with a secret; remembered as its
        own before it is written, so that the watch knows it when it comes back."""
        assert self.me is not None
        with self.lock:
            value = seal(self.entry_key, self.key(self.me.rank), lease, self.me, created)
            self.mine.append(value)
        return value

    def _is_mine(self, kv: KV) -> bool:
        with self.lock:
            return kv.lease == self.lease and kv.value in self.mine

    def _publish(self, lease: int, only_new: bool = False) -> KV | None:
        """Writes this rank's entry attached to `lease`, bound to its key's create revision:
        creates the key first (with the pending entry) when it is absent. None when done;
        with `only_new`, what the key holds when another process created it (nothing is
        written then)."""
        assert self.me is not None
        key = self.key(self.me.rank)
        for _ in range(16):
            got = self.client.get_leased(key)
            if got is None or got.created == 0:
                created, _ = self.client.create(key, self._entry(lease, 0), lease)
                if not created:
                    continue  # someone created it meanwhile: look again
            elif only_new and not self._is_mine(got):
                return got
            else:
                created = got.created
            if self.client.put_if_created(key, self._entry(lease, created), lease, created):
                return None
            # deleted or created again meanwhile: look again
        raise EtcdError(f"the key {key!r} kept changing while this rank published it")

    def start(self, me: Member, deadline: float) -> None:
        """Publishes this rank (waiting until `deadline` for an earlier process of the same
        rank whose lease has not expired yet), reads the view and starts both threads."""
        self.me = me
        try:
            self.lease, granted = self.client.grant(self.cfg.ttl_s)
            if granted != self.cfg.ttl_s:
                log.info("etcd granted a lease of %d s (asked %d s)", granted, self.cfg.ttl_s)
            while True:
                other = self._publish(self.lease, only_new=True)
                if other is None:
                    break
                if time.monotonic() >= deadline:
                    raise ParamInvalid(
                        f"cluster_id={me.rank} is already published in etcd under "
                        f"{self.cfg.prefix!r} by {pt.shown(other.value)}: another process "
                        "has this rank (a dead one's entry expires after its TTL)"
                    )
                time.sleep(0.2)
            view, rev = self.client.range_leased(self.dir)
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
            t = _place.thread(fn, name=name)
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

    def _republish(self, why: str = "is gone from etcd") -> None:
        log.warning("discovery: the entry of rank %d %s; publishing it again",
                    self.me.rank if self.me else -1, why)  # fmt: skip
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
            got = self.client.get_leased(self.key(rank))
        except EtcdError:
            return None
        # not put into the view: the watch does that, in order (this read may be older
        # than a DELETE the watch has applied meanwhile)
        return None if got is None else self._open(self.key(rank), rank, got)

    def _open(self, key: bytes, rank: int, kv: KV) -> Member | None:
        """The member an entry stands for, or None (logged once per key) if refused."""
        try:
            m = open_entry(self.entry_key, key, rank, kv.value, kv.lease, kv.created)
        except Pending:
            return None  # the rank writes its entry next
        except Refused as why:
            with self.lock:
                first = key not in self.refused
                self.refused.add(key)
            if first:
                log.warning(
                    "discovery: ignoring the entry under %r: %s (the entry: %s)",
                    key.decode("ascii", "replace"),
                    why,
                    pt.shown(kv.value),
                )
            return None
        with self.lock:
            self.refused.discard(key)
        return m

    def view(self) -> list[Member]:
        with self.lock:
            return sorted(self.members.values(), key=lambda m: m.rank)

    # -- the view ------------------------------------------------------------------------

    def _rank_of(self, key: bytes) -> int | None:
        tail = key[len(self.dir) :]
        ok = key.startswith(self.dir) and 0 < len(tail) <= 10 and tail.isdigit() and tail.isascii()
        return int(tail) if ok else None

    def _apply(self, kind: str, key: bytes, kv: KV | None = None) -> None:
        rank = self._rank_of(key)
        if rank is None:
            return
        if self.me is not None and rank == self.me.rank:
            if self.stop.is_set():
                return
            if kind == "DELETE":
                self._republish()  # someone removed this rank's entry: put it back
            elif kv is not None and not self._is_mine(kv):
                self._republish(f"under {key.decode('ascii', 'replace')!r} is not its own")
            return
        if kind == "DELETE":
            with self.lock:
                old = self.members.pop(rank, None)
                self.contested.pop(rank, None)
                self.leases.pop(rank, None)
            if old is not None:
                log.info("discovery: rank %d (%s) left", rank, old.address)
                self.on_leave(old)
            return
        assert kv is not None
        m = self._open(key, rank, kv)
        with self.lock:
            if m is None:  # the view keeps what it had, as long as that entry's lease lives
                if rank in self.leases:
                    self.contested[rank] = self.leases[rank]
                return
            self.contested.pop(rank, None)
            self.leases[rank] = kv.lease
            old = self.members.get(rank)
            self.members[rank] = m
        if old is None or old.address != m.address:
            if old is not None:
                self.on_leave(old)
            log.info("discovery: rank %d (%s, %s) joined", rank, m.role, m.address)
            self.on_join(m)

    def _replace(self, view: dict[bytes, KV]) -> None:
        """Makes the view what etcd holds now (after a start or a broken watch)."""
        present = {self._rank_of(k) for k in view}
        if self.me is not None and self.me.rank not in present and self.threads:
            self._republish()  # gone while etcd was away (or etcd lost its data)
        with self.lock:
            gone = [r for r in self.members if r not in present]
        for r in gone:
            self._apply("DELETE", self.key(r))
        for k, kv in view.items():
            self._event("PUT", k, kv)

    def _event(self, kind: str, key: bytes, kv: KV | None) -> None:
        """Applies one event; an exception while doing so is logged and the event dropped
        (one entry, whatever etcd holds, can never end the watch)."""
        try:
            self._apply(kind, key, kv)
        except Exception:  # noqa: BLE001 - logged; the watch goes on
            log.exception(
                "discovery: dropped the %s event of %s (its entry: %s)",
                kind,
                pt.shown(key),
                pt.shown(kv.value if kv else b""),
            )

    def _watch_loop(self, rev: int) -> None:
        idle = max(2.0, float(self.cfg.ttl_s))
        while not self.stop.is_set():
            try:
                if rev == 0:  # (re)read everything first
                    view, at = self.client.range_leased(self.dir)
                    self._replace(view)
                    rev = at + 1
                self.watch = self.client.watch(self.dir, rev, idle)
                if self.stop.is_set():
                    self.watch.close()
                    return
                for events, _ in self.watch.batches():
                    for kind, key, kv, mod in events:
                        self._event(kind, key, kv)
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
        this rank's entry again when update() changed it, the lease was lost or its key holds
        another value; ends the ranks kept over a refused entry whose lease is gone."""
        every = max(0.5, self.cfg.ttl_s / 3)
        due = time.monotonic() + every
        while True:
            self.wake.wait(max(0.0, due - time.monotonic()))
            self.wake.clear()
            if self.stop.is_set():
                return
            assert self.me is not None
            key = self.key(self.me.rank)
            try:
                with self.lock:
                    dirty, self.dirty = self.dirty, False
                if dirty:
                    try:
                        self._publish(self.lease)
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
                    lease, _ = self.client.grant(self.cfg.ttl_s)
                    with self.lock:
                        self.lease = lease
                    self._publish(lease)
                else:  # a PUT the watch missed (it was away) must not stand either
                    got = self.client.get_leased(key)
                    if got is not None and not self._is_mine(got):
                        self._republish(f"under {key.decode('ascii', 'replace')!r} is not its own")
                self._end_contested()
                self._etcd_back()
                due = time.monotonic() + every
            except EtcdError as exc:
                if self.stop.is_set():
                    return
                self._etcd_lost(exc)
                due = time.monotonic() + 0.5

    def _end_contested(self) -> None:
        """Ranks kept in the view over a refused entry leave once their own lease is gone
        (their real entry, attached to it, would have been deleted with it)."""
        with self.lock:
            contested = dict(self.contested)
        for rank, lease in contested.items():
            if self.client.lease_ttl(lease) > 0:
                continue
            with self.lock:
                if self.contested.get(rank) != lease:
                    continue  # a good entry came meanwhile
            log.warning(
                "discovery: rank %d left: its lease ended, and its key holds an entry that "
                "was refused",
                rank,
            )
            self._apply("DELETE", self.key(rank))

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
    url: str | None, options: Options | None, env: Mapping[str, str] | None = None
) -> tuple[Config | None, dict[str, OptionValue]]:
    """hixl.kv.init's discovery= (or HIXL_DISCOVERY) and options: (the configuration or None,
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
    return parse(url, disc_opts, env, cluster_secret(engine_opts, env)), engine_opts
