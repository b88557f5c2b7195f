"""NIXL's Python agent API (``nixl._api``: ``nixl_agent``, ``nixl_agent_config``) on hixl.

Each ``nixl_agent`` owns one hixl engine (``hixl.Hixl``) listening on ``HIXL_NIXL_LISTEN``
(default ``127.0.0.1:0``). Agent metadata names that engine; ``add_remote_agent`` connects to
it in the background, and the first transfer or notification waits for the link. Transfers are
one batched ``transfer_async`` call each, with the descriptors as one ``(N, 3)`` ``uint64``
array; notifications are hixl notifications named ``"nixl:" + sender``. docs/NIXL.md lists what
is implemented, accepted and ignored, or refused.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from .._errors import HixlError, NotConnected, Status
from .._hixl import (
    AsyncConnectStatus,
    Hixl,
    MemDesc,
    MemHandle,
    NotifyDesc,
    TransferOp,
    TransferReq,
    TransferStatus,
)
from . import _meta
from ._bindings import (
    DEFAULT_COMM_PORT,
    DRAM_SEG,
    MEM_NAMES,
    NIXL_INIT_AGENT,
    VRAM_SEG,
    from_hixl,
    mem_seg,
    nixlBackendError,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRemoteDList,
    nixlRepostActiveError,
    nixlXferDList,
    nixlXferTelemetry,
)
from ._bindings import deserialize as _deserialize
from ._bindings import serialize as _serialize

log = logging.getLogger("hixl.nixl")

U64 = npt.NDArray[np.uint64]

# NIXL plugin name -> the hixl backends (option hixl.backends) it stands for.
NETWORK_BACKENDS = {
    "UCX": "auto",
    "UCX_MO": "auto",
    "LIBFABRIC": "auto",
    "UCCL": "auto",
    "Mooncake": "auto",
    "HIXL": "auto",
    "HIXL_TCP": "tcp",
    "HIXL_SHM": "self,shm",
}
# NIXL plugins hixl does not provide (storage, GPU-initiated): refused with a clear error.
REFUSED_BACKENDS = {
    "GDS": "GPUDirect Storage",
    "GDS_MT": "GPUDirect Storage",
    "POSIX": "file storage",
    "OBJ": "object storage",
    "HF3FS": "3FS storage",
    "GUSLI": "block storage",
    "INFINIA": "object storage",
    "AZURE_BLOB": "object storage",
    "GPUNETIO": "GPU-initiated networking (device memory)",
}
_OPS = {"WRITE": TransferOp.WRITE, "READ": TransferOp.READ}
_NOTIF_PREFIX = "nixl:"
_CONNECT_WAIT_S = 10.0


# Agents not closed yet; closed at interpreter exit, before daemon threads are stopped.
_OPEN: weakref.WeakSet[nixl_agent] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for a in list(_OPEN):
        try:
            a.close()
        except Exception:
            pass


def _name(agent: Any) -> str:
    """An agent name given as str or bytes (NIXL returns bytes from add_remote_agent)."""
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if isinstance(agent, str):
        return agent
    raise nixlInvalidParamError(f"agent name must be str or bytes, not {type(agent).__name__}")


def _msg(m: Any) -> bytes:
    if m is None:
        return b""
    if isinstance(m, str):
        return m.encode()
    if isinstance(m, (bytes, bytearray, memoryview)):
        return bytes(m)
    raise nixlInvalidParamError(f"notification must be bytes or str, not {type(m).__name__}")


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_desc(t: Any) -> tuple[int, int, int, int]:
    """(addr, len, dev, segment) of a torch tensor, without importing torch."""
    if not t.is_contiguous():
        raise nixlInvalidParamError("tensors must be contiguous")
    dev = str(t.device)
    seg = VRAM_SEG if dev.startswith("cuda") else DRAM_SEG
    gpu = t.get_device()
    return int(t.data_ptr()), int(t.numel() * t.element_size()), max(int(gpu), 0), seg


def _buffer_desc(obj: Any) -> tuple[int, int]:
    """(addr, len) of a numpy array or other buffer."""
    arr = obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, np.uint8)
    if not arr.flags.c_contiguous:
        raise nixlInvalidParamError("arrays must be C-contiguous")
    return int(arr.ctypes.data), int(arr.nbytes)


def _is_buffer(obj: Any) -> bool:
    if isinstance(obj, np.ndarray):
        return True
    try:
        memoryview(obj)
    except TypeError:
        return False
    return not isinstance(obj, (bytes, str))


def _first_outside(addrs: U64, lens: U64, starts: U64, ends: U64) -> int:
    """Index of the first range [addr, addr+len) not inside one region, or -1."""
    n = addrs.shape[0]
    if n == 0:
        return -1
    if starts.shape[0] == 0:
        return 0
    idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    ok = idx >= 0
    ok &= (addrs + lens) <= ends[np.maximum(idx, 0)]
    if ok.all():
        return -1
    return int(np.argmin(ok))


class nixl_agent_config:
    """Agent settings, as NIXL names them; the ``hixl_*`` keywords are hixl's own.

    ``enable_prog_thread``, ``num_threads`` and ``capture_telemetry`` are accepted and ignored
    (hixl's engine always progresses on its own threads, and telemetry is always kept).
    ``sync_mode`` is accepted and ignored (every agent call is thread-safe). ``listen_port`` is
    the listen thread's port (NIXL's default 8888); 0 lets the OS choose, and the chosen one is
    ``agent.listen_port``. ``hixl_listen`` ("ip:port") is where the hixl engine listens
    (default ``$HIXL_NIXL_LISTEN`` or ``127.0.0.1:0``), ``hixl_options`` are engine options.
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
        hixl_options: dict[str, str | int | bool] | None = None,
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


class _Region:
    __slots__ = ("handle", "refs", "parent")

    def __init__(self, handle: MemHandle | None, parent: tuple[int, int] | None) -> None:
        self.handle, self.refs, self.parent = handle, 1, parent


class _Remote:
    __slots__ = ("name", "engine", "starts", "ends", "ready")

    def __init__(self, name: str, engine: str, regions: list[list[int]]) -> None:
        self.name, self.engine, self.ready = name, engine, False
        self.starts = np.zeros(0, np.uint64)
        self.ends = np.zeros(0, np.uint64)
        self.add_regions(regions)

    def add_regions(self, regions: list[list[int]] | list[tuple[int, int]]) -> None:
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
        self.starts, self.ends = starts[keep], ends[keep]


class nixl_prepped_dlist_handle:
    """A descriptor list prepared by ``prep_xfer_dlist`` (local, remote or loopback)."""

    __slots__ = ("_agent", "remote", "addrs", "lens", "_released")

    def __init__(self, agent: nixl_agent, remote: str | None, addrs: U64, lens: U64) -> None:
        self._agent, self.remote, self.addrs, self.lens = agent, remote, addrs, lens
        self._released = False

    @property
    def count(self) -> int:
        """Descriptors in the list (no __len__: an empty list's handle must stay truthy)."""
        return int(self.addrs.shape[0])

    def release(self) -> None:
        self._released = True

    def __repr__(self) -> str:
        side = "local" if self.remote is None else f"remote {self.remote!r}"
        n = self.count
        return f"nixl_prepped_dlist_handle({side}, {n} descriptors, released={self._released})"


class nixl_xfer_handle:
    """A transfer request from ``initialize_xfer`` or ``make_prepped_xfer``."""

    __slots__ = (
        "_agent",
        "op",
        "remote",
        "descs",
        "notif",
        "req",
        "error",
        "_post_ns",
        "_posted_ns",
        "_done_ns",
        "_start_us",
        "_released",
        "__weakref__",
    )

    def __init__(
        self, agent: nixl_agent, op: TransferOp, remote: str, descs: U64, notif: bytes
    ) -> None:
        self._agent, self.op, self.remote, self.descs, self.notif = agent, op, remote, descs, notif
        self.req: TransferReq | None = None
        self.error: str | None = None
        self._post_ns = self._posted_ns = self._done_ns = 0
        self._start_us = 0
        self._released = False

    @property
    def nbytes(self) -> int:
        return int(self.descs[:, 2].sum()) if self.descs.shape[0] else 0

    def release(self) -> None:
        self._agent.release_xfer_handle(self)

    def __repr__(self) -> str:
        return (
            f"nixl_xfer_handle({self.op!r} {self.remote!r}, {self.descs.shape[0]} descriptors, "
            f"released={self._released})"
        )


class nixl_agent:
    """A NIXL agent backed by one hixl engine. See docs/NIXL.md for the coverage table."""

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
        self.name = name
        self.config = conf
        self.ignored: list[str] = []
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = list(NETWORK_BACKENDS)
        self.nixl_mems = {k: mem_seg(k) for k in ("DRAM", "VRAM", "FILE", "BLOCK", "OBJ")}
        self.nixl_mems.update(cpu=DRAM_SEG, cuda=VRAM_SEG)
        self.nixl_ops = dict(_OPS)
        self._lock = threading.RLock()
        self._regs: dict[tuple[int, int], _Region] = {}
        self._lstarts = np.zeros(0, np.uint64)
        self._lends = np.zeros(0, np.uint64)
        self._remotes: dict[str, _Remote] = {}
        self._fetch_errors: dict[str, str] = {}
        self._rate: dict[str, float] = {}  # bytes per microsecond, per remote agent
        self._notif_name = _NOTIF_PREFIX + name
        self._listener: _meta.Listener | None = None
        self._threads: list[threading.Thread] = []
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
        listen = conf.hixl_listen or os.environ.get("HIXL_NIXL_LISTEN") or "127.0.0.1:0"
        self._engine = Hixl()
        try:
            self._engine.initialize(listen, options)
        except HixlError as e:
            raise from_hixl(e, f"agent {name!r}: starting its hixl engine on {listen}") from e
        self._addr = self._engine.local_engine
        for b in wanted:
            if b in NETWORK_BACKENDS:
                self.create_backend(b)
            else:
                why = REFUSED_BACKENDS.get(b, "not a NIXL plugin hixl knows")
                self._ignore(f"backend {b!r} skipped: {why} is not provided by hixl")
        if conf.enable_listen:
            try:
                self._listener = _meta.Listener(
                    conf.port, self.get_agent_metadata, self._load_from_peer, self._forget
                )
            except OSError as e:
                self._engine.finalize()
                msg = f"listen thread: cannot listen on port {conf.port}: {e}"
                raise nixlBackendError(msg) from e
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

    def create_backend(self, backend: str, initParams: dict[str, str] | None = None) -> None:  # noqa: N803
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

    # --- descriptors ----------------------------------------------------------------------

    def _descs(self, descs: Any, mem_type: str | None, reg: bool) -> Any:
        width = 4 if reg else 3
        cls = nixlRegDList if reg else nixlXferDList
        other = nixlXferDList if reg else nixlRegDList
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            raise nixlInvalidParamError(
                f"{type(descs).__name__} given where a {cls.__name__} is needed"
                + (" (use trim() on a registration list)" if not reg else "")
            )
        objs: list[Any] | None = None
        if isinstance(descs, np.ndarray) and mem_type is not None and descs.ndim == 2:
            if descs.shape[1] != 3 or descs.dtype.kind not in "iu":
                raise nixlInvalidParamError("Nx3 integer array required for a descriptor list")
            out = cls(mem_type, descs)
        elif _is_tensor(descs) or _is_buffer(descs):
            out, objs = self._from_buffers([descs], cls)
        elif isinstance(descs, (list, tuple)):
            if len(descs) == 0:
                return cls(mem_type or "DRAM")
            first = descs[0]
            if isinstance(first, tuple) or (isinstance(first, list) and not _is_buffer(first)):
                if mem_type is None:
                    raise nixlInvalidParamError("a memory type is needed for a list of tuples")
                if len(first) != width:
                    raise nixlInvalidParamError(
                        f"{width}-tuples needed for a {'registration' if reg else 'transfer'} list"
                    )
                out = cls(mem_type, descs)
            elif _is_tensor(first) or _is_buffer(first):
                out, objs = self._from_buffers(list(descs), cls)
            else:
                raise nixlInvalidParamError(f"cannot make descriptors of {type(first).__name__}")
        else:
            raise nixlInvalidParamError(f"cannot make descriptors of {type(descs).__name__}")
        if objs is not None:
            out._hixl_objs = objs  # kept alive by the registration
        return out

    def _from_buffers(self, objs: list[Any], cls: Any) -> tuple[Any, list[Any]]:
        rows = np.empty((len(objs), 3), np.uint64)
        seg = None
        for i, o in enumerate(objs):
            if _is_tensor(o):
                a, n, d, s = _tensor_desc(o)
            elif _is_buffer(o):
                (a, n), d, s = _buffer_desc(o), 0, DRAM_SEG
            else:
                raise nixlInvalidParamError(f"item {i}: cannot use a {type(o).__name__}")
            if seg is not None and s != seg:
                raise nixlInvalidParamError("all tensors of a list must be on one kind of device")
            seg = s
            rows[i] = (a, n, d)
        return cls(seg if seg is not None else DRAM_SEG, rows), objs

    def get_xfer_descs(
        self, descs: Any, mem_type: str | None = None, is_sorted: bool = False
    ) -> nixlXferDList:
        """A transfer descriptor list from 3-tuples (with mem_type), an Nx3 array (with
        mem_type), a tensor or array (its whole buffer), a list of them, or such a list."""
        return self._descs(descs, mem_type, reg=False)  # type: ignore[no-any-return]

    def get_reg_descs(
        self, descs: Any, mem_type: str | None = None, is_sorted: bool = False
    ) -> nixlRegDList:
        """A registration descriptor list from 4-tuples (with mem_type), an Nx3 array (with
        mem_type), a tensor or array, a list of them, or such a list."""
        return self._descs(descs, mem_type, reg=True)  # type: ignore[no-any-return]

    def get_remote_descs(self, descs: Any, mem_type: str | None = None) -> nixlRemoteDList:
        """(addr, len, dev_id, agent name) 4-tuples; only prep_mem_view takes them."""
        if isinstance(descs, nixlRemoteDList):
            return descs
        if mem_type is None:
            raise nixlInvalidParamError("a memory type is needed for a list of tuples")
        if descs and len(descs[0]) != 4:
            raise nixlInvalidParamError("4-tuples (addr, len, dev_id, agent_name) needed")
        return nixlRemoteDList(mem_type, list(descs))

    def prep_mem_view(self, dlist: Any, *, backends: Any = None) -> int:
        raise nixlNotSupportedError(
            "prep_mem_view: memory views are for device (VRAM) memory and NIXL's GPU device "
            "API; hixl has neither yet"
        )

    def release_mem_view(self, mvh: int) -> None:
        raise nixlNotSupportedError("release_mem_view: hixl makes no memory views")

    def get_serialized_descs(self, descs: Any) -> bytes:
        if not isinstance(descs, (nixlXferDList, nixlRegDList)):
            raise nixlInvalidParamError(f"cannot serialize a {type(descs).__name__}")
        return _serialize(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return _deserialize(serialized_descs)

    @staticmethod
    def _dram_only(seg: int, what: str) -> None:
        if seg == VRAM_SEG:
            raise nixlNotSupportedError(
                f"{what}: VRAM (device memory) is not supported by hixl yet; only DRAM"
            )
        if seg != DRAM_SEG:
            raise nixlNotSupportedError(
                f"{what}: {MEM_NAMES[seg]} is storage; hixl has no storage backends (DRAM only)"
            )

    # --- memory -----------------------------------------------------------------------------

    def register_memory(
        self,
        reg_list: Any,
        mem_type: str | None = None,
        backends: Any = None,
        is_sorted: Any = None,
    ) -> nixlRegDList:
        if isinstance(backends, bool):  # older NIXL order: (reg_list, mem_type, is_sorted, ...)
            backends, is_sorted = is_sorted, backends
        self._check_backends(backends)
        descs = self.get_reg_descs(reg_list, mem_type)
        self._dram_only(descs.getType(), "register_memory")
        objs = getattr(descs, "_hixl_objs", None)
        done: list[tuple[int, int]] = []
        with self._lock:
            try:
                for i in range(descs.descCount()):
                    a, n = int(descs.arr[i, 0]), int(descs.arr[i, 1])
                    if n == 0:
                        raise nixlInvalidParamError(f"descriptor {i}: length 0")
                    self._register_one(a, n, objs[i] if objs is not None else None)
                    done.append((a, n))
            except BaseException:
                for key in reversed(done):
                    self._deregister_one(key)
                raise
            finally:
                self._refresh_local()
        return descs

    def _register_one(self, a: int, n: int, obj: Any) -> None:
        key = (a, n)
        r = self._regs.get(key)
        if r is not None:
            r.refs += 1
            return
        # Inside a region registered before this call: an alias holding a reference on it.
        i = int(np.searchsorted(self._lstarts, np.uint64(a), side="right")) - 1
        if i >= 0 and a + n <= int(self._lends[i]):
            k = (int(self._lstarts[i]), int(self._lends[i]) - int(self._lstarts[i]))
            self._regs[k].refs += 1
            self._regs[key] = _Region(None, k)
            return
        try:
            if obj is not None:
                h = self._engine.register(obj)
            else:
                h = self._engine.register_mem(MemDesc(a, n))
        except HixlError as e:
            raise from_hixl(e, f"registering 0x{a:x}+{n}") from e
        self._regs[key] = _Region(h, None)

    def _deregister_one(self, key: tuple[int, int]) -> None:
        r = self._regs[key]
        r.refs -= 1
        if r.refs > 0:
            return
        del self._regs[key]
        if r.parent is not None:
            self._deregister_one(r.parent)
        elif r.handle is not None:
            try:
                self._engine.deregister_mem(r.handle)
            except HixlError as e:
                raise from_hixl(e, f"deregistering 0x{key[0]:x}+{key[1]}") from e

    def _refresh_local(self) -> None:
        keys = sorted(k for k, r in self._regs.items() if r.parent is None)
        self._lstarts = np.array([k[0] for k in keys], np.uint64)
        self._lends = np.array([k[0] + k[1] for k in keys], np.uint64)

    def deregister_memory(self, dereg_list: Any, backends: Any = None) -> None:
        descs = self.get_reg_descs(dereg_list, "DRAM")
        with self._lock:
            try:
                keys = [(int(a), int(n)) for a, n, _ in descs.arr]
                missing = [k for k in keys if k not in self._regs]
                if missing:
                    a, n = missing[0]
                    raise nixlNotFoundError(f"0x{a:x}+{n} is not registered with this agent")
                for k in keys:
                    self._deregister_one(k)
            finally:
                self._refresh_local()

    def query_memory(
        self, reg_list: Any, backend: str, mem_type: str | None = None
    ) -> list[dict[str, str] | None]:
        """DRAM has nothing to report: None for each descriptor (as NIXL's network plugins)."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available: {list(self.backends)}")
        return [None] * descs.descCount()

    def _check_backends(self, backends: Any) -> None:
        for b in backends or ():
            if b not in self.backends:
                raise KeyError(b)

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
        doc = _meta.decode(metadata)
        name: str = doc["name"]
        engine: str | None = doc.get("engine")
        connect = False
        with self._lock:
            r = self._remotes.get(name)
            if name == self.name:
                return name.encode()  # our own: loopback needs nothing loaded
            if engine is None:
                if r is None:
                    raise nixlNotFoundError(
                        f"partial metadata of agent {name!r} has no connection info and the "
                        "agent is not loaded yet"
                    )
                r.add_regions(doc["regions"])
            elif r is None or r.engine != engine or not doc.get("partial"):
                nr = _Remote(name, engine, doc["regions"] if not doc.get("partial") else [])
                if doc.get("partial"):
                    nr.add_regions(doc["regions"])
                if r is not None and r.engine == engine:
                    nr.ready = r.ready
                self._remotes[name] = nr
                connect = not nr.ready
            else:
                r.add_regions(doc["regions"])
            self._fetch_errors.pop(name, None)
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
        if r is None:
            raise nixlNotFoundError(f"remote agent {name!r} is not loaded")
        try:
            self._engine.disconnect(r.engine, timeout_ms=2000)
        except HixlError as e:
            log.info("hixl.nixl: disconnecting from %s (%s): %s", name, r.engine, e)

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
        deadline = time.monotonic() + _CONNECT_WAIT_S
        while True:
            st = self._engine.get_async_connect_status(r.engine)
            if st == AsyncConnectStatus.CONNECTED:
                r.ready = True
                return
            if st == AsyncConnectStatus.CONNECTING and time.monotonic() < deadline:
                time.sleep(0.001)
                continue
            try:
                left = max(deadline - time.monotonic(), 0.5)
                self._engine.connect(r.engine, timeout_ms=left * 1000)
                r.ready = True
                return
            except HixlError as e:
                if e.status == Status.ALREADY_CONNECTED:
                    r.ready = True
                    return
                raise from_hixl(
                    e, f"connecting to agent {r.name!r} at {r.engine}", nixlRemoteDisconnectError
                ) from e

    # --- the listen-thread side channel ---------------------------------------------------------

    def _load_from_peer(self, md: bytes) -> None:
        self.add_remote_agent(md)

    def _forget(self, name: str) -> None:
        with self._lock:
            known = name in self._remotes
        if known:
            self.remove_remote_agent(name)

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

        t = threading.Thread(target=run, name="hixl-nixl-md", daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer(ip_addr, "send_local_metadata")
        md = self.get_agent_metadata()
        self._async(
            f"sending metadata to {ip_addr}:{port}",
            lambda: _meta.request(ip_addr, port, b"S", md, False),
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
            lambda: _meta.request(ip_addr, port, b"S", md, False),
        )

    def fetch_remote_metadata(
        self, remote_agent: Any, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        name = _name(remote_agent)
        self._peer(ip_addr, "fetch_remote_metadata")

        def fetch() -> None:
            try:
                reply = _meta.request(ip_addr, port, b"F", name.encode(), True)
                assert reply is not None
                kind, payload = reply
                if kind != b"M":
                    raise ConnectionError(payload.decode(errors="replace"))
                got = _meta.decode(payload)["name"]
                if got != name:
                    raise nixlInvalidParamError(f"asked for agent {name!r}, {got!r} answered")
                self.add_remote_agent(payload)
            except Exception as e:
                self._fetch_errors[name] = str(e)
                raise

        self._async(f"fetching {name!r}'s metadata from {ip_addr}:{port}", fetch)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer(ip_addr, "invalidate_local_metadata")
        me = self.name.encode()
        self._async(
            f"invalidating metadata at {ip_addr}:{port}",
            lambda: _meta.request(ip_addr, port, b"I", me, False),
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

    # --- transfers ----------------------------------------------------------------------------

    def _check_inside(self, d: Any, r: _Remote | None, what: str) -> None:
        addrs, lens = d.arr[:, 0], d.arr[:, 1]
        if d.descCount() and not lens.all():
            raise nixlInvalidParamError(f"{what}: descriptor {int(np.argmin(lens))} has length 0")
        if r is None or r.name == self.name:
            bad = _first_outside(addrs, lens, self._lstarts, self._lends)
            where = "this agent's registered memory"
        else:
            bad = _first_outside(addrs, lens, r.starts, r.ends)
            if bad >= 0 and self._engine.get_async_connect_status(r.engine) == (
                AsyncConnectStatus.CONNECTED
            ):
                try:  # the peer may have registered more since its metadata was taken
                    table = [(x.addr, x.len) for x in self._engine.remote_regions(r.engine)]
                    r.starts = r.ends = np.zeros(0, np.uint64)
                    r.add_regions(table)  # the live table replaces what the metadata said
                except HixlError:
                    pass
                bad = _first_outside(addrs, lens, r.starts, r.ends)
            where = f"memory agent {r.name!r} registered (as its metadata says)"
        if bad >= 0:
            raise nixlNotFoundError(
                f"{what}: descriptor {bad} (0x{int(addrs[bad]):x}+{int(lens[bad])}) is not inside "
                f"{where}"
            )

    def prep_xfer_dlist(
        self,
        agent_name: Any,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: Any = None,
        is_sorted: Any = None,
    ) -> nixl_prepped_dlist_handle:
        if isinstance(backends, bool):  # older NIXL order: (..., mem_type, is_sorted, backends)
            backends, is_sorted = is_sorted, backends
        self._check_backends(backends)
        self._need_backend()
        d = self.get_xfer_descs(xfer_list, mem_type)
        self._dram_only(d.getType(), "prep_xfer_dlist")
        name = _name(agent_name)
        if name in ("NIXL_INIT_AGENT", NIXL_INIT_AGENT):
            self._check_inside(d, None, "prep_xfer_dlist (local)")
            remote = None
        else:
            r = self._remote(name)
            self._check_inside(d, r, f"prep_xfer_dlist ({name!r})")
            remote = name
        addrs = np.ascontiguousarray(d.arr[:, 0])
        lens = np.ascontiguousarray(d.arr[:, 1])
        return nixl_prepped_dlist_handle(self, remote, addrs, lens)

    def _need_backend(self) -> None:
        if not self.backends:
            raise nixlNotFoundError("no backend was created on this agent (create_backend)")

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Any,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Any,
        notif_msg: Any = b"",
        backends: Any = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        loc, rem = local_xfer_side, remote_xfer_side
        for h, side in ((loc, "local"), (rem, "remote")):
            if not isinstance(h, nixl_prepped_dlist_handle) or h._agent is not self:
                raise nixlInvalidParamError(f"{side} side is not a list prepared by this agent")
            if h._released:
                raise nixlInvalidParamError(f"{side} side list was released")
        if loc.remote is not None:
            raise nixlInvalidParamError("local side must be prepared with NIXL_INIT_AGENT")
        if rem.remote is None:
            raise nixlInvalidParamError("remote side must be prepared with a remote agent's name")
        li = np.asarray(local_indices, dtype=np.int64).reshape(-1)
        ri = np.asarray(remote_indices, dtype=np.int64).reshape(-1)
        if li.shape[0] != ri.shape[0]:
            raise nixlInvalidParamError(
                f"{li.shape[0]} local and {ri.shape[0]} remote indices: counts differ"
            )
        for idx, h, side in ((li, loc, "local"), (ri, rem, "remote")):
            if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= h.count):
                raise nixlInvalidParamError(
                    f"{side} index out of range (list has {h.count} descriptors)"
                )
        lens = loc.lens[li]
        rlens = rem.lens[ri]
        if not np.array_equal(lens, rlens):
            i = int(np.argmax(lens != rlens))
            raise nixlInvalidParamError(
                f"descriptor {i}: local length {int(lens[i])} != remote length {int(rlens[i])}"
            )
        descs = np.empty((li.shape[0], 3), np.uint64)
        descs[:, 0] = loc.addrs[li]
        descs[:, 1] = rem.addrs[ri]
        descs[:, 2] = lens
        return nixl_xfer_handle(self, op, rem.remote, descs, _msg(notif_msg))

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: Any,
        notif_msg: Any = b"",
        backends: Any = None,
    ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        self._need_backend()
        loc = self.get_xfer_descs(local_descs, "DRAM")
        rem = self.get_xfer_descs(remote_descs, "DRAM")
        self._dram_only(loc.getType(), "initialize_xfer (local)")
        self._dram_only(rem.getType(), "initialize_xfer (remote)")
        if loc.descCount() != rem.descCount():
            raise nixlInvalidParamError(
                f"{loc.descCount()} local and {rem.descCount()} remote descriptors: counts differ"
            )
        name = _name(remote_agent)
        r = self._remote(name)
        self._check_inside(loc, None, "initialize_xfer (local)")
        self._check_inside(rem, r, f"initialize_xfer ({name!r})")
        if not np.array_equal(loc.arr[:, 1], rem.arr[:, 1]):
            i = int(np.argmax(loc.arr[:, 1] != rem.arr[:, 1]))
            raise nixlInvalidParamError(
                f"descriptor {i}: local length {int(loc.arr[i, 1])} != remote length "
                f"{int(rem.arr[i, 1])}"
            )
        descs = np.empty((loc.descCount(), 3), np.uint64)
        descs[:, 0] = loc.arr[:, 0]
        descs[:, 1] = rem.arr[:, 0]
        descs[:, 2] = loc.arr[:, 1]
        return nixl_xfer_handle(self, op, name, descs, _msg(notif_msg))

    def _live(self, handle: Any) -> nixl_xfer_handle:
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a transfer handle of this agent")
        if handle._released:
            raise nixlInvalidParamError("the transfer handle was released")
        return handle

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        h = self._live(handle)
        if h.req is not None and h.req.status() == TransferStatus.WAITING:
            raise nixlRepostActiveError("the transfer is still in progress")
        msg = _msg(notif_msg)
        if msg:
            h.notif = msg
        r = self._remote(h.remote)
        self._ready(r)
        notify = NotifyDesc(self._notif_name, h.notif.decode("latin-1")) if h.notif else None
        h.error, h._done_ns = None, 0
        h._start_us = time.time_ns() // 1000
        h._post_ns = time.perf_counter_ns()
        try:
            if h.descs.shape[0] == 0:
                if notify is not None:
                    self._engine.send_notify(r.engine, notify)
                h.req = None
                h._posted_ns = h._done_ns = time.perf_counter_ns()
                return "DONE"
            h.req = self._engine.transfer_async(r.engine, h.op, h.descs, notify=notify)
        except HixlError as e:
            h.error = str(e)
            if isinstance(e, NotConnected):
                r.ready = False
            raise from_hixl(e, f"posting a {h.descs.shape[0]}-descriptor transfer") from e
        h._posted_ns = time.perf_counter_ns()
        return self._state(h)

    def _state(self, h: nixl_xfer_handle) -> str:
        req = h.req
        if req is None:
            if h._done_ns:
                return "DONE"
            raise nixlNotPostedError("the transfer was not posted (call transfer first)")
        st = req.status()
        if st == TransferStatus.WAITING:
            return "PROC"
        if st == TransferStatus.COMPLETED:
            if not h._done_ns:
                h._done_ns = time.perf_counter_ns()
                us = max((h._done_ns - h._post_ns) / 1000, 1.0)
                self._rate[h.remote] = h.nbytes / us
            return "DONE"
        if h.error is None:
            try:
                req.result()
                h.error = f"transfer {st}"
            except HixlError as e:
                h.error = str(e)
                if isinstance(e, NotConnected):
                    rr = self._remotes.get(h.remote)
                    if rr is not None:
                        rr.ready = False
            log.warning(
                "hixl.nixl agent %s: transfer to %s failed: %s", self.name, h.remote, h.error
            )
        return "ERR"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        return self._state(self._live(handle))

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        h = self._live(handle)
        if not h._post_ns:
            from ._bindings import nixlNoTelemetryError

            raise nixlNoTelemetryError("the transfer was not posted yet")
        end = h._done_ns or time.perf_counter_ns()
        return nixlXferTelemetry(
            h._start_us,
            (h._posted_ns - h._post_ns) // 1000,
            (end - h._post_ns) // 1000,
            h.nbytes,
            int(h.descs.shape[0]),
        )

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """(duration us, error margin us, method) from the rate last measured to that agent;
        1 GB/s with a 100 % margin before any transfer completed."""
        h = self._live(req_handle)
        rate = self._rate.get(h.remote)
        if rate is None:
            d = h.nbytes // 1000 + 1
            return d, d, "ANALYTICAL_BACKEND"
        d = int(h.nbytes / rate) + 1
        return d, d // 5 + 1, "ANALYTICAL_BACKEND"

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        self._live(handle)
        self._need_backend()
        return next(iter(self.backends))

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Frees the handle. hixl cannot cancel a posted request: one still in progress is
        waited for (up to its deadline) first."""
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a transfer handle of this agent")
        if handle._released:
            return
        if handle.req is not None and handle.req.status() == TransferStatus.WAITING:
            handle.req.wait()
        handle._released = True
        handle.req = None

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a prepared list of this agent")
        handle.release()

    # --- notifications --------------------------------------------------------------------------

    def _drain(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for n in self._engine.get_notifies():
            if n.name.startswith(_NOTIF_PREFIX):
                key = n.name[len(_NOTIF_PREFIX) :]
                try:
                    msg = n.msg.encode("latin-1")
                except UnicodeEncodeError:
                    msg = n.msg.encode()
            else:  # from a plain hixl engine: its notification name is the key
                key, msg = n.name, n.msg.encode()
            out.setdefault(key, []).append(msg)
        return out

    def get_new_notifs(self, backends: Any = None) -> dict[str, list[bytes]]:
        return self._drain()

    def update_notifs(self, backends: Any = None) -> dict[str, list[bytes]]:
        for k, v in self._drain().items():
            self.notifs.setdefault(k, []).extend(v)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: Any,
        lookup_tag: Any,
        backends: Any = None,
        tag_is_prefix: bool = True,
    ) -> bool:
        self.update_notifs()
        name, tag = _name(remote_agent_name), _msg(lookup_tag)
        msgs = self.notifs.get(name)
        if not msgs:
            return False
        for i, m in enumerate(msgs):
            if m.startswith(tag) if tag_is_prefix else tag in m:
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: Any, notif_msg: Any, backend: Any = None) -> None:
        if backend is not None and backend not in self.backends:
            raise KeyError(backend)
        r = self._remote(remote_agent_name)
        self._ready(r)
        try:
            self._engine.send_notify(
                r.engine, NotifyDesc(self._notif_name, _msg(notif_msg).decode("latin-1"))
            )
        except HixlError as e:
            if isinstance(e, NotConnected):
                r.ready = False
            raise from_hixl(e, f"notifying agent {r.name!r}") from e
