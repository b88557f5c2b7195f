"""The process's KV-cache context: one engine, this rank's directory, the linked peers."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import _place
from .._errors import Failed, HixlError, NotConnected, ParamInvalid, Timeout
from .._hixl import Hixl, MemType
from .._kvcore._cache import deregister
from .._kvcore._links import in_parallel
from .._kvcore._notify import Budget, Router
from .._layout import KVLayout
from .._typing import Options
from ._cache import (
    UNSET,
    CacheInfo,
    DeviceArray,
    RegisteredCache,
    as_array,
    as_device_array,
    axes,
    describe,
    describe_layers,
    layer_axes,
)
from ._directory import Directory, DirectoryReader, PeerDirectory
from ._discovery import Config as DiscoveryConfig
from ._discovery import Discovery, Member
from ._discovery import from_init as discovery_from_init
from ._errors import LLM_CACHE_NOT_FOUND, LLM_NOT_LINKED, LLM_ROLE_MISMATCH, KVError

ROLES = ("prompt", "decoder", "mix")

log = logging.getLogger("hixl.kv")


@dataclass(frozen=True)
class PeerRank:
    """A rank to link to: its cluster_id (the rank), optionally its address ("ip:port") and
    the role it must have. Without an address, the one given for this rank in
    ``hixl.kv.init(peers=...)`` / ``HIXL_PEERS`` is used."""

    cluster_id: int
    role: str | None = None
    address: str | None = None
    device_id: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerRank:
        """Keys: cluster_id (required), role, device_id, and address or ip + port."""
        if "cluster_id" not in d:
            raise ParamInvalid(f"cluster info {dict(d)!r} has no cluster_id")
        address = d.get("address")
        if address is None and "ip" in d and "port" in d:
            address = f"{d['ip']}:{d['port']}"
        role = d.get("role")
        if role is not None and role not in ROLES:
            raise ParamInvalid(f"role={role!r} must be one of {', '.join(ROLES)}")
        return cls(_rank(d["cluster_id"]), role, address, int(d.get("device_id", 0)))


def _rank(v: Any) -> int:
    try:
        r = int(v)
    except (TypeError, ValueError):
        r = -1
    if r < 0:
        raise ParamInvalid(f"cluster_id={v!r} must be an integer >= 0")
    return r


def parse_peers(text: str) -> dict[int, str]:
    """'1=10.0.0.2:18000,2=10.0.0.3:18000' -> {1: '10.0.0.2:18000', 2: ...}."""
    out: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        rank, sep, addr = part.partition("=")
        if not sep or ":" not in addr:
            raise ParamInvalid(f"HIXL_PEERS entry {part!r} is not RANK=IP:PORT")
        out[_rank(rank)] = addr.strip()
    return out


#: The layer's notification router (the KV core's): kept under its old name.
Mailbox = Router


class Context:
    """Everything hixl.kv.init() creates."""

    def __init__(
        self, rank: int, role: str, listen: str, device_id: int, options: Options | None
    ) -> None:
        self.rank, self.role, self.device_id = rank, role, device_id
        self.engine = Hixl()
        self.engine.initialize(listen, dict(options or {}))
        try:
            self.directory = Directory(self.engine, rank, role)
            self.reader = DirectoryReader(self.engine)
        except BaseException:
            self.engine.finalize()
            raise
        self.mailbox = Router(self.engine, log, Budget.of(options))
        self.known: dict[int, str] = {}
        self.peers: dict[int, PeerDirectory] = {}
        self.caches: dict[str, RegisteredCache] = {}
        self.lock = threading.Lock()
        self.counter = 0
        #: etcd discovery (hixl.kv.init(discovery=...)), or None
        self.discovery: Discovery | None = None
        self.link_timeout_ms = 10_000
        self.linking = threading.Lock()  # one on-demand link at a time

    # -- discovery -----------------------------------------------------------------------

    def start_discovery(self, cfg: DiscoveryConfig, deadline: float) -> None:
        """Publishes this rank in etcd and follows the ranks that join and leave."""
        from ._discovery import advertised

        d = Discovery(cfg)
        d.check()
        d.on_join, d.on_leave = self._joined, self._left
        me = Member(
            self.rank,
            self.role,
            advertised(self.address, cfg),
            self.device_id,
            tuple(self.caches),
            socket.gethostname(),
            os.getpid(),
        )
        d.start(me, deadline)
        self.discovery = d

    def _joined(self, m: Member) -> None:
        with self.lock:
            self.known[m.rank] = m.address

    def _left(self, m: Member) -> None:
        """A rank left the cluster (ended, or its lease expired): forget its address and drop
        the link to it, so that transfers to it fail at once with LLM_002004."""
        with self.lock:
            if self.known.get(m.rank) == m.address:
                del self.known[m.rank]
            peer = self.peers.get(m.rank)
            if peer is not None and peer.address == m.address:
                del self.peers[m.rank]
            else:
                peer = None
        if peer is not None:
            # disconnect may wait for transfers in flight: not on the watch thread
            _place.thread(
                self._disconnect, args=(peer.address,), name="hixl-kv-unlink", engine=self.engine
            ).start()

    def _disconnect(self, address: str) -> None:
        try:
            self.engine.disconnect(address)
        except HixlError:
            pass  # the link is gone already

    def _publish_caches(self) -> None:
        if self.discovery is not None:
            with self.lock:
                names = sorted(self.caches)
            self.discovery.update(names)

    def ranks(self, role: str | None = None) -> list[PeerRank]:
        """The other ranks this one knows: from discovery (its current view) or peers=."""
        if self.discovery is not None:
            out = [PeerRank(m.rank, m.role, m.address, m.device_id) for m in self.discovery.view()]
        else:
            with self.lock:
                linked = {r: p.role for r, p in self.peers.items()}
                out = [PeerRank(r, linked.get(r), a) for r, a in sorted(self.known.items())]
        return [i for i in out if role is None or i.role == role]

    @property
    def address(self) -> str:
        return self.engine.local_engine

    # -- links ---------------------------------------------------------------------------

    def link_all(self, infos: Iterable[PeerRank], timeout_ms: int) -> None:
        """Links to every rank in `infos` at once: one thread per rank connects (retrying
        while the rank is not up yet), reads its directory and checks its role, so linking
        to N ranks takes about as long as linking to one. Ranks already linked are skipped.
        Every link is tried; the first failure (in the order given) is raised afterwards."""
        todo: dict[int, tuple[PeerRank, str]] = {}
        for info in infos:
            address = info.address or self.known.get(info.cluster_id)
            if address is None and self.discovery is not None:
                m = self.discovery.lookup(info.cluster_id)  # it may have just started
                address = m.address if m is not None else None
            if address is None:
                raise ParamInvalid(
                    f"no address for cluster_id={info.cluster_id}: give one in "
                    "PeerRank or in init(peers=...) / HIXL_PEERS"
                    + (", or start it (discovery does not know it)" if self.discovery else "")
                )
            if info.cluster_id == self.rank:
                raise ParamInvalid(f"cluster_id={info.cluster_id} is this process's own rank")
            with self.lock:
                if info.cluster_id in self.peers:
                    continue
            if info.cluster_id in todo and todo[info.cluster_id][1] != address:
                raise ParamInvalid(
                    f"cluster_id={info.cluster_id} is given twice, at {todo[info.cluster_id][1]} "
                    f"and at {address}"
                )
            todo[info.cluster_id] = (info, address)
        addresses = [a for _, a in todo.values()]
        if len(set(addresses)) < len(addresses):
            raise ParamInvalid(f"two ranks are given the same address: {sorted(addresses)}")
        deadline = time.monotonic() + timeout_ms / 1000
        jobs = list(todo.values())
        if len(jobs) == 1:
            self._link_one(*jobs[0], deadline)
            return
        errors: list[BaseException | None] = [None] * len(jobs)

        def run(i: int) -> None:
            try:
                self._link_one(*jobs[i], deadline)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors[i] = exc

        in_parallel(run, len(jobs), "hixl-kv-link")
        for err in errors:
            if err is not None:
                raise err

    def _link_one(self, info: PeerRank, address: str, deadline: float) -> None:
        _connect_retrying(self.engine, address, deadline)
        try:
            peer = self.reader.fetch(address, info.cluster_id, deadline=deadline)
            if info.role is not None and peer.role != info.role:
                raise KVError(
                    LLM_ROLE_MISMATCH,
                    f"rank {peer.rank} at {address} has role {peer.role!r}, expected {info.role!r}",
                )
            if peer.role == self.role and peer.role != "mix":
                raise KVError(
                    LLM_ROLE_MISMATCH,
                    f"cannot link {self.role!r} rank {self.rank} "
                    f"to {peer.role!r} rank {peer.rank} at {address}: prompt and "
                    'decoder ranks are not interchangeable ("mix" links with both)',
                )
        except BaseException:
            try:
                self.engine.disconnect(address)
            except HixlError:
                pass  # the link is gone already
            raise
        with self.lock:
            self.known[peer.rank] = address
            self.peers[peer.rank] = peer

    def unlink(self, rank: int) -> None:
        with self.lock:
            peer = self.peers.pop(rank, None)
        if peer is not None:
            self.engine.disconnect(peer.address)

    def peer(self, rank: int) -> PeerDirectory:
        with self.lock:
            p = self.peers.get(rank)
        if p is None and self.discovery is not None and rank != self.rank:
            p = self._link_on_demand(rank)
        if p is None:
            raise KVError(
                LLM_NOT_LINKED,
                f"rank {rank} is not linked to rank {self.rank}: "
                "call hixl.kv.link() or pass it in init(peers=...)",
            )
        return p

    def _link_on_demand(self, rank: int) -> PeerDirectory | None:
        """Links to a rank of the discovery view on its first use; None when the view does
        not hold it."""
        m = self.discovery.lookup(rank) if self.discovery is not None else None
        if m is None:
            return None
        with self.linking:
            with self.lock:
                p = self.peers.get(rank)
            if p is None:
                self.link_all([PeerRank(rank, None, m.address)], self.link_timeout_ms)
                with self.lock:
                    p = self.peers.get(rank)
        return p

    def remote_cache(self, rank: int, name: str) -> tuple[PeerDirectory, CacheInfo]:
        """The peer's cache called `name`; re-reads its directory once when unknown."""
        p = self.peer(rank)
        info = p.caches.get(name)
        if info is None:
            fresh = self.reader.fetch(p.address, rank, p.dir_addr)
            with self.lock:
                p.caches = fresh.caches
            info = p.caches.get(name)
        if info is None:
            raise KVError(
                LLM_CACHE_NOT_FOUND,
                f"cache {name!r} does not exist on rank {rank} "
                f"(it has: {sorted(p.caches) or 'none'})",
            )
        return p, info

    # -- caches --------------------------------------------------------------------------

    def allocate(
        self,
        obj: Any,
        mem_type: Any,
        name: str | None,
        layout: KVLayout | None,
        layer_axis: int | None,
        block_axis: Any,
    ) -> RegisteredCache:
        if mem_type in ("device", MemType.DEVICE):
            as_mem: Any = as_device_array
        elif mem_type in ("host", MemType.HOST):
            as_mem = as_array
        else:
            raise ParamInvalid(f"mem_type={mem_type!r} must be 'host' or 'device'")
        layered = isinstance(obj, (list, tuple))
        if layered:
            if not obj:
                raise ParamInvalid("allocate_cache got an empty list of layers")
            arrs = [as_mem(x) for x in obj]
            ba = layer_axes(tuple(arrs[0].shape), layout, layer_axis, block_axis)
        else:
            arrs = [as_mem(obj)]
        with self.lock:
            if name is None:
                while str(self.counter) in self.caches:
                    self.counter += 1
                name = str(self.counter)
                self.counter += 1
            if not isinstance(name, str) or not name:
                raise ParamInvalid(f"name={name!r} must be a non-empty string")
            if name in self.caches:
                raise ParamInvalid(f"a cache named {name!r} already exists on rank {self.rank}")
            if layered:
                info = describe_layers(name, arrs, ba)
            else:
                arr = arrs[0]
                la, ba = axes(tuple(arr.shape), arr.dtype, layout, layer_axis, block_axis)
                info = describe(name, arr, la, ba)
            handles: list[Any] = []
            try:
                for a in arrs:
                    handles.append(self.engine.register(a.obj if isinstance(a, DeviceArray) else a))
            except BaseException:
                deregister(self.engine, handles)
                raise
            cache = RegisteredCache(info, list(obj) if layered else arrs[0], tuple(handles))
            self.caches[name] = cache
        try:
            self.directory.add(info)
        except BaseException:
            with self.lock:
                del self.caches[name]
            deregister(self.engine, handles, quiet=False)
            raise
        self._publish_caches()
        return cache

    def deallocate(self, cache: RegisteredCache) -> None:
        with self.lock:
            if self.caches.get(cache.name) is not cache:
                return
            del self.caches[cache.name]
        self.directory.remove(cache.name)
        deregister(self.engine, cache.handles, quiet=False)
        self._publish_caches()

    def finalize(self) -> None:
        d, self.discovery = self.discovery, None
        if d is not None:
            d.close()  # leaves the cluster first: peers stop using this rank
        self.engine.finalize()


def _connect_retrying(engine: Hixl, address: str, deadline: float) -> None:
    """Connects, retrying while the peer is not up yet (launched workers start in any
    order), until `deadline` (time.monotonic())."""
    while True:
        left_ms = (deadline - time.monotonic()) * 1000
        try:
            engine.connect(address, timeout_ms=max(100.0, min(left_ms, 2000.0)))
            return
        except (NotConnected, Timeout) as exc:
            if time.monotonic() + 0.05 >= deadline:
                raise KVError.from_engine(exc, f"link to {address}") from exc
            time.sleep(0.05)
        except HixlError as exc:
            raise KVError.from_engine(exc, f"link to {address}") from exc


_ctx: Context | None = None
_ctx_lock = threading.Lock()


def context() -> Context:
    ctx = _ctx
    if ctx is None:
        raise Failed("the KV-cache layer is not initialized: call hixl.kv.init() first")
    return ctx


def engine() -> Hixl:
    """The process's engine (the ``hixl.Hixl`` that ``hixl.kv.init`` made): for its stats,
    metrics and the application's own notifications. The KV layer owns it: ``finalize`` it
    only through ``hixl.kv.finalize``. ``hixl.Failed`` when ``hixl.kv.init`` has not run (or
    ``hixl.kv.finalize`` has)."""
    return context().engine


def init(
    cluster_id: int | None = None,
    role: str | None = None,
    listen: str | None = None,
    peers: Mapping[int, str] | None = None,
    device_id: int | None = None,
    options: Options | None = None,
    link_timeout_ms: int = 10_000,
    discovery: str | None = None,
) -> PeerRank:
    """Creates this process's engine and links to `peers`. Each argument left out is read
    from the environment: HIXL_CLUSTER_ID, HIXL_ROLE, HIXL_LISTEN (default 127.0.0.1:0),
    HIXL_PEERS ("1=ip:port,2=ip:port"), HIXL_DEVICE_ID, HIXL_DISCOVERY. Returns this rank's
    own info.

    With `discovery` ("etcd://host:2379/prefix"), this rank publishes itself in etcd and
    follows the ranks that join and leave (`hixl.kv.ranks()`); a transfer to a rank of that
    view links to it on first use, so no address needs to be configured. Options starting
    with "hixl.discovery." (ttl_s, default 10; see hixl.kv._discovery) are the
    discovery's, the others the engine's; values are str, int or bool, as for
    Hixl.initialize. NotConnected when etcd does not answer."""
    global _ctx
    env = os.environ
    if cluster_id is None:
        if "HIXL_CLUSTER_ID" not in env:
            raise ParamInvalid("cluster_id is missing: pass cluster_id= or set HIXL_CLUSTER_ID")
        cluster_id = env["HIXL_CLUSTER_ID"]  # type: ignore[assignment]
    rank = _rank(cluster_id)
    role = role if role is not None else env.get("HIXL_ROLE", "mix")
    if role not in ROLES:
        raise ParamInvalid(f"role={role!r} must be one of {', '.join(ROLES)}")
    listen = listen or env.get("HIXL_LISTEN", "127.0.0.1:0")
    if peers is not None and not isinstance(peers, Mapping):
        raise ParamInvalid(
            f"peers={peers!r} ({type(peers).__name__}) must map each rank to its address, "
            "e.g. {1: '10.0.0.2:26000'}"
        )
    peer_map = dict(peers) if peers is not None else parse_peers(env.get("HIXL_PEERS", ""))
    dev = device_id if device_id is not None else int(env.get("HIXL_DEVICE_ID", "0"))
    disc_cfg, options = discovery_from_init(discovery, options, env)
    with _ctx_lock:
        if _ctx is not None:
            raise Failed(
                f"hixl.kv.init() was already called (rank {_ctx.rank}); "
                "call hixl.kv.finalize() first"
            )
        ctx = Context(rank, role, listen, dev, options)
        ctx.known.update({_rank(r): a for r, a in peer_map.items()})
        ctx.link_timeout_ms = link_timeout_ms
        try:
            if disc_cfg is not None:
                ctx.start_discovery(disc_cfg, time.monotonic() + disc_cfg.ttl_s + 1)
            ctx.link_all([PeerRank(_rank(r)) for r in peer_map], link_timeout_ms)
        except BaseException:
            ctx.finalize()
            raise
        _ctx = ctx
    return PeerRank(rank, role, ctx.address, dev)


def finalize() -> None:
    """Ends the KV-cache layer: deregisters every cache and stops the engine. Idempotent."""
    global _ctx
    with _ctx_lock:
        ctx, _ctx = _ctx, None
    if ctx is not None:
        ctx.finalize()


def _infos(items: Iterable[Any] | Any) -> list[PeerRank]:
    if isinstance(items, (PeerRank, int, dict)):
        items = [items]
    out = []
    for it in items:
        if isinstance(it, PeerRank):
            out.append(it)
        elif isinstance(it, Mapping):
            out.append(PeerRank.from_dict(it))
        else:
            out.append(PeerRank(_rank(it)))
    return out


def link(clusters: Iterable[Any] | Any, timeout_ms: int = 10_000) -> None:
    """Links this rank to each cluster (PeerRank, dict or rank): connects, reads its
    directory and checks the roles, all ranks at once. Already linked ranks are skipped."""
    context().link_all(_infos(clusters), timeout_ms)


def unlink(clusters: Iterable[Any] | Any) -> None:
    """Disconnects from each cluster (PeerRank, dict or rank); unknown ones are ignored."""
    ctx = context()
    for info in _infos(clusters):
        ctx.unlink(info.cluster_id)


def allocate_cache(
    obj: Any,
    mem_type: Any = "host",
    name: str | None = None,
    *,
    layout: KVLayout | None = None,
    layer_axis: int | None = None,
    block_axis: int | None = UNSET,
) -> RegisteredCache:
    """Registers `obj` (numpy array, torch CPU tensor or writable buffer; zero copy) as a KV
    cache that linked peers can address by `name` (default: allocation order "0", "1", ...).
    With `mem_type="device"`, `obj` is device memory instead (a torch CUDA tensor, a CuPy
    array, a `hixl.cuda_alloc` buffer: anything with `__cuda_array_interface__`); without CUDA
    that raises Unsupported.

    The cache's layout is given, never guessed: `layout=` a KVLayout (`obj` of its shape, as
    `layout.array()` builds: layers on axis 0, blocks on axis 2), or both `layer_axis` (the
    axis of layers) and `block_axis` (that of blocks for paged transfers; None for a cache
    without blocks). With neither, or an axis the shape lacks, ParamInvalid names it."""
    return context().allocate(obj, mem_type, name, layout, layer_axis, block_axis)


def deallocate_cache(cache: RegisteredCache) -> None:
    """Deregisters a cache and removes it from this rank's directory. Idempotent."""
    context().deallocate(cache)


def ranks(role: str | None = None) -> list[PeerRank]:
    """The other ranks of the cluster this rank knows, by rank (each with its role and
    address): with discovery, etcd's current view (ranks that ended or died are gone within
    their TTL); without, the ranks of peers= / HIXL_PEERS and those linked. `role` filters."""
    if role is not None and role not in ROLES:
        raise ParamInvalid(f"role={role!r} must be one of {', '.join(ROLES)}")
    return context().ranks(role)
