"""``TransferEngine``: Mooncake's Python transfer engine (0.3.13) on one hixl engine.

This module holds the engine's life (``initialize``), memory registration, managed buffers,
probes and topology; the transfers come from ``_transfer``. Every call returns what Mooncake's
returns (0, a negative code, a batch id, a status value) and logs why it failed on the
``hixl.mooncake`` logger; bad arguments of the wrong type raise ``TypeError`` as pybind11 does.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import threading
import weakref
from typing import Any

import numpy as np

from .._errors import HixlError
from .._hixl import Hixl, MemDesc, MemHandle, _rdma_info
from . import _protocol
from ._codes import (
    DEFAULT_RPC_PORT,
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    ERR_DEVICE_NOT_FOUND,
    ERR_INVALID_ARGUMENT,
    ERR_PROBE_FAILED,
    OK,
    P2P_HANDSHAKE,
)
from ._location import mem_type
from ._protocol import log
from ._transfer import _Transfers

# Managed buffers of engines whose finalize failed: a peer may still reach them, so they are
# never freed (a leak rather than memory freed under a peer's WRITE).
_LEAKED: list[np.ndarray[Any, Any]] = []

# Engines not finalized yet; finalized at interpreter exit, before daemon threads stop.
_OPEN: weakref.WeakSet[TransferEngine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for te in list(_OPEN):
        try:
            te.close()
        except Exception:
            pass


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, not {type(value).__name__} {value!r}")
    return int(value)


class TransferEngine(_Transfers):
    """Mooncake's ``mooncake.engine.TransferEngine`` on hixl (see
    https://github.com/hixl/hixl/blob/main/docs/MOONCAKE.md).

    Make one, call ``initialize(local_hostname, metadata_server, protocol, device_name)``, then
    register memory and transfer to sessions ``"host:rpc_port"`` (a peer's hostname and its
    ``get_rpc_port()``). ``close()`` (hixl's, not Mooncake's) stops the engine; otherwise it
    stops when the object is collected or at interpreter exit.
    """

    def __init__(self) -> None:
        """An engine that does nothing until ``initialize``."""
        self._engine: Hixl | None = None
        self._lock = threading.RLock()
        self._regs: dict[int, tuple[int, MemHandle]] = {}
        self._managed: dict[int, tuple[np.ndarray[Any, Any], MemHandle]] = {}
        self._hostname = ""
        self._rpc_port = 0
        self._init_batches()

    # -- life ---------------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Starts the engine: 0, or a negative code (logged) when it cannot.

        ``local_hostname`` is the address peers reach this engine at ("ip", "host", with
        ":port" outside P2PHANDSHAKE mode). With ``metadata_server="P2PHANDSHAKE"`` the engine
        listens on a free port (``get_rpc_port()``), as Mooncake's does; with any other value
        (``etcd://...``, ``http://...``) hixl needs no metadata service: it listens on the
        hostname's port (default 12001), where peers' sessions ``"host"`` / ``"host:port"``
        reach it directly. ``protocol`` is a hint (https://github.com/hixl/hixl/blob/main/docs/MOONCAKE.md);
        ``device_name`` is accepted and ignored (hixl picks devices itself).
        """
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """``initialize`` with Mooncake's fifth argument (the metadata type), which hixl
        accepts and ignores."""
        for what, v in (("local_hostname", local_hostname), ("metadata_server", metadata_server)):
            if not isinstance(v, str):
                raise TypeError(f"{what} must be a str, not {type(v).__name__} {v!r}")
        with self._lock:
            if self._engine is not None:
                log.warning("initialize: engine already initialized at %s", self._hostname)
                return OK
            try:
                host, port = _protocol.split_host(local_hostname)
            except ValueError as e:
                log.error("initialize: %s", e)
                return ERR_INVALID_ARGUMENT
            p2p = metadata_server.strip().upper() == P2P_HANDSHAKE
            if p2p:
                port = 0
            elif port is None:
                port = DEFAULT_RPC_PORT
            if not p2p:
                log.info(
                    "initialize: metadata server %r not needed by hixl; peers reach this "
                    "engine directly at %s",
                    metadata_server,
                    _protocol.join(host, port),
                )
            backends, why = _protocol.backends_for(str(protocol))
            if backends is None:
                log.error("initialize: %s", why)
                return ERR_DEVICE_NOT_FOUND
            if why:
                _protocol.warn_once(f"initialize: {why}")
            engine = Hixl()
            listen = _protocol.join(host, port)
            try:
                engine.initialize(listen, {"hixl.backends": backends})
            except HixlError as e:
                log.error("initialize: cannot listen on %s: %s", listen, e)
                return ERR_INVALID_ARGUMENT
            self._engine = engine
            self._hostname = host
            self._rpc_port = _protocol.split_host(engine.local_engine)[1] or port
            _OPEN.add(self)
            return OK

    def get_rpc_port(self) -> int:
        """The port this engine's peers name in their sessions (``"host:port"``)."""
        return self._rpc_port

    def close(self) -> None:
        """hixl's addition: stops the engine (idempotent). Registered memory is released.

        The engine is finalized first, and only then are the managed buffers released: until
        finalize returns a peer may still WRITE into them. When finalize fails (a peer that did
        not let go in time), the buffers are leaked, never freed, and the failure is logged and
        raised."""
        with self._lock:
            engine, self._engine = self._engine, None
            managed = list(self._managed.values())
            self._linked.clear()
            self._regs.clear()
            self._managed.clear()
        if engine is None:
            return
        _OPEN.discard(self)
        try:
            engine.finalize()
        except BaseException as e:
            _LEAKED.extend(arr for arr, _ in managed)
            log.error(
                "close: finalize failed (%s); %d managed buffers (%d bytes) are kept, not freed, "
                "since a peer may still reach them",
                e,
                len(managed),
                sum(arr.nbytes for arr, _ in managed),
            )
            raise
        del managed  # only now: no peer reaches them any more

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def engine(self) -> Hixl | None:
        """hixl's addition: the ``hixl.Hixl`` behind this engine (None before ``initialize``)."""
        return self._engine

    def _live(self, call: str) -> Hixl | None:
        engine = self._engine
        if engine is None:
            log.error("%s: the engine is not initialized (call initialize first)", call)
        return engine

    # -- memory -------------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` for peers to read and write: 0, -1
        for a bad range, -7 for a range overlapping one registered before. ``location``
        ``"cuda:N"`` registers CUDA device memory, ``"cpu:N"`` host memory, and ``"*"`` asks the
        CUDA driver which it is (host memory without CUDA). Releases the
        GIL while it registers."""
        addr, size = _int(buffer_addr, "buffer_addr"), _int(capacity, "capacity")
        engine = self._live("register_memory")
        if engine is None:
            return ERR_INVALID_ARGUMENT
        with self._lock:
            if addr in self._regs:
                log.error("register_memory: 0x%x is registered already", addr)
                return ERR_ADDRESS_OVERLAPPED
        if size <= 0 or addr <= 0:
            log.error("register_memory: bad range 0x%x+%d", addr, size)
            return ERR_INVALID_ARGUMENT
        try:
            handle = engine.register_mem(MemDesc(addr, size), mem_type(addr, location))
        except HixlError as e:
            log.error("register_memory(0x%x, %d, %r): %s", addr, size, location, e.message)
            return ERR_ADDRESS_OVERLAPPED if "overlaps" in e.message else ERR_INVALID_ARGUMENT
        with self._lock:
            self._regs[addr] = (size, handle)
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        """Deregisters the region registered at ``buffer_addr``: 0, or -3 when none was."""
        addr = _int(buffer_addr, "buffer_addr")
        engine = self._live("unregister_memory")
        if engine is None:
            return ERR_INVALID_ARGUMENT
        with self._lock:
            entry = self._regs.pop(addr, None)
        if entry is None:
            log.error("unregister_memory: 0x%x is not registered", addr)
            return ERR_ADDRESS_NOT_REGISTERED
        try:
            engine.deregister_mem(entry[1])
        except HixlError as e:
            log.error("unregister_memory(0x%x): %s", addr, e.message)
            return ERR_INVALID_ARGUMENT
        return OK

    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int:
        """Registers each ``(address, capacity)`` pair: 0, or the first failure's code (the
        pairs this call registered before it are deregistered again)."""
        addrs, caps = list(buffer_addresses), list(capacities)
        if len(addrs) != len(caps):
            log.error("batch_register_memory: %d addresses, %d capacities", len(addrs), len(caps))
            return ERR_INVALID_ARGUMENT
        done: list[int] = []
        for a, c in zip(addrs, caps, strict=True):
            rc = self.register_memory(a, c, location)
            if rc != OK:
                for d in done:
                    self.unregister_memory(d)
                return rc
            done.append(int(a))
        return OK

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        """Deregisters each address: 0, or the last failure's code (the others still go)."""
        rc = OK
        for a in list(buffer_addresses):
            r = self.unregister_memory(a)
            rc = r if r != OK else rc
        return rc

    def _registered(self, addr: int, n: int) -> bool:
        with self._lock:
            for base, (size, _) in self._regs.items():
                if base <= addr and addr + n <= base + size:
                    return True
            for base, (arr, _) in self._managed.items():
                if base <= addr and addr + n <= base + arr.nbytes:
                    return True
        return False

    # -- managed buffers ----------------------------------------------------------------------

    def allocate_managed_buffer(self, length: int) -> int:
        """``length`` bytes of registered host memory owned by the engine: its address, or 0
        when it cannot be had (logged)."""
        n = _int(length, "length")
        engine = self._live("allocate_managed_buffer")
        if engine is None or n <= 0:
            if engine is not None:
                log.error("allocate_managed_buffer: bad length %d", n)
            return 0
        arr = np.zeros(n, np.uint8)
        addr = int(arr.ctypes.data)
        try:
            # register (not register_mem): the engine too keeps the array alive until the
            # region is deregistered or the engine finalized, and leaks it when that fails.
            handle = engine.register(arr)
        except HixlError as e:
            log.error("allocate_managed_buffer(%d): %s", n, e.message)
            return 0
        with self._lock:
            self._managed[addr] = (arr, handle)
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer of ``allocate_managed_buffer``: 0, or -1 when ``buffer_addr`` is not
        one (``length`` must be its length)."""
        addr, n = _int(buffer_addr, "buffer_addr"), _int(length, "length")
        engine = self._live("free_managed_buffer")
        with self._lock:
            entry = self._managed.get(addr)
            if entry is None or entry[0].nbytes != n or engine is None:
                log.error("free_managed_buffer: 0x%x+%d is not a managed buffer", addr, n)
                return ERR_INVALID_ARGUMENT
            del self._managed[addr]
        try:
            engine.deregister_mem(entry[1])
        except HixlError as e:
            # Peers may still reach it: keep the buffer rather than free it.
            _LEAKED.append(entry[0])
            log.error(
                "free_managed_buffer(0x%x): %s (the buffer is kept, not freed)", addr, e.message
            )
            return ERR_INVALID_ARGUMENT
        return OK

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        """Copies ``length`` bytes of ``src`` to ``dest_address`` (in memory registered here or
        a managed buffer): 0, or -1 for a range outside them or longer than ``src``."""
        addr, n = _int(dest_address, "dest_address"), _int(length, "length")
        data = src.encode() if isinstance(src, str) else bytes(src)
        if n < 0 or n > len(data) or not self._registered(addr, n):
            log.error("write_bytes_to_buffer: 0x%x+%d (of %d bytes) refused", addr, n, len(data))
            return ERR_INVALID_ARGUMENT
        ctypes.memmove(addr, data, n)
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes at ``source_address`` (in memory registered here or a managed
        buffer); raises ``ValueError`` naming the range when it is outside them."""
        addr, n = _int(source_address, "source_address"), _int(length, "length")
        if n < 0 or not self._registered(addr, n):
            raise ValueError(f"read_bytes_from_buffer: 0x{addr:x}+{n} is not registered memory")
        return ctypes.string_at(addr, n)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first region registered at session ``segment_name`` (this
        engine's own when it names itself); 0 when it has none or cannot be reached."""
        engine = self._live("get_first_buffer_address")
        if engine is None:
            return 0
        if self._is_self(segment_name):
            with self._lock:
                return next(iter(self._regs), 0)
        addr = self._connected(segment_name, "get_first_buffer_address")
        if addr is None:
            return 0
        mems = engine.remote_mems(addr)
        return min((m.addr for m in mems), default=0)

    # -- probes and topology ------------------------------------------------------------------

    def send_probe(self, peer_server_name: str) -> int:
        """0 when session ``peer_server_name`` answers (hixl links to it), -102 when not."""
        if self._live("send_probe") is None:
            return ERR_INVALID_ARGUMENT
        return OK if self._connected(peer_server_name, "send_probe") else ERR_PROBE_FAILED

    def get_local_topology(self, device_name: str | None = None) -> str:
        """A JSON text in Mooncake's shape: ``{"cpu:0": [[preferred NICs], [others]]}``, with
        the RDMA devices hixl can use (none without RDMA)."""
        info = _rdma_info("verbs")
        nics: list[str] = []
        if info.startswith("devices:"):
            for part in info[len("devices:") :].split(","):
                name = part.strip().split(" ")[0]
                if name and (not device_name or name in device_name.split(",")):
                    nics.append(name)
        return json.dumps({"cpu:0": [nics, []]}, indent="\t") + "\n"

    def _is_self(self, session: str) -> bool:
        try:
            host, port = _protocol.split_host(session)
        except ValueError:
            return False
        return host == self._hostname and port in (None, self._rpc_port)
