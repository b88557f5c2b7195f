"""``nixl._utils``'s helpers for NIXL examples: raw host memory through libc."""

from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """``size`` bytes from malloc, as an address (free them with free_passthru)."""
    addr = _libc.malloc(int(size))
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> ctypes.Array[ctypes.c_char]:
    """A ctypes view of ``size`` bytes at ``addr`` (bytes(...) copies them out)."""
    return (ctypes.c_char * int(size)).from_address(int(addr))
