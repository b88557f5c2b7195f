"""``HixlTensorTransport``: Ray's ``TensorTransportManager`` contract (Ray Direct Transport,
``ray.experimental.rdt``) on one hixl engine per process.

One-sided: the sender registers the tensors of an object when Ray extracts its metadata and
deregisters them when Ray garbage-collects the object; the receiver READs them straight from the
sender's memory into buffers it registered for the transfer. Links stay up between objects, one
per peer engine. Built on hixl's public API only (``hixl.Hixl``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from ray.exceptions import RayDirectTransportError  # type: ignore[import-not-found]
from ray.experimental.rdt.tensor_transport_manager import (  # type: ignore[import-not-found]
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

import hixl

from .. import _probe, _raynode

if TYPE_CHECKING:
    import ray  # type: ignore[import-not-found]

# Receive buffers: each tensor starts on a multiple of this many bytes of one allocation.
_ALIGN = 64
# How long the first link to a peer may take to come up, and the probe of a peer linked before
# whose link died (a live peer that restarted answers it; a dead one is reported within it).
_FIRST_CONNECT_S = 10.0
_PROBE_S = 0.3
# How often a wait looks at the abort set.
_POLL_MS = 20


@dataclass
class HixlCommunicatorMetadata(CommunicatorMetadata):  # type: ignore[misc]
    """Nothing: a one-sided READ needs no pairing of sender and receiver."""


@dataclass(eq=False)
class HixlTransportMetadata(TensorTransportMetadata):  # type: ignore[misc]
    """What a receiver needs to READ an object's tensors: the sender's engine address and,
    per tensor, the address and byte length of its data in the sender's memory.

    ``tensor_meta`` and ``tensor_device`` are Ray's (shape and dtype per tensor, device type)."""

    engine: str | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)


@dataclass(eq=False)
class HixlFetchRequest(FetchRequest):  # type: ignore[misc]
    """A READ in flight: ``wait_fetch_complete`` waits for it. The receive buffer stays
    registered until the READ ended, even when nobody waits for it."""

    req: Any = None
    handles: list[Any] = field(default_factory=list)
    transport: Any = None

    def __del__(self) -> None:
        if self.transport is not None and self.handles:
            self.transport._retire(self.req, self.handles)
            self.handles = []


def _mem_type(device_type: str | None) -> Any:
    return hixl.MemType.DEVICE if device_type == "cuda" else hixl.MemType.HOST


def _cuda_present() -> bool:
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA: CPU only
        return False


class _Engine:
    """This process's hixl engine, started at first use, on the Ray node's IP (loopback outside
    Ray), with ``hixl.secret`` from ``HIXL_SECRET`` when set."""

    _lock = threading.Lock()
    _engine: hixl.Hixl | None = None

    @classmethod
    def get(cls) -> hixl.Hixl:
        with cls._lock:
            if cls._engine is None:
                ip = _raynode.ray_node_ip() or "127.0.0.1"
                options: dict[str, str | int | bool] = {}
                secret = os.environ.get("HIXL_SECRET")
                if secret:
                    options["hixl.secret"] = secret
                e = hixl.Hixl()
                e.initialize(f"{_raynode.listen_host(ip)}:0", options)
                cls._engine = e
            return cls._engine


class HixlTensorTransport(TensorTransportManager):  # type: ignore[misc]
    """Ray tensor transport "HIXL": ``@ray.method(tensor_transport="hixl")`` after
    ``hixl.ray.register()``. Ray makes one instance per process."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # storage (addr, nbytes) -> [handle, references]: one registration per storage, however
        # many objects hold tensors in it.
        self._regs: dict[tuple[int, int], list[Any]] = {}
        self._objects: dict[str, list[tuple[int, int]]] = {}
        self._aborted: set[str] = set()
        # Peers linked before (a dead link then is probed briefly, not waited for).
        self._linked: set[str] = set()
        # READs given up on (aborted, failed to wait): their buffers are deregistered once
        # the engine ended them.
        self._lingering: list[tuple[Any, list[Any]]] = []

    # --- what Ray asks of every transport ---------------------------------------------------

    def tensor_transport_backend(self) -> str:
        return "HIXL"

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: ray.actor.ActorHandle) -> bool:
        import ray

        def __ray_actor_has_hixl__(self: Any) -> bool:
            try:
                _Engine.get()
                return True
            except Exception:  # noqa: BLE001 - any failure means: not usable there
                return False

        ref = actor.__ray_call__.options(concurrency_group="_ray_system").remote(
            __ray_actor_has_hixl__
        )
        return bool(ray.get(ref))

    def get_communicator_metadata(
        self,
        src_actor: ray.actor.ActorHandle,
        dst_actor: ray.actor.ActorHandle,
        backend: str | None = None,
    ) -> HixlCommunicatorMetadata:
        return HixlCommunicatorMetadata()

    # --- sender -------------------------------------------------------------------------------

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> HixlTransportMetadata:
        """Registers the object's tensors (their whole storages, reference-counted) and
        describes them; the registration lasts until ``garbage_collect``."""
        if not rdt_object:
            return HixlTransportMetadata(tensor_meta=[], tensor_device=None)
        kind = rdt_object[0].device.type
        meta, ranges = [], []
        for i, t in enumerate(rdt_object):
            if t.device.type != kind:
                raise ValueError(
                    f"tensor {i} is on {t.device.type!r}, tensor 0 on {kind!r}: all tensors of "
                    "one object must be on one kind of device"
                )
            if not t.is_contiguous():
                raise ValueError(f"tensor {i} (shape {tuple(t.shape)}) is not contiguous")
            meta.append((t.shape, t.dtype))
            ranges.append((int(t.data_ptr()), int(t.numel() * t.element_size())))
        if kind == "cuda":
            import torch  # type: ignore[import-not-found,unused-ignore]

            for dev in {t.device for t in rdt_object}:
                torch.cuda.synchronize(dev)
        elif kind != "cpu":
            raise ValueError(f"device type {kind!r}: hixl.ray moves cpu and cuda tensors")
        engine = _Engine.get()
        keys: list[tuple[int, int]] = []
        with self._lock:
            try:
                for t in rdt_object:
                    s = t.untyped_storage()
                    key = (int(s.data_ptr()), int(s.nbytes()))
                    if key[1] == 0:
                        continue
                    self._ref(engine, key, _mem_type(kind))
                    keys.append(key)
            except BaseException:
                self._unref_all(engine, keys)
                raise
            self._objects[obj_id] = keys
        return HixlTransportMetadata(
            tensor_meta=meta, tensor_device=kind, engine=engine.local_engine, ranges=ranges
        )

    def _ref(self, engine: hixl.Hixl, key: tuple[int, int], mem_type: Any) -> None:
        r = self._regs.get(key)
        if r is not None:
            r[1] += 1
            return
        h = engine.register_mem(hixl.MemDesc(key[0], key[1]), mem_type, access="r")
        self._regs[key] = [h, 1]

    def _unref_all(self, engine: hixl.Hixl, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            r = self._regs.get(key)
            if r is None:
                continue
            r[1] -= 1
            if r[1] == 0:
                del self._regs[key]
                engine.deregister_mem(r[0])

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        """Deregisters what the object's extraction registered (storages other objects still
        hold stay registered)."""
        with self._lock:
            keys = self._objects.pop(obj_id, None)
            if keys:
                self._unref_all(_Engine.get(), keys)

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError("hixl.ray is one-sided: the receiver READs, nothing is sent")

    # --- receiver -----------------------------------------------------------------------------

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> HixlFetchRequest:
        """Posts one READ of all the object's tensors, into `target_buffers` or into views of
        one new buffer, and returns at once; ``wait_fetch_complete`` waits for it."""
        meta = tensor_transport_metadata
        if not isinstance(meta, HixlTransportMetadata):
            raise TypeError(f"metadata of another transport: {type(meta).__name__}")
        self._sweep()
        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                raise RayDirectTransportError(f"hixl.ray: the receive of {obj_id} was aborted")
        if not meta.tensor_meta:
            return HixlFetchRequest(obj_id=obj_id, tensors=[])
        engine = _Engine.get()
        handles: list[Any] = []
        try:
            tensors, local, handles = self._buffers(engine, meta, target_buffers)
            rows = [(la, ra, n) for la, (ra, n) in zip(local, meta.ranges, strict=True) if n > 0]
            if not rows:
                self._unregister(engine, handles)
                return HixlFetchRequest(obj_id=obj_id, tensors=tensors)
            assert meta.engine is not None
            self._link(engine, meta.engine)
            req = engine.transfer_async(meta.engine, "READ", np.array(rows, np.uint64))
        except Exception as e:
            self._unregister(engine, handles)
            raise RayDirectTransportError(
                f"hixl.ray: reading object {obj_id} from {meta.engine} failed: {e}"
            ) from e
        return HixlFetchRequest(
            obj_id=obj_id, tensors=tensors, req=req, handles=handles, transport=self
        )

    def _buffers(
        self, engine: hixl.Hixl, meta: HixlTransportMetadata, target: list[Any] | None
    ) -> tuple[list[Any], list[int], list[Any]]:
        """The tensors to receive into, their addresses, and the registrations made for them."""
        import torch  # type: ignore[import-not-found,unused-ignore]

        if target:
            if len(target) != len(meta.tensor_meta):
                raise ValueError(
                    f"{len(target)} target buffers for {len(meta.tensor_meta)} tensors"
                )
            handles = []
            try:
                for t in target:
                    n = int(t.numel() * t.element_size())
                    if n:
                        handles.append(
                            engine.register_mem(
                                hixl.MemDesc(int(t.data_ptr()), n), _mem_type(t.device.type)
                            )
                        )
            except BaseException:
                self._unregister(engine, handles)
                raise
            return list(target), [int(t.data_ptr()) for t in target], handles
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in meta.tensor_meta]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        device = meta.tensor_device or "cpu"
        buf = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
        tensors = [
            buf[o : o + n].view(dtype).reshape(shape)
            for o, n, (shape, dtype) in zip(offsets, sizes, meta.tensor_meta, strict=True)
        ]
        base = int(buf.data_ptr())
        handles = []
        if total:
            handles.append(engine.register_mem(hixl.MemDesc(base, total), _mem_type(device)))
        return tensors, [base + o for o in offsets], handles

    def _link(self, engine: hixl.Hixl, peer: str) -> None:
        """Makes sure a link to `peer` is up: kept from the last object, or opened now. A peer
        whose link died, or whose port refuses connects (its address reached us only after it
        listened, so it is gone), is reported within a short probe; only a first connect to a
        peer that is slow to answer waits longer."""
        if engine.get_async_connect_status(peer) == hixl.AsyncConnectStatus.CONNECTED:
            return
        known = peer in self._linked
        try:
            engine.connect(peer, timeout_ms=_PROBE_S * 1000)
        except hixl.AlreadyConnected:
            self._await_link(engine, peer)  # another thread's connect is in progress
        except hixl.HixlError:
            if known or _probe.refuses(peer):
                raise
            try:
                engine.connect(peer, timeout_ms=_FIRST_CONNECT_S * 1000)
            except hixl.AlreadyConnected:
                self._await_link(engine, peer)
        self._linked.add(peer)

    @staticmethod
    def _await_link(engine: hixl.Hixl, peer: str) -> None:
        deadline = time.monotonic() + _FIRST_CONNECT_S
        while True:
            st = engine.get_async_connect_status(peer)
            if st == hixl.AsyncConnectStatus.CONNECTED:
                return
            if st != hixl.AsyncConnectStatus.CONNECTING or time.monotonic() >= deadline:
                raise hixl.NotConnected(f"no link to {peer} ({st.name})")
            time.sleep(0.001)

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1) -> list[Any]:
        """Waits for the READ (at most `timeout` seconds, -1: until it ends); raises
        RayDirectTransportError when it failed, the sender died or the receive was aborted."""
        if not isinstance(fetch_request, HixlFetchRequest):
            raise TypeError(f"not a hixl.ray fetch request: {type(fetch_request).__name__}")
        fr = fetch_request
        if fr.req is None:
            return list(fr.tensors)
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            with self._lock:
                if fr.obj_id in self._aborted:
                    self._aborted.discard(fr.obj_id)
                    self._give_up(fr)
                    raise RayDirectTransportError(
                        f"hixl.ray: the receive of {fr.obj_id} was aborted"
                    )
            left_ms: float = _POLL_MS
            if deadline is not None:
                left_ms = min(left_ms, max(0.0, (deadline - time.monotonic()) * 1000))
            st = fr.req.wait(timeout_ms=left_ms)
            if st == hixl.TransferStatus.COMPLETED:
                self._unregister(_Engine.get(), fr.handles)
                fr.handles = []
                return list(fr.tensors)
            if st != hixl.TransferStatus.WAITING:
                try:
                    fr.req.result()
                    err: Exception = RuntimeError(f"transfer ended {st.name}")
                except Exception as e:  # noqa: BLE001 - reported below with its cause
                    err = e
                self._give_up(fr)
                raise RayDirectTransportError(
                    f"hixl.ray: reading object {fr.obj_id} failed (the sender may have died): {err}"
                ) from err
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"hixl.ray: object {fr.obj_id} not received in {timeout} s")

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        fr = self.fetch_multiple_tensors(
            obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
        )
        return self.wait_fetch_complete(fr)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        """Ends the receive of `obj_id` (now, or as soon as it starts) with an error."""
        with self._lock:
            self._aborted.add(obj_id)

    # --- receive buffers ----------------------------------------------------------------------

    def _give_up(self, fr: HixlFetchRequest) -> None:
        if fr.handles:
            self._retire(fr.req, fr.handles)
            fr.handles = []

    def _retire(self, req: Any, handles: list[Any]) -> None:
        """Deregisters `handles` once `req` ended (now, or at a later sweep)."""
        with self._lock:
            self._lingering.append((req, handles))
        self._sweep()

    def _sweep(self) -> None:
        with self._lock:
            done = [x for x in self._lingering if x[0] is None or not _waiting(x[0])]
            self._lingering = [x for x in self._lingering if x not in done]
        if done:
            engine = _Engine.get()
            for _, handles in done:
                self._unregister(engine, handles)

    @staticmethod
    def _unregister(engine: hixl.Hixl, handles: list[Any]) -> None:
        for h in handles:
            try:
                engine.deregister_mem(h)
            except hixl.HixlError:
                pass  # the engine already let it go (finalized)


def _waiting(req: Any) -> bool:
    try:
        return bool(req.status() == hixl.TransferStatus.WAITING)
    except Exception:  # noqa: BLE001 - a request the engine no longer knows has ended
        return False


def cuda_present() -> bool:
    """Whether torch sees a CUDA device in this process (then "cuda" is a device of HIXL)."""
    return _cuda_present()
