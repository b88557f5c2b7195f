"""One LLMDataDist's state on hixl: an engine (through hixl.kv's Context: linking,
role checks and the directory peers read one-sidedly), its caches and keys as published in
that directory, and the thread that applies peers' key releases."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _peertext as peertext
from .. import _place
from .._errors import AlreadyConnected, HixlError
from .._hixl import MemHandle, NotifyDesc, TransferOp
from .._kvcore._cache import deregister, register_tensors
from .._kvcore._plan import descs
from .._kvcore._window import Window
from ..kv._context import Context
from ..kv._context import PeerRank as KvClusterInfo
from ..kv._sender import same_engine
from ._cache import Cache
from ._status import LLMException, LLMStatusCode, fail, wrap
from ._types import CacheDesc

#: The notification a puller sends the owner of a CacheKey after pulling by it: the key is
#: used up (LLM-DataDist releases a key once it has been pulled). Honoured only from the
#: engine of a cluster linked with this node, either way.
RELEASE_NOTIFY = "hixl.lldd.release"
#: Sent to a cluster after linking to it: {"cluster": id, "address": "ip:port"}, so that it
#: can link back on demand (LLM-DataDist's links carry transfers both ways). The way back is
#: the engine the hello came from (NotifyDesc.peer), never the text's address; a route is
#: never replaced by another engine's hello (refused and logged until the first says bye).
HELLO_NOTIFY = "hixl.lldd.hello"
#: Sent before a non-forced unlink: the peer forgets the way back (and closes it). Honoured
#: only from the engine that cluster's route leads to.
BYE_NOTIFY = "hixl.lldd.bye"
#: The names this layer takes from its engine, in one wait (so that they keep their arrival
#: order); every other notification stays there for the application's get_notifies /
#: wait_notifies.
OWN_NOTIFIES = [RELEASE_NOTIFY, HELLO_NOTIFY, BYE_NOTIFY]
#: How long a use of a cluster that has not linked here waits for its hello, which the peer
#: sends right after its link is up but this node applies on its own thread.
HELLO_WAIT_S = 2.0
#: How long an owner's answer to a connect stands for it: hellos naming its cluster from other
#: engines within this time cost no connect (a flood of them is no handshake reflector).
ANSWERED_S = 5.0
#: Where a node publishes its caches and keys in its directory's ``extra``.
EXTRA_KEY = "lldd"

#: The longest release, hello or bye text this layer reads (its own are under 100 bytes).
MAX_NOTE_BYTES = 4096
#: The largest id a CacheKey field or a cluster id may be (LLM-DataDist's uint64).
MAX_ID = 2**64 - 1

KeyIdent = tuple[int, int, int, int]

log = logging.getLogger("hixl.llm_datadist")


def parse_release(msg: str) -> KeyIdent:
    """A release's text (a peer's): the JSON array of the CacheKey's four fields
    [cluster_id, req_id, model_id, prefix_id], each an integer in [0, MAX_ID]; Malformed
    otherwise (a float such as ``1e999``, NaN, a boolean, another length, another type)."""
    fields = peertext.array(peertext.loads(msg, "release", MAX_NOTE_BYTES), "release's CacheKey", 4)
    if len(fields) != 4:
        raise peertext.Malformed(f"release's CacheKey has {len(fields)} fields, not 4")
    a, b, c, d = (peertext.integer(x, "release's CacheKey field", 0, MAX_ID) for x in fields)
    return (a, b, c, d)


def parse_cluster(msg: str, what: str) -> int:
    """The cluster id of a hello's or bye's text (a peer's `what`): a JSON object whose
    "cluster" is an integer in [0, MAX_ID] (other members, such as a hello's "address", are
    not read); Malformed otherwise."""
    doc = peertext.obj(peertext.loads(msg, what, MAX_NOTE_BYTES), what)
    if "cluster" not in doc:
        raise peertext.Malformed(f"{what} names no cluster")
    return peertext.integer(doc["cluster"], f"{what}'s cluster", 0, MAX_ID)


@dataclass
class Local:
    """A cache of this node."""

    cache: Cache
    handles: list[MemHandle]
    owned: list[np.ndarray] = field(default_factory=list)  # memory allocate_cache made
    keys: set[KeyIdent] = field(default_factory=set)
    bkey: tuple[int, int] | None = None
    dealloc_pending: bool = False
    writable: bool = True  # peers may push into it (not only pull)


@dataclass
class RemoteCache:
    cache_id: int
    desc: CacheDesc
    addrs: list[int]


@dataclass
class RemoteView:
    """What a peer publishes: its caches, CacheKeys (-> cache id, batch index) and
    BlocksCacheKeys (-> cache id)."""

    address: str
    caches: dict[int, RemoteCache]
    keys: dict[KeyIdent, tuple[int, int]]
    bkeys: dict[tuple[int, int], int]


class Node:
    def __init__(
        self,
        cluster_id: int,
        role: str,
        listen: str,
        device_id: int,
        engine_options: dict[str, str],
        timeout_ms: int,
    ) -> None:
        self.cluster_id = cluster_id
        self.timeout_ms = timeout_ms
        self.device_id = device_id
        self.engine_options = engine_options
        self.ctx = Context(cluster_id, role, listen, device_id, engine_options)
        self.lock = threading.RLock()
        self.route_added = threading.Condition(self.lock)
        self.caches: dict[int, Local] = {}
        self.keys: dict[KeyIdent, tuple[int, int]] = {}
        self.bkeys: dict[tuple[int, int], int] = {}
        self.next_id = 1
        # CacheKeys this node has pulled (-> the owner's cache id then): a second pull by
        # the same key fails at once, even before the owner has applied the release.
        self.consumed: dict[KeyIdent, int] = {}
        # Clusters that linked to this node (-> their listen address), and those of them this
        # node has linked back to on demand (not links of its own: switch_role ignores them).
        self.routes: dict[int, str] = {}
        self.back: set[int] = set()
        # Route owners (-> monotonic time) that last answered a liveness connect.
        self.answered: dict[str, float] = {}
        self.closed = False
        self.publish()
        self.thread = self._start()

    def _start(self) -> threading.Thread:
        t = _place.thread(
            self._serve, args=(self.ctx.engine,), name="hixl-lldd-release", engine=self.ctx.engine
        )
        t.start()
        return t

    def restart(self, role: str, listen: str) -> None:
        """A new engine with another role (and listen address), every cache registered again
        at the same addresses (switch_role)."""
        old_role = self.ctx.role
        self.close()  # outside the lock: the release thread may be waiting for it
        with self.lock:
            self.routes.clear()
            self.back.clear()
            try:
                self.ctx = Context(
                    self.cluster_id, role, listen, self.device_id, self.engine_options
                )
            except BaseException:
                # Stay usable: the old role on a free port (the caller gets the error).
                self.ctx = Context(
                    self.cluster_id, old_role, "127.0.0.1:0", self.device_id, self.engine_options
                )
                self._reregister()
                raise
            self._reregister()

    def _reregister(self) -> None:
        with self.lock:
            for loc in self.caches.values():
                d = loc.cache.cache_desc
                loc.handles = self.register(loc.cache.tensor_addrs, d.size, loc.writable)
            self.closed = False
            self.publish()
            self.thread = self._start()

    @property
    def engine(self) -> Any:
        return self.ctx.engine

    # -- publishing --------------------------------------------------------------------

    def publish(self) -> None:
        """Rewrites this node's entry in its directory (the caller may hold self.lock)."""
        with self.lock:
            doc = {
                "caches": {
                    str(cid): {
                        "desc": loc.cache.cache_desc.to_json(),
                        "addrs": loc.cache.tensor_addrs,
                    }
                    for cid, loc in self.caches.items()
                },
                "keys": [[*k, cid, b] for k, (cid, b) in self.keys.items()],
                "bkeys": [[c, m, cid] for (c, m), cid in self.bkeys.items()],
            }
            self.ctx.directory.extra[EXTRA_KEY] = doc
            self.ctx.directory.publish()

    def new_id(self) -> int:
        with self.lock:
            cid = self.next_id
            self.next_id += 1
            return cid

    def register(self, addrs: list[int], nbytes: int, writable: bool) -> list[MemHandle]:
        try:
            return register_tensors(self.engine, addrs, nbytes, "rw" if writable else "r")
        except BaseException as exc:
            raise wrap(exc, "registering the cache's memory") from exc

    def add(self, loc: Local, keys: Iterable[tuple[KeyIdent, int]]) -> None:
        with self.lock:
            keys = list(keys)
            for k, _ in keys:
                if k in self.keys:
                    raise fail(
                        LLMStatusCode.LLM_PARAM_INVALID, f"CacheKey {list(k)} is already in use"
                    )
            if loc.bkey is not None and loc.bkey in self.bkeys:
                raise fail(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"BlocksCacheKey {list(loc.bkey)} is already in use",
                )
            cid = loc.cache.cache_id
            self.caches[cid] = loc
            for k, b in keys:
                self.keys[k] = (cid, b)
                loc.keys.add(k)
            if loc.bkey is not None:
                self.bkeys[loc.bkey] = cid
            self.publish()

    def drop(self, cid: int, force: bool = True) -> None:
        """Forgets cache `cid` and deregisters its memory; with force=False only once no
        CacheKey refers to it any more (then it is marked and dropped when the last goes)."""
        with self.lock:
            loc = self.caches.get(cid)
            if loc is None:
                return
            if loc.keys and not force:
                loc.dealloc_pending = True
                return
            del self.caches[cid]
            for k in loc.keys:
                self.keys.pop(k, None)
            if loc.bkey is not None and self.bkeys.get(loc.bkey) == cid:
                del self.bkeys[loc.bkey]
            self.publish()
            loc.cache._valid = False
        deregister(self.engine, loc.handles)  # quiet: it may be finalized already

    def remove_key(self, k: KeyIdent) -> bool:
        with self.lock:
            hit = self.keys.pop(k, None)
            if hit is None:
                return False
            loc = self.caches.get(hit[0])
            if loc is not None:
                loc.keys.discard(k)
                if loc.dealloc_pending and not loc.keys:
                    self.drop(hit[0])
                    return True
            self.publish()
            return True

    def _serve(self, engine: Any) -> None:
        """Applies what peers send to `engine`: key releases after a pull by CacheKey, and
        the hello / bye of clusters that link to this node. Takes only those names (through
        the KV core's router, which logs and drops a notification whose text is refused and
        goes on): the application's own notifications stay in the engine."""
        self.ctx.mailbox.serve(
            OWN_NOTIFIES, self._apply, lambda: not self.closed and self.ctx.engine is engine
        )

    def _apply(self, n: NotifyDesc) -> None:
        """Acts on a peer's notification; its sender is the engine it came from (its
        connection's, never anything its text claims). A release from an engine of no linked
        cluster is dropped before its text is read; a text that is refused raises Malformed."""
        sender = n.peer
        if n.name == RELEASE_NOTIFY:
            if not self._linked_engine(sender):
                log.warning(
                    "ignored a CacheKey release from %r: no cluster linked with this one runs "
                    "there",
                    sender,
                )
                return
            self.remove_key(parse_release(n.msg))
        elif n.name == HELLO_NOTIFY:
            self._hello_from(parse_cluster(n.msg, "hello"), sender)
        elif n.name == BYE_NOTIFY:
            cid = parse_cluster(n.msg, "bye")
            with self.lock:
                owner = self.routes.get(cid)
            if owner is None:
                return
            if not same_engine(sender, owner):
                log.warning(
                    "ignored a bye for cluster %d from %r: its route is %r", cid, sender, owner
                )
                return
            self.forget_route(cid)

    def _hello_from(self, cid: int, sender: str) -> None:
        """Routes `cid` back to `sender`, unless another engine is known as that cluster."""
        if cid == self.cluster_id or ":" not in sender or "#" in sender or sender[:1] == "?":
            return  # ourselves, or an engine that does not listen: no way back
        with self.ctx.lock:
            p = self.ctx.peers.get(cid)
        with self.lock:
            owner = p.address if p is not None else self.routes.get(cid)
        if owner is not None and not same_engine(sender, owner):
            if p is not None or self._answers(owner):
                log.warning(
                    "refused a hello from %r claiming cluster %d, which is %r", sender, cid, owner
                )
                return
            # A cluster that went away without a bye and came back on another address.
            log.info("cluster %d at %r no longer answers: its way back is %r", cid, owner, sender)
            self.forget_route(cid)
        with self.lock:
            self.routes.setdefault(cid, sender)
            self.route_added.notify_all()

    def _answers(self, address: str) -> bool:
        """Whether an engine still listens at `address` (one connect of at most 1 s; over a
        link this node holds to it, one round trip: a link not yet found dead after its peer
        was killed proves nothing). An answer stands for ANSWERED_S: further hellos against
        the same owner in that time connect nowhere."""
        now = time.monotonic()
        with self.lock:
            if now - self.answered.get(address, -ANSWERED_S) < ANSWERED_S:
                return True
        try:
            self.engine.connect(address, timeout_ms=1000)
        except AlreadyConnected:
            try:
                self.engine.remote_regions(address, refresh=True)
            except HixlError:
                with self.lock:
                    self.answered.pop(address, None)
                return False
        except HixlError:
            with self.lock:
                self.answered.pop(address, None)
            return False
        else:
            try:
                self.engine.disconnect(address, timeout_ms=1000)
            except HixlError:
                pass  # gone already
        with self.lock:
            self.answered = {a: t for a, t in self.answered.items() if a in self.routes.values()}
            self.answered[address] = time.monotonic()
        return True

    def _linked_engine(self, sender: str) -> bool:
        """Whether `sender` is the engine of a cluster linked with this node, either way."""
        with self.ctx.lock:
            mine = [p.address for p in self.ctx.peers.values()]
        with self.lock:
            mine += list(self.routes.values())
        return any(same_engine(sender, a) for a in mine)

    def forget_route(self, cid: int) -> None:
        with self.lock:
            self.routes.pop(cid, None)
            was_back = cid in self.back
            self.back.discard(cid)
        if was_back:
            try:
                self.ctx.unlink(cid)
            except HixlError:
                pass  # gone already

    def explicit_links(self) -> list[int]:
        """Clusters this node linked to itself (not the ways back it opened on demand)."""
        with self.ctx.lock:
            linked = set(self.ctx.peers)
        with self.lock:
            return sorted(linked - self.back)

    def _tell(self, address: str, name: str, doc: dict[str, Any]) -> None:
        try:
            self.engine.send_notify(address, NotifyDesc(name, json.dumps(doc)), timeout_ms=2000)
        except HixlError:
            pass  # best effort: without it the peer just cannot link back

    def hello(self, address: str) -> None:
        self._tell(address, HELLO_NOTIFY, {"cluster": self.cluster_id, "address": self.ctx.address})

    def bye(self, address: str) -> None:
        self._tell(address, BYE_NOTIFY, {"cluster": self.cluster_id})

    def peer_address(self, cluster_id: int) -> str:
        """The address of a linked cluster; a cluster that linked to this node is linked back
        to on first use. LLM_NOT_YET_LINK otherwise."""
        with self.ctx.lock:
            p = self.ctx.peers.get(cluster_id)
        if p is not None:
            return p.address
        deadline = time.monotonic() + HELLO_WAIT_S
        with self.lock:
            address = self.routes.get(cluster_id)
            while address is None and (left := deadline - time.monotonic()) > 0:
                self.route_added.wait(left)
                address = self.routes.get(cluster_id)
        if address is None:
            raise fail(
                LLMStatusCode.LLM_NOT_YET_LINK,
                f"cluster {cluster_id} is not linked to cluster {self.cluster_id} "
                "(call link_clusters)",
            )
        try:
            self.ctx.link_all([KvClusterInfo(cluster_id, None, address)], self.timeout_ms)
        except Exception as exc:
            raise wrap(exc, f"linking back to cluster {cluster_id} at {address}") from exc
        with self.lock:
            self.back.add(cluster_id)
        return address

    # -- peers -------------------------------------------------------------------------

    def view(self, cluster_id: int) -> RemoteView:
        """The peer's caches and keys, read now (one-sided) from its directory."""
        self.peer_address(cluster_id)
        try:
            peer = self.ctx.peer(cluster_id)
            fresh = self.ctx.reader.fetch(peer.address, cluster_id, peer.dir_addr)
        except (HixlError, LLMException) as exc:
            raise wrap(exc, f"cluster {cluster_id}") from exc
        doc = fresh.extra.get(EXTRA_KEY)
        try:
            if doc is None:
                raise ValueError("it publishes no LLM-DataDist caches (not an LLMDataDist?)")
            caches = {
                int(cid): RemoteCache(
                    int(cid), CacheDesc.from_json(c["desc"]), [int(a) for a in c["addrs"]]
                )
                for cid, c in doc["caches"].items()
            }
            keys = {
                (int(e[0]), int(e[1]), int(e[2]), int(e[3])): (int(e[4]), int(e[5]))
                for e in doc["keys"]
            }
            bkeys = {(int(e[0]), int(e[1])): int(e[2]) for e in doc["bkeys"]}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, LLMException) as exc:
            raise fail(
                LLMStatusCode.LLM_FAILED,
                f"cluster {cluster_id} at {peer.address} publishes a malformed cache list: {exc}",
            ) from None
        return RemoteView(peer.address, caches, keys, bkeys)

    @property
    def stuck(self) -> str:
        """The Timeout's message of a request that outlives the node's timeout."""
        return f"still running after {self.timeout_ms} ms"

    @staticmethod
    def what(cluster_id: int, op: TransferOp) -> str:
        """What a request to `cluster_id` does, for its errors."""
        return f"{'pull from' if op == TransferOp.READ else 'push to'} cluster {cluster_id}"

    def transfer(
        self, cluster_id: int, address: str, op: TransferOp, pairs: list[tuple[int, int, int]]
    ) -> None:
        """One request moving `pairs` (local, remote, length) on the KV core's window,
        waited for within the node's timeout; engine errors become LLMExceptions."""
        if not pairs:
            return
        what = self.what(cluster_id, op)

        def failed(_: None, exc: HixlError) -> None:
            raise wrap(exc, what) from exc

        window: Window[None] = Window(self.engine, 1, self.timeout_ms, lambda _: None, failed)
        window.submit(None, address, op, descs(pairs), stuck=self.stuck)
        window.drain()

    def release(self, cluster_id: int, address: str, k: KeyIdent, cid: int) -> None:
        with self.lock:
            self.consumed[k] = cid
        try:
            self.engine.send_notify(
                address, NotifyDesc(RELEASE_NOTIFY, json.dumps(list(k))), timeout_ms=self.timeout_ms
            )
        except HixlError:
            pass  # the pull succeeded; the owner keeps the key until remove_cache_key

    def close(self) -> None:
        self.closed = True
        self.ctx.finalize()
        self.thread.join(5)
