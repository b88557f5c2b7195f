"""Descriptor lists (``get_xfer_descs``, ``get_reg_descs``, ...) and memory registration
(``register_memory``, ``deregister_memory``, ``query_memory``) of ``nixl_agent``.

Registrations are reference-counted per ``(addr, len)``: a range inside a region registered
before is an alias holding a reference on it, not a registration of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import HixlError
from .._hixl import MemDesc, MemHandle, MemType, cuda_info
from ._bindings import (
    DRAM_SEG,
    MEM_NAMES,
    VRAM_SEG,
    from_hixl,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDList,
    nixlXferDList,
)
from ._bindings import deserialize as _deserialize
from ._bindings import serialize as _serialize
from ._common import U64, _AgentBase


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


class _Region:
    __slots__ = ("handle", "refs", "parent")

    def __init__(self, handle: MemHandle | None, parent: tuple[int, int] | None) -> None:
        self.handle, self.refs, self.parent = handle, 1, parent


class _Memory(_AgentBase):
    """Descriptor lists and memory registration: the part of ``nixl_agent`` below all others."""

    _regs: dict[tuple[int, int], _Region]
    _lstarts: U64  # starts and ends of this agent's registered regions (no aliases), sorted
    _lends: U64

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
        """DRAM, or VRAM where this process has CUDA (the engine's ``cuda:N`` domain); refuses
        VRAM without CUDA, naming why, and storage."""
        if seg == VRAM_SEG:
            info = cuda_info()
            if not info.get("available"):
                raise nixlNotSupportedError(
                    f"{what}: VRAM (device memory) needs CUDA in this process: "
                    f"{info.get('reason') or 'CUDA was not found'}"
                )
            return
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
                    obj = objs[i] if objs is not None else None
                    self._register_one(a, n, obj, descs.getType() == VRAM_SEG)
                    done.append((a, n))
            except BaseException:
                for key in reversed(done):
                    self._deregister_one(key)
                raise
            finally:
                self._refresh_local()
        return descs

    def _register_one(self, a: int, n: int, obj: Any, device: bool = False) -> None:
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
                h = self._engine.register(obj)  # a CUDA tensor lands in its cuda:N domain
            else:
                h = self._engine.register_mem(
                    MemDesc(a, n), MemType.DEVICE if device else MemType.HOST
                )
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
