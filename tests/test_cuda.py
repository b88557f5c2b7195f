"""CUDA device memory. Two halves:

- On a machine without CUDA (where CI runs): registering device memory raises Unsupported
  with a message saying CUDA was not found, for a real object exposing
  `__cuda_array_interface__` (the protocol torch and CuPy implement) and for a raw pointer,
  and nothing panics; `hixl info` says "CUDA not found".
- On a machine with a GPU (scripts/gpu_check.sh): the same-host `cuda_ipc` backend between two
  processes, bytes compared on the host afterwards. These skip, with the reason, without CUDA
  or without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

import hixl
from hixl import Hixl, MemDesc, MemType

CUDA = hixl._hixl.cuda_info()
needs_gpu = pytest.mark.skipif(not CUDA["available"], reason=f"no GPU here: {CUDA['reason']}")
no_gpu = pytest.mark.skipif(CUDA["available"], reason="this machine has CUDA")


class FakeDeviceArray:
    """A real object implementing the CUDA Array Interface (v3), as CuPy and torch do. The
    pointer is not device memory: only the driver can tell, and here there is no driver."""

    def __init__(
        self, ptr: int, shape: tuple[int, ...], typestr: str = "<f4", strides: Any = None
    ) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }


@no_gpu
def test_registering_device_memory_without_cuda_is_unsupported_and_names_the_library() -> None:
    with Hixl() as e:
        e.initialize("127.0.0.1:0")
        for call in (
            lambda: e.register(FakeDeviceArray(0x7F00_0000_0000, (256, 4))),
            lambda: e.register(FakeDeviceArray(0x7F00_0000_0000, (16,), "|u1"), access="r"),
            lambda: e.register_mem(MemDesc(0x7F00_0000_0000, 4096), MemType.DEVICE),
        ):
            with pytest.raises(hixl.Unsupported) as ei:
                call()
            msg = str(ei.value)
            assert "CUDA was not found" in msg and "libcuda.so.1" in msg, msg
        # Nothing was registered, and host memory still works.
        buf = bytearray(4096)
        h = e.register(buf)
        assert h.domain == "host" and h.mem_type == MemType.HOST


def test_bad_device_arrays_are_refused_before_the_driver_is_asked() -> None:
    with Hixl() as e:
        e.initialize("127.0.0.1:0")
        # Transposed (not C-contiguous) strides.
        with pytest.raises(hixl.ParamInvalid, match="not C-contiguous"):
            e.register(FakeDeviceArray(0x7F00_0000_0000, (4, 8), "<f4", strides=(4, 16)))
        with pytest.raises(hixl.ParamInvalid, match="item size"):
            e.register(FakeDeviceArray(0x7F00_0000_0000, (4,), "<f"))


def test_a_read_only_device_array_needs_access_r() -> None:
    class ReadOnly(FakeDeviceArray):
        pass

    arr = ReadOnly(0x7F00_0000_0000, (8,))
    arr.__cuda_array_interface__["data"] = (0x7F00_0000_0000, True)
    with Hixl() as e:
        e.initialize("127.0.0.1:0")
        with pytest.raises(hixl.ParamInvalid, match='access="r"'):
            e.register(arr)


@no_gpu
def test_info_says_cuda_not_found() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "info"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "CUDA not found" in r.stdout and "libcuda.so.1" in r.stdout, r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    info = json.loads(r.stdout)
    assert info["cuda"]["available"] is False and info["cuda"]["devices"] == []
    assert info["transports"]["cuda_ipc"]["available"] is False
    assert "CUDA not found" in info["transports"]["cuda_ipc"]["detail"]
    assert "not built" in info["transports"]["cuda_staging"]["detail"]
