"""Agent metadata and remote agents of ``nixl_agent`` (``get_agent_metadata``,
``add_remote_agent``, ``make_connection``, ...), and the listen-thread side channel
(``send_local_metadata``, ``fetch_remote_metadata``, ...). The wire formats are in ``_meta``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from .. import _place, _probe
from .._errors import HixlError, Status
from .._hixl import AsyncConnectStatus
from . import _auth, _meta
from ._bindings import (
    DEFAULT_COMM_PORT,
    DRAM_SEG,
    from_hixl,
    nixlInvalidParamError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
)
from ._common import _CONNECT_WAIT_S, _first_outside, _name, log
from ._memory import _Memory

# How long one liveness probe of a remote agent's engine may take (a refused connect is retried
# until then).
_PROBE_MS = 300


class _Remote:
    __slots__ = ("name", "engine", "starts", "ends", "ready", "was_linked")

    def __init__(self, name: str, engine: str, regions: list[list[int]]) -> None:
        self.name, self.engine, self.ready = name, engine, False
        # Linked once: a link that died since, or a refused connect, means a dead agent (NIXL
        # reports it at once); only the first connect waits for the agent to come up.
        self.was_linked = False
        self.starts = np.zeros(0, np.uint64)
        self.ends = np.zeros(0, np.uint64)
        self.add_regions(regions)

    def add_regions(
        self, regions: list[list[int]] | list[tuple[int, int]], most: int | None = None
    ) -> None:
        """Adds `regions` (one entry per start); with `most`, refuses (nixlNotAllowedError,
        nothing changed) when the agent would then hold more regions than that."""
        if not regions:
            return
        r = np.array([[int(x[0]), int(x[0]) + int(x[1])] for x in regions], np.uint64)
        starts = np.concatenate([self.starts, r[:, 0]])
        ends = np.concatenate([self.ends, r[:, 1]])
        # Keep one entry per start (the longest), sorted: later tables replace earlier ones.
        order = np.lexsort((-ends.astype(np.float64), starts))
        starts, ends = starts[order], ends[order]
        keep = np.ones(starts.shape[0], bool)
        keep[1:] = starts[1:] != starts[:-1]
        if most is not None and int(keep.sum()) > most:
            raise nixlNotAllowedError(
                f"agent {self.name!r} would hold {int(keep.sum())} regions, over the "
                f"{most} of hixl_listen_thread_max_regions"
            )
        self.starts, self.ends = starts[keep], ends[keep]


class _Metadata(_Memory):
    """Metadata, remote agents and the side channel of ``nixl_agent``."""

    _remotes: dict[str, _Remote]
    _fetch_errors: dict[str, str]
    _listener: _meta.Listener | None
    _closed: bool
    # Agents first loaded from the listen thread, their cap and the cap on regions of metadata
    # from the wire (hixl_listen_thread_max_agents, _max_regions); the side channel's key.
    _wire_agents: set[str]
    _wire_max_agents: int
    _wire_max_regions: int
    _side_key: _auth.Key | None
    # Links kept after remove_remote_agent (Ray removes and re-adds a sender's agent for each
    # object): engine address -> (when it is closed if still unused, the agent it served).
    _idle: dict[str, tuple[float, str]]
    _link_idle_s: float
    _reaper: threading.Thread | None
    _reaper_wake: threading.Event
    # Engines this agent was linked to once: a dead link to one is probed, not waited for.
    _linked_engines: set[str]

    # --- metadata ---------------------------------------------------------------------------

    def _region_rows(self, only: Any = None) -> list[list[int]]:
        with self._lock:
            keys = [k for k, r in self._regs.items() if r.parent is None]
        if only is None:
            return [[a, n, 0] for a, n in sorted(keys)]
        return [[int(a), int(n), int(d)] for a, n, d in only.arr]

    def get_agent_metadata(self) -> bytes:
        return _meta.encode(self.name, self._addr, self._region_rows())

    def get_partial_agent_metadata(
        self, descs: Any, inc_conn_info: bool = False, backends: Any = None
    ) -> bytes:
        d = self.get_reg_descs(descs, "DRAM") if descs is not None else nixlRegDList(DRAM_SEG)
        rows = self._region_rows(d)
        return _meta.encode(self.name, self._addr if inc_conn_info else None, rows, True)

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a peer's metadata; returns its name as bytes (as NIXL does)."""
        return self._add_remote(metadata, False, _meta.ENGINE_MAX_REGIONS)

    def _add_remote(self, metadata: bytes, wire: bool, most: int) -> bytes:
        """`add_remote_agent`, of metadata with at most `most` regions. `wire`: it came from
        the listen thread, so a new agent counts against hixl_listen_thread_max_agents (over
        it the metadata is refused) and the agent may hold at most `most` regions."""
        doc = _meta.decode(metadata, most)
        name: str = doc["name"]
        engine: str | None = doc.get("engine")
        cap = most if wire else None
        connect = False
        with self._lock:
            r = self._remotes.get(name)
            if name == self.name:
                return name.encode()  # our own: loopback needs nothing loaded
            if wire and r is None and len(self._wire_agents) >= self._wire_max_agents:
                raise nixlNotAllowedError(
                    f"agent {name!r} is not loaded: {len(self._wire_agents)} agents loaded from "
                    f"the listen thread already (hixl_listen_thread_max_agents="
                    f"{self._wire_max_agents}; remove_remote_agent frees one)"
                )
            if engine is None:
                if r is None:
                    raise nixlNotFoundError(
                        f"partial metadata of agent {name!r} has no connection info and the "
                        "agent is not loaded yet"
                    )
                r.add_regions(doc["regions"], cap if name in self._wire_agents else None)
            elif r is not None and r.engine != engine:
                # As NIXL's loadRemoteMD: a loaded agent's connection info never changes.
                raise nixlNotAllowedError(
                    f"agent {name!r} is loaded with engine {r.engine}; metadata naming engine "
                    f"{engine} is refused (remove_remote_agent({name!r}) first)"
                )
            elif r is None or not doc.get("partial"):
                nr = _Remote(name, engine, doc["regions"] if not doc.get("partial") else [])
                if doc.get("partial"):
                    nr.add_regions(doc["regions"])
                if r is not None:
                    nr.ready = r.ready
                    nr.was_linked = r.was_linked
                self._remotes[name] = nr
                if wire and r is None:
                    self._wire_agents.add(name)
                connect = not nr.ready
            else:
                r.add_regions(doc["regions"], cap if name in self._wire_agents else None)
            self._fetch_errors.pop(name, None)
            moved = []
            if engine is not None:
                self._idle.pop(engine, None)  # loaded again: its kept link serves it
                moved = [e for e, (_, n) in self._idle.items() if n == name]
                for e in moved:
                    del self._idle[e]
        for e in moved:  # the agent's address changed: its old link goes now
            self._disconnect(e, name)
        if connect and engine is not None:
            try:
                self._engine.connect_async(engine)
            except HixlError:
                pass  # already connected or connecting; the first use checks
        return name.encode()

    def remove_remote_agent(self, agent: Any) -> None:
        name = _name(agent)
        with self._lock:
            r = self._remotes.pop(name, None)
            self._wire_agents.discard(name)
        if r is None:
            raise nixlNotFoundError(f"remote agent {name!r} is not loaded")
        with self._lock:
            if any(x.engine == r.engine for x in self._remotes.values()):
                return  # another loaded agent still uses that engine's link
            keep = self._link_idle_s > 0 and not self._in_flight(r.engine)
            if keep:
                self._idle[r.engine] = (time.monotonic() + self._link_idle_s, name)
        if keep:
            self._start_reaper()
            return
        self._disconnect(r.engine, name)

    def _in_flight(self, engine: str) -> bool:
        """Whether requests to `engine` are in flight (remove_remote_agent then cuts them)."""
        try:
            return bool(self._engine.stats().get(engine, {}).get("in_flight", 0))
        except HixlError:
            return True

    def _disconnect(self, engine: str, name: str) -> None:
        try:
            self._engine.disconnect(engine, timeout_ms=2000)
        except HixlError as e:
            log.info("hixl.nixl: disconnecting from %s (%s): %s", name, engine, e)

    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                self._reaper_wake.set()
                return
            self._reaper = _place.thread(self._reap, name="hixl-nixl-idle", engine=self._engine)
            self._reaper.start()

    def _reap(self) -> None:
        """Closes the links kept after remove_remote_agent once unused for hixl_link_idle_s."""
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                due = [(e, n) for e, (t, n) in self._idle.items() if t <= now]
                for e, _ in due:
                    del self._idle[e]
                nxt = min((t for t, _ in self._idle.values()), default=None)
                if nxt is None:
                    self._reaper = None
            for e, n in due:
                self._disconnect(e, n)
            if nxt is None:
                return
            self._reaper_wake.wait(max(nxt - now, 0.001))
            self._reaper_wake.clear()

    def make_connection(self, remote_agent: Any, backends: Any = None) -> None:
        self._ready(self._remote(remote_agent))

    def _remote(self, agent: Any) -> _Remote:
        name = _name(agent)
        if name == self.name:
            r = _Remote(name, self._addr, [])
            r.starts, r.ends = self._lstarts, self._lends
            with self._lock:
                old = self._remotes.get(name)
                r.ready = old.ready if old is not None else False
                self._remotes.setdefault(name, r)
                self._remotes[name].starts, self._remotes[name].ends = r.starts, r.ends
                return self._remotes[name]
        r2 = self._remotes.get(name)
        if r2 is None:
            raise nixlNotFoundError(f"remote agent {name!r} is not loaded (add_remote_agent)")
        return r2

    def _ready(self, r: _Remote) -> None:
        """Waits for the link to r's engine (opened in the background by add_remote_agent)."""
        if r.ready:
            return
        # An agent linked before whose link died: one short probe (a live agent that restarted
        # answers it), else reported dead at once, as NIXL does; only the first connect to an
        # agent waits up to _CONNECT_WAIT_S for it to come up.
        known = r.was_linked or r.engine in self._linked_engines
        wait_s = _PROBE_MS / 1000 if known else _CONNECT_WAIT_S
        start = time.monotonic()
        deadline = start + wait_s
        probed = False
        while True:
            st = self._engine.get_async_connect_status(r.engine)
            if st == AsyncConnectStatus.CONNECTED:
                r.ready = r.was_linked = True
                self._linked_engines.add(r.engine)
                return
            # An agent's metadata names its engine only once that engine listens: a refused
            # connect means the agent is gone, reported now rather than after the first-connect
            # wait (which is for engines slow to answer, not for closed ports).
            if (
                not known
                and not probed
                and (
                    st != AsyncConnectStatus.CONNECTING
                    or time.monotonic() - start >= _PROBE_MS / 1000
                )
            ):
                probed = True
                if _probe.refuses(r.engine):
                    raise nixlRemoteDisconnectError(
                        f"connecting to agent {r.name!r} at {r.engine}: connection refused, "
                        "nothing listens there any more (the agent is gone)",
                        Status.NOT_CONNECTED,
                    )
            if st == AsyncConnectStatus.CONNECTING:
                # A connect in progress (add_remote_agent's) is not a link: wait for it, up to
                # the deadline, then report the agent unreachable.
                if time.monotonic() < deadline:
                    time.sleep(0.001)
                    continue
                raise nixlRemoteDisconnectError(
                    f"connecting to agent {r.name!r} at {r.engine}: no link within {wait_s:g} s",
                    Status.NOT_CONNECTED,
                )
            try:
                left = max(deadline - time.monotonic(), min(wait_s, 0.5))
                self._engine.connect(r.engine, timeout_ms=left * 1000)
                r.ready = r.was_linked = True
                self._linked_engines.add(r.engine)
                return
            except HixlError as e:
                if e.status == Status.ALREADY_CONNECTED and (
                    time.monotonic() < deadline
                    or self._engine.get_async_connect_status(r.engine)
                    == AsyncConnectStatus.CONNECTED
                ):
                    continue  # linked or being linked meanwhile: the status says which
                raise from_hixl(
                    e, f"connecting to agent {r.name!r} at {r.engine}", nixlRemoteDisconnectError
                ) from e

    # --- the listen-thread side channel ---------------------------------------------------------

    def _load_from_peer(self, md: bytes, peer: str) -> None:
        """An ``S`` request: loads the metadata, unless it would re-point a loaded agent or go
        over hixl_listen_thread_max_agents / _max_regions (raises; the listener logs it)."""
        self._add_remote(md, True, self._wire_max_regions)

    def _answers(self, engine: str) -> bool:
        """Whether the engine at `engine` is alive: linked, or accepting a new link."""
        st = self._engine.get_async_connect_status(engine)
        if st in (AsyncConnectStatus.CONNECTED, AsyncConnectStatus.CONNECTING):
            return True
        try:
            self._engine.connect(engine, timeout_ms=_PROBE_MS)
            return True
        except HixlError as e:
            return e.status == Status.ALREADY_CONNECTED

    def _forget_from_peer(self, name: str, peer: str) -> None:
        """An ``I`` request: forgets agent `name` once its engine no longer answers (its
        invalidate_local_metadata comes just before it closes). Anyone can send one, so an
        agent whose engine is still alive after the listen thread's timeout is kept: else
        ``I`` then ``S`` would re-point it."""
        with self._lock:
            r = self._remotes.get(name)
        if r is None:
            return
        assert self._listener is not None
        deadline = time.monotonic() + self._listener.timeout_s
        while self._answers(r.engine):
            if time.monotonic() >= deadline or self._closed:
                log.warning(
                    "hixl.nixl agent %s: invalidation of agent %r from %s refused: its engine "
                    "%s still answers (remove_remote_agent forgets it)",
                    self.name,
                    name,
                    peer,
                    r.engine,
                )
                return
            time.sleep(0.1)
        with self._lock:
            same = self._remotes.get(name) is r
        if same:
            try:
                self.remove_remote_agent(name)
            except nixlNotFoundError:
                pass  # removed meanwhile

    @staticmethod
    def _peer(ip_addr: str, what: str) -> None:
        if not ip_addr:
            raise nixlNotSupportedError(
                f"{what}: a central metadata server (etcd) is not supported by hixl; give the "
                "peer's ip_addr and port"
            )

    def _async(self, what: str, fn: Any) -> None:
        def run() -> None:
            try:
                fn()
            except Exception as e:
                log.warning("hixl.nixl agent %s: %s failed: %s", self.name, what, e)

        t = _place.thread(run, name="hixl-nixl-md")
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer(ip_addr, "send_local_metadata")
        md = self.get_agent_metadata()
        self._async(
            f"sending metadata to {ip_addr}:{port}",
            lambda: _meta.request(ip_addr, port, b"S", md, False, self._side_key),
        )

    def send_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: Any = None,
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        self._peer(ip_addr, "send_partial_agent_metadata")
        md = self.get_partial_agent_metadata(descs, inc_conn_info, backends)
        self._async(
            f"sending partial metadata to {ip_addr}:{port}",
            lambda: _meta.request(ip_addr, port, b"S", md, False, self._side_key),
        )

    def fetch_remote_metadata(
        self, remote_agent: Any, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        name = _name(remote_agent)
        self._peer(ip_addr, "fetch_remote_metadata")

        def fetch() -> None:
            try:
                most = self._wire_max_regions
                reply = _meta.request(
                    ip_addr, port, b"F", name.encode(), True, self._side_key, most
                )
                assert reply is not None
                kind, payload = reply
                if kind != b"M":
                    raise ConnectionError(repr(payload.decode(errors="replace")))
                got = _meta.decode(payload, most)["name"]
                if got != name:
                    raise nixlInvalidParamError(f"asked for agent {name!r}, {got!r} answered")
                self._add_remote(payload, False, most)
            except Exception as e:
                self._fetch_errors[name] = str(e)
                raise

        self._async(f"fetching {name!r}'s metadata from {ip_addr}:{port}", fetch)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer(ip_addr, "invalidate_local_metadata")
        me = self.name.encode()
        self._async(
            f"invalidating metadata at {ip_addr}:{port}",
            lambda: _meta.request(ip_addr, port, b"I", me, False, self._side_key),
        )

    def check_remote_metadata(self, agent: Any, descs: Any = None) -> bool:
        name = _name(agent)
        with self._lock:
            r = self._remotes.get(name)
        if r is None:
            return name == self.name
        if descs is None:
            return True
        d = self.get_xfer_descs(descs, "DRAM")
        return _first_outside(d.arr[:, 0], d.arr[:, 1], r.starts, r.ends) < 0
