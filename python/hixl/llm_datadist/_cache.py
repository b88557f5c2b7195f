"""Cache / KvCache handles, CacheTask, and turning cache addresses into arrays or tensors
(what ``torchair.llm_datadist.create_npu_tensors`` does on Ascend)."""

from __future__ import annotations

import ctypes
import importlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._status import LLMException, LLMStatusCode, check
from ._types import NP_DTYPES, CacheDesc, DataType, check_int, check_ints


class Cache:
    """A cache known to a CacheManager: ``cache_id``, ``cache_desc`` and the address of each
    of its tensors (host memory on hixl). ``Cache.create_cpu_cache`` wraps host memory that
    is not registered (for swap_blocks / copy targets)."""

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        tensor_addrs: Sequence[int],
        cache_manager: Any = None,
        is_registered: bool = False,
        is_blocks_cache: bool = False,
    ) -> None:
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._tensor_addrs = [int(a) for a in tensor_addrs]
        self._manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks = is_blocks_cache
        self._valid = True

    @property
    def cache_id(self) -> int:
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        return self._cache_desc

    @property
    def tensor_addrs(self) -> list[int]:
        return list(self._tensor_addrs)

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        return [list(self._tensor_addrs)]

    @property
    def is_blocks_cache(self) -> bool:
        return self._is_blocks

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[int]) -> Cache:
        check(isinstance(cache_desc, CacheDesc), "cache_desc must be a CacheDesc")
        flat = _flat_addrs(addrs)
        check(
            len(flat) == cache_desc.num_tensors,
            f"{len(flat)} addresses for a cache of {cache_desc.num_tensors} tensors",
        )
        return cls(-1, cache_desc, flat, None, False, True)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(cache_id={self._cache_id}, {self._cache_desc!r}, "
            f"tensor_addrs=[{', '.join(hex(a) for a in self._tensor_addrs)}])"
        )


class KvCache(Cache):
    """The older API's cache handle (kv_cache_manager): the same, addresses per device."""

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: Sequence[Any]) -> KvCache:
        out = Cache.create_cpu_cache(cache_desc, addrs)
        return cls(-1, out.cache_desc, out.tensor_addrs, None, False, False)


def _flat_addrs(addrs: Sequence[Any]) -> list[int]:
    if isinstance(addrs, (list, tuple)) and addrs and isinstance(addrs[0], (list, tuple)):
        check(len(addrs) == 1, "hixl has one device per process: give one list of addresses")
        addrs = addrs[0]
    out = check_ints("addrs", addrs)
    check(all(a != 0 for a in out), "addrs must not be 0")
    return out


def host_array(addr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 view of `nbytes` of this process's memory at `addr` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def _element_type(data_type: Any) -> tuple[np.dtype, bool, bool]:
    """(numpy storage dtype, is bfloat16, given as a torch dtype) of a DataType, a numpy
    dtype (or its name) or a torch dtype."""
    if isinstance(data_type, DataType):
        check(data_type in NP_DTYPES, f"data_type={data_type.name} has no fixed element size")
        return np.dtype(NP_DTYPES[data_type]), data_type == DataType.DT_BF16, False
    name = str(data_type)
    if name.startswith("torch."):
        if name == "torch.bfloat16":
            return np.dtype(np.uint16), True, True
        name = name[len("torch.") :]
        torch_given = True
    else:
        torch_given = False
    try:
        return np.dtype(name if torch_given else data_type), False, torch_given
    except TypeError:
        raise LLMException(
            f"data_type={data_type!r} is not a DataType, numpy or torch dtype",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None


def create_tensors(
    shape: Sequence[int], data_type: Any, addrs: Sequence[int], framework: str | None = None
) -> list[Any]:
    """One array per address, of `shape` and `data_type` (a DataType, numpy dtype or torch
    dtype), viewing that memory (no copy): numpy arrays, or torch CPU tensors with
    ``framework="torch"`` (the default when `data_type` is a torch dtype). hixl's
    counterpart of Ascend's ``create_npu_tensors(shape, dtype, addrs)``; the memory must stay
    alive while they are used."""
    dt, bf16, torch_given = _element_type(data_type)
    framework = framework or ("torch" if torch_given else "numpy")
    dims = [check_int("shape dim", d, 1) for d in shape]
    nbytes = int(np.prod(dims)) * dt.itemsize
    arrays = [host_array(a, nbytes).view(dt).reshape(dims) for a in _flat_addrs(addrs)]
    if framework == "numpy":
        return arrays
    check(framework == "torch", f"framework={framework!r} must be 'numpy' or 'torch'")
    torch: Any = importlib.import_module("torch")  # optional dependency

    out = [torch.from_numpy(a) for a in arrays]
    if bf16:
        out = [t.view(torch.bfloat16) for t in out]
    return out


#: LLM-DataDist's name (the tensors live in host memory here).
create_npu_tensors = create_tensors


class CacheTask:
    """A transfer running in the background (transfer_cache_async). ``synchronize()`` waits
    and returns the overall LLMStatusCode; ``get_results()`` one per transfer config. Both
    return LLM_WAIT_PROCESS_TIMEOUT if the task is still running after the timeout."""

    def __init__(self, n: int) -> None:
        self._results = [LLMStatusCode.LLM_SUCCESS] * n
        self._done = threading.Event()
        self.error: BaseException | None = None

    def _finish(self) -> None:
        self._done.set()

    def _wait(self, timeout_in_millis: int | None) -> bool:
        if timeout_in_millis is not None:
            check_int("timeout_in_millis", timeout_in_millis, 0, 2**32 - 1)
        return self._done.wait(None if timeout_in_millis is None else timeout_in_millis / 1000)

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        bad = [r for r in self._results if r != LLMStatusCode.LLM_SUCCESS]
        return bad[0] if bad else LLMStatusCode.LLM_SUCCESS

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode]:
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT] * len(self._results)
        return list(self._results)
