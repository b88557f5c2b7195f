"""NIXL's Python agent API (``nixl._api``: ``nixl_agent``, ``nixl_agent_config``) on hixl.

Each ``nixl_agent`` owns one hixl engine (``hixl.Hixl``) listening on ``HIXL_NIXL_LISTEN``
(default ``127.0.0.1:0``; Ray's node IP inside Ray). Agent metadata names that engine;
``add_remote_agent`` connects to it in the background, and the first transfer or notification
waits for the link. Transfers are one batched ``transfer_async`` call each, with the
descriptors as one ``(N, 3)`` ``uint64`` array; notifications are hixl notifications named
``"nixl:" + sender``. What is implemented, accepted and ignored, or refused: https://github.com/hixl/hixl/blob/main/docs/NIXL.md.

This module holds the agent's configuration, its lifetime (engine, listen thread, close) and its
plugins and backends; the rest of ``nixl_agent`` comes from one module per responsibility:
``_memory`` (descriptor lists, memory registration), ``_metadata`` (metadata, remote agents,
the side channel), ``_xfer`` (transfers and their handles) and ``_notifs`` (notifications),
with what they share in ``_common``. Every name this module held before that split is still
importable from it (the ``nixl._api`` shim star-imports it).
"""

from __future__ import annotations

# Besides what it uses, this module re-exports (``import x as x``) every name it held before
# the agent was split into the modules named above: the ``nixl._api`` shim star-imports it,
# and programs may import any of them from here.
import atexit
import logging as logging
import os
import threading
import time as time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt  # noqa: F401  (re-exported, as before the split)

from .. import _raynode
from .._errors import HixlError, Status
from .._errors import NotConnected as NotConnected
from .._hixl import AsyncConnectStatus as AsyncConnectStatus
from .._hixl import Hixl
from .._hixl import MemDesc as MemDesc
from .._hixl import MemHandle as MemHandle
from .._hixl import NotifyDesc as NotifyDesc
from .._hixl import TransferOp as TransferOp
from .._hixl import TransferReq as TransferReq
from .._hixl import TransferStatus as TransferStatus
from .._kvcore._notify import Budget, Router
from . import _auth, _meta
from ._bindings import (
    DEFAULT_COMM_PORT,
    DRAM_SEG,
    VRAM_SEG,
    from_hixl,
    mem_seg,
    nixlBackendError,
    nixlInvalidParamError,
    nixlNotFoundError,
)
from ._bindings import MEM_NAMES as MEM_NAMES
from ._bindings import NIXL_INIT_AGENT as NIXL_INIT_AGENT
from ._bindings import nixlNotPostedError as nixlNotPostedError
from ._bindings import nixlNotSupportedError as nixlNotSupportedError
from ._bindings import nixlRegDList as nixlRegDList
from ._bindings import nixlRemoteDisconnectError as nixlRemoteDisconnectError
from ._bindings import nixlRemoteDList as nixlRemoteDList
from ._bindings import nixlRepostActiveError as nixlRepostActiveError
from ._bindings import nixlXferDList as nixlXferDList
from ._bindings import nixlXferTelemetry as nixlXferTelemetry
from ._common import _CONNECT_WAIT_S as _CONNECT_WAIT_S
from ._common import _NOTIF_PREFIX, _OPS, NETWORK_BACKENDS, REFUSED_BACKENDS, _name, log
from ._common import U64 as U64
from ._common import _first_outside as _first_outside
from ._common import _msg as _msg
from ._memory import _buffer_desc as _buffer_desc
from ._memory import _deserialize as _deserialize
from ._memory import _is_buffer as _is_buffer
from ._memory import _is_tensor as _is_tensor
from ._memory import _Region as _Region
from ._memory import _serialize as _serialize
from ._memory import _tensor_desc as _tensor_desc
from ._metadata import _Remote as _Remote
from ._notifs import _Notifs
from ._xfer import _Transfers
from ._xfer import nixl_prepped_dlist_handle as nixl_prepped_dlist_handle
from ._xfer import nixl_xfer_handle as nixl_xfer_handle

# How long a link stays up after remove_remote_agent, unused, for the agent to be added again.
LINK_IDLE_S = 60.0

# Agents not closed yet; closed at interpreter exit, before daemon threads are stopped.
_OPEN: weakref.WeakSet[nixl_agent] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for a in list(_OPEN):
        try:
            a.close()
        except Exception:
            pass


def _idle_seconds(v: Any) -> float:
    """hixl_link_idle_s checked: seconds in [0, 1e6] (0: close at remove_remote_agent)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e6:
        raise nixlInvalidParamError(
            f"hixl_link_idle_s must be a number of seconds in [0, 1e6], not {v!r}"
        )
    return float(v)


def _default_listen() -> str:
    """Where an agent's engine listens unless told: Ray's node IP inside a Ray worker or
    driver (ray imported and initialized here), so agents on other nodes reach it; else
    loopback."""
    ip = _raynode.ray_node_ip()
    return f"{_raynode.listen_host(ip)}:0" if ip else "127.0.0.1:0"


class nixl_agent_config:
    """Agent settings, as NIXL names them; the ``hixl_*`` keywords are hixl's own.

    ``enable_prog_thread``, ``num_threads`` and ``capture_telemetry`` are accepted and ignored
    (hixl's engine always progresses on its own threads, and telemetry is always kept).
    ``sync_mode`` is accepted and ignored (every agent call is thread-safe). ``listen_port`` is
    the listen thread's port (NIXL's default 8888); 0 lets the OS choose, and the chosen one is
    ``agent.listen_port``. ``hixl_listen`` ("ip:port") is where the hixl engine listens
    (default ``$HIXL_NIXL_LISTEN``, else Ray's node IP inside a Ray worker or driver, else
    ``127.0.0.1:0``), ``hixl_options`` are engine options. ``hixl_link_idle_s`` (default 60)
    is how long the link to a removed agent's engine stays up unused, so that adding the agent
    again (Ray's NIXL transport does so for every object) reuses it; 0 closes it at once.
    The listen thread binds ``hixl_listen_thread_ip`` (default: the engine's IP; ``"0.0.0.0"``
    for every interface, as NIXL's does), serves at most ``hixl_listen_thread_max_conns``
    connections at once (default 16) and gives each ``hixl_listen_thread_timeout_s`` seconds
    (default 5) to send its whole request. Metadata from the wire (the listen thread's ``S``
    requests, ``fetch_remote_metadata``'s replies) may name at most
    ``hixl_listen_thread_max_regions`` regions (default 4096; a longer frame is refused from its
    header), and at most ``hixl_listen_thread_max_agents`` agents (default 64) are loaded from
    the listen thread at once (``S`` for a new one over it is refused and logged). With a
    cluster secret (``hixl.secret`` in ``hixl_options`` or ``HIXL_SECRET``) the listen thread
    and the side-channel calls prove it to each other before any request
    (https://github.com/hixl/hixl/blob/main/docs/NIXL.md).
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: Any = False,
        num_threads: int = 0,
        backends: Sequence[str] | None = None,
        sync_mode: Any = None,
        *,
        hixl_listen: str | None = None,
        hixl_options: Mapping[str, str | int | bool] | None = None,
        hixl_listen_thread_ip: str | None = None,
        hixl_listen_thread_max_conns: int = _meta.MAX_CONNS,
        hixl_listen_thread_timeout_s: float = _meta.IO_TIMEOUT_S,
        hixl_listen_thread_max_agents: int = _meta.MAX_AGENTS,
        hixl_listen_thread_max_regions: int = _meta.MAX_REGIONS,
        hixl_link_idle_s: float = LINK_IDLE_S,
    ) -> None:
        if isinstance(capture_telemetry, (list, tuple)):  # older NIXL order: (..., backends)
            backends, capture_telemetry = capture_telemetry, False
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = bool(enable_prog_thread)
        self.enable_listen = bool(enable_listen_thread)
        self.port = int(listen_port)
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = int(num_threads)
        self.sync_mode = sync_mode
        self.hixl_listen = hixl_listen
        self.hixl_options = dict(hixl_options or {})
        self.hixl_listen_thread_ip = hixl_listen_thread_ip
        self.hixl_listen_thread_max_conns = hixl_listen_thread_max_conns
        self.hixl_listen_thread_timeout_s = hixl_listen_thread_timeout_s
        self.hixl_listen_thread_max_agents = hixl_listen_thread_max_agents
        self.hixl_listen_thread_max_regions = hixl_listen_thread_max_regions
        self.hixl_link_idle_s = hixl_link_idle_s


class nixl_agent(_Transfers, _Notifs):
    """A NIXL agent backed by one hixl engine. The coverage table: https://github.com/hixl/hixl/blob/main/docs/NIXL.md."""

    def __init__(
        self,
        agent_name: str,
        nixl_conf: nixl_agent_config | None = None,
        instantiate_all: bool = False,
    ) -> None:
        name = _name(agent_name)
        if not name or len(name.encode()) > 1024 - len(_NOTIF_PREFIX):
            raise nixlInvalidParamError(f"agent name must be 1..1019 bytes, not {name!r}")
        if nixl_conf is not None and instantiate_all:
            log.warning("instantiate_all ignored: a config was given")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        # The types of the state the parts use are declared on their classes (_AgentBase, ...).
        self.name = name
        self.config = conf
        self.ignored: list[str] = []
        self.notifs = {}
        self.backends = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = list(NETWORK_BACKENDS)
        self.nixl_mems = {k: mem_seg(k) for k in ("DRAM", "VRAM", "FILE", "BLOCK", "OBJ")}
        self.nixl_mems.update(cpu=DRAM_SEG, cuda=VRAM_SEG)
        self.nixl_ops = dict(_OPS)
        self._lock = threading.RLock()
        self._regs = {}
        self._lstarts = np.zeros(0, np.uint64)
        self._lends = np.zeros(0, np.uint64)
        self._remotes = {}
        self._wire_agents = set()
        self._wire_max_agents = _meta.check_count(
            "hixl_listen_thread_max_agents", conf.hixl_listen_thread_max_agents, 1 << 20
        )
        self._wire_max_regions = _meta.check_count(
            "hixl_listen_thread_max_regions",
            conf.hixl_listen_thread_max_regions,
            _meta.ENGINE_MAX_REGIONS,
        )
        self._fetch_errors = {}
        self._link_idle_s = _idle_seconds(conf.hixl_link_idle_s)
        self._idle = {}
        self._reaper = None
        self._reaper_wake = threading.Event()
        self._linked_engines = set()
        self._rate = {}
        self._notif_name = _NOTIF_PREFIX + name
        self._listener: _meta.Listener | None = None
        self._threads = []
        self._closed = False

        if not conf.enable_pthread:
            self._ignore("enable_prog_thread=False (hixl always progresses on its own threads)")
        if conf.sync_mode is not None:
            self._ignore(f"sync_mode={conf.sync_mode!r} (every call is thread-safe)")
        if conf.num_threads:
            self._ignore(f"num_threads={conf.num_threads} (set hixl options instead)")
        wanted = list(self.plugin_list) if instantiate_all else list(conf.backends)
        mapped = [NETWORK_BACKENDS[b] for b in wanted if b in NETWORK_BACKENDS]
        options: dict[str, str | int | bool] = {"hixl.backends": mapped[0] if mapped else "auto"}
        options.update(conf.hixl_options)
        listen = conf.hixl_listen or os.environ.get("HIXL_NIXL_LISTEN") or _default_listen()
        self._engine = Hixl()
        try:
            self._engine.initialize(listen, options)
        except HixlError as e:
            raise from_hixl(e, f"agent {name!r}: starting its hixl engine on {listen}") from e
        self._addr = self._engine.local_engine
        secret = _auth.cluster_secret(options, os.environ)
        self._side_key = _auth.Key(secret) if secret else None
        self._router = Router(self._engine, log, Budget.of(options))
        self._notes_lock = threading.Lock()
        for b in wanted:
            if b in NETWORK_BACKENDS:
                self.create_backend(b)
            else:
                why = REFUSED_BACKENDS.get(b, "not a NIXL plugin hixl knows")
                self._ignore(f"backend {b!r} skipped: {why} is not provided by hixl")
        if conf.enable_listen:
            host = conf.hixl_listen_thread_ip or _meta.bind_host(self._addr)
            try:
                self._listener = _meta.Listener(
                    host,
                    conf.port,
                    self.get_agent_metadata,
                    self._load_from_peer,
                    self._forget_from_peer,
                    conf.hixl_listen_thread_max_conns,
                    conf.hixl_listen_thread_timeout_s,
                    self._wire_max_regions,
                    self._side_key,
                )
            except OSError as e:
                self._engine.finalize()
                msg = f"listen thread: cannot listen on {host} port {conf.port}: {e}"
                raise nixlBackendError(msg) from e
            except Exception:
                self._engine.finalize()
                raise
        _OPEN.add(self)
        log.info("hixl.nixl agent %s: engine %s", name, self._addr)

    # --- lifetime -----------------------------------------------------------------------

    def _ignore(self, what: str) -> None:
        self.ignored.append(what)
        log.warning("hixl.nixl agent %s: %s", self.name, what)

    @property
    def listen_port(self) -> int | None:
        """The port of the listen thread (hixl extension), or None without one."""
        return self._listener.port if self._listener else None

    @property
    def engine(self) -> Hixl:
        """The hixl engine behind this agent (hixl extension)."""
        return self._engine

    def close(self) -> None:
        """Stops the listen thread and the engine (hixl extension; idempotent). Waits first for
        this agent's background metadata requests: a thread still inside the engine when the
        interpreter exits can abort the process. Agents still open at exit are closed then."""
        if self._closed:
            return
        self._closed = True
        self._reaper_wake.set()
        _OPEN.discard(self)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            pending = list(self._threads)
        for t in pending:
            t.join(timeout=_meta.IO_TIMEOUT_S + 5.0)
        self._engine.finalize()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # --- plugins and backends -------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend in NETWORK_BACKENDS:
            return ["DRAM_SEG"]
        log.warning("Plugin %s is not available to get its supported mem types.", backend)
        return []

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend in NETWORK_BACKENDS:
            return {"hixl.backends": NETWORK_BACKENDS[backend]}
        log.warning("Plugin %s is not available to get its parameters.", backend)
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend in self.backend_mems:
            return list(self.backend_mems[backend])
        log.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend in self.backend_options:
            return dict(self.backend_options[backend])
        log.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: Mapping[str, Any] | None = None) -> None:  # noqa: N803
        if backend not in NETWORK_BACKENDS:
            if backend in REFUSED_BACKENDS:
                raise nixlNotFoundError(
                    f"backend {backend!r} ({REFUSED_BACKENDS[backend]}) is not provided by hixl",
                    Status.UNSUPPORTED,
                )
            raise nixlNotFoundError(
                f"no plugin named {backend!r}; hixl provides {', '.join(NETWORK_BACKENDS)}"
            )
        for k, v in (initParams or {}).items():
            self._ignore(f"backend {backend} parameter {k}={v!r} ignored")
        want = NETWORK_BACKENDS[backend]
        if self.backends:
            first = next(iter(self.backends))
            if NETWORK_BACKENDS[first] != want:
                self._ignore(
                    f"backend {backend}: the engine already carries data over "
                    f"{NETWORK_BACKENDS[first]!r} (from {first}); {want!r} not applied"
                )
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = ["DRAM_SEG"]
        self.backend_options[backend] = {"hixl.backends": want, "hixl.engine": self._addr}
