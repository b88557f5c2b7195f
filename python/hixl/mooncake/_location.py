"""Where a raw address lives, for ``register_memory(addr, length, location)``.

Mooncake's ``location`` ``"*"`` (the default, what SGLang passes for its GPU KV pools) means
"find out". hixl needs to be told (``MemType.HOST`` or ``MemType.DEVICE``), so ``"*"`` asks the
CUDA driver (``cuPointerGetAttribute``) where CUDA is found; without CUDA, or for memory the
driver does not know, it is host memory. ``"cpu..."`` is host memory, ``"cuda:N"`` device
memory, without asking.
"""

from __future__ import annotations

import ctypes
import functools

from .._hixl import MemType, cuda_info

#: ``CU_POINTER_ATTRIBUTE_MEMORY_TYPE`` and its ``CU_MEMORYTYPE_DEVICE`` value (cuda.h).
_ATTR_MEMORY_TYPE = 2
_MEMORYTYPE_DEVICE = 2


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """libcuda where hixl found CUDA, else None (looked up once)."""
    if not cuda_info().get("available"):
        return None
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _is_device(addr: int) -> bool:
    cuda = _driver()
    if cuda is None:
        return False
    kind = ctypes.c_uint(0)
    rc = cuda.cuPointerGetAttribute(
        ctypes.byref(kind), ctypes.c_int(_ATTR_MEMORY_TYPE), ctypes.c_uint64(addr)
    )
    return rc == 0 and kind.value == _MEMORYTYPE_DEVICE


def mem_type(addr: int, location: str) -> MemType:
    """hixl's memory type for ``addr`` registered with Mooncake's ``location``."""
    loc = (location or "*").strip().lower()
    if loc.startswith(("cuda", "gpu", "musa", "hip", "npu")):
        return MemType.DEVICE
    if loc in ("*", "") and _is_device(addr):
        return MemType.DEVICE
    return MemType.HOST
