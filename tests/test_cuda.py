"""CUDA device memory. Two halves:

- On a machine without CUDA (where CI runs): registering device memory raises Unsupported
  with a message saying CUDA was not found, for a real object exposing
  `__cuda_array_interface__` (the protocol torch and CuPy implement) and for a raw pointer,
  and nothing panics; `hixl info` says "CUDA was not found".
- On a machine with a GPU (scripts/gpu_check.sh): the same-host `cuda_ipc` backend between two
  processes, bytes compared on the host afterwards. These skip, with the reason, without CUDA
  or without torch.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
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


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class FakeDLPackCuda:
    """A real DLPack producer (the legacy unversioned "dltensor" capsule) that says its memory
    is on kDLCUDA device `device_id`. The pointer is not device memory: only the driver can
    tell. float32, C-contiguous unless `strides` (in elements) says otherwise."""

    def __init__(self, ptr: int, shape: tuple[int, ...], device_id: int = 0, strides: Any = None):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        t = _DLTensor(
            ptr,
            _DLDevice(2, device_id),  # kDLCUDA
            len(shape),
            _DLDataType(2, 32, 1),  # float32
            self.shape,
            self.strides,
            0,
        )
        self.managed = _DLManagedTensor(t, None, None)
        self.device_id = device_id

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device_id)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor", None)


@no_gpu
def test_registering_device_memory_without_cuda_is_unsupported_and_names_the_library() -> None:
    with Hixl() as e:
        e.initialize("127.0.0.1:0")
        for call in (
            lambda: e.register(FakeDeviceArray(0x7F00_0000_0000, (256, 4))),
            lambda: e.register(FakeDeviceArray(0x7F00_0000_0000, (16,), "|u1"), access="r"),
            lambda: e.register_mem(MemDesc(0x7F00_0000_0000, 4096), MemType.DEVICE),
            lambda: e.register(FakeDLPackCuda(0x7F00_0000_0000, (16, 16), device_id=1)),
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
        # DLPack strides count elements: (1, 4) for shape (4, 8) is a transposed view.
        with pytest.raises(hixl.ParamInvalid, match=r"DLPack tensor of shape \[4, 8\]"):
            e.register(FakeDLPackCuda(0x7F00_0000_0000, (4, 8), strides=(1, 4)))


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
def test_a_device_kv_cache_without_cuda_is_unsupported_and_leaves_nothing_behind() -> None:
    hixl.kv.init(cluster_id=0, role="mix")
    try:
        arr = FakeDeviceArray(0x7F00_0000_0000, (4, 2, 16, 64), "<f2")
        with pytest.raises(hixl.Unsupported, match="CUDA was not found"):
            hixl.kv.allocate_cache(arr, mem_type="device", name="kv", layer_axis=0, block_axis=2)
        # The name is free again: the failed cache was not kept.
        assert (
            hixl.kv.allocate_cache(
                np.zeros(64, np.uint8), name="kv", layer_axis=0, block_axis=None
            ).name
            == "kv"
        )
        # A host array is not device memory, whatever the driver says.
        with pytest.raises(hixl.ParamInvalid, match="needs a CUDA array"):
            hixl.kv.allocate_cache(
                np.zeros(64, np.uint8), mem_type="device", layer_axis=0, block_axis=None
            )
    finally:
        hixl.kv.finalize()


@no_gpu
def test_info_says_cuda_not_found() -> None:
    """`hixl info` says once, in its text and its JSON, that CUDA was not found and why."""
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "info"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "CUDA was not found" in r.stdout and "libcuda.so.1" in r.stdout, r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    info = json.loads(r.stdout)
    assert info["cuda"]["available"] is False and info["cuda"]["devices"] == []
    assert info["transports"]["cuda_ipc"]["available"] is False
    assert "CUDA was not found" in info["transports"]["cuda_ipc"]["detail"]
    assert info["transports"]["cuda_staging"]["available"] is False
    assert "CUDA was not found" in info["transports"]["cuda_staging"]["detail"]


@no_gpu
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--mem", "cuda:0", "--quick"],
        ["bench", "--mem", "host,cuda"],
        ["bench", "--role", "target", "--mem", "cuda:1"],
        ["demo", "--device", "cuda"],
    ],
)
def test_cli_device_options_without_cuda_say_unsupported(argv: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hixl", *argv], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Unsupported: CUDA not found" in r.stderr and "libcuda.so.1" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bench_mem_values_are_checked() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "bench", "--mem", "gpu"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "'gpu': memory is host, cuda or cuda:N" in r.stderr, r.stderr


# ---- With a GPU (skipped here, with the reason): two processes, bytes compared on the host.

HERE = Path(__file__).resolve().parent
W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ


class CudaPeer:
    """tests/_cuda_peer.py: a target with a device region, a memfd host region and a plain
    host region, each `size` bytes."""

    def __init__(self, size: int, options: dict[str, str] | None = None) -> None:
        self.size = size
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_cuda_peer.py"), str(size), json.dumps(options or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.addr: dict[str, Any] = json.loads(self.proc.stdout.readline())
        self.engine: str = self.addr["engine"]

    def cmd(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def bytes(self, region: str, tmp: Path) -> bytes:
        path = tmp / f"{region}.bin"
        assert self.cmd(f"save {region} {path}") == "OK"
        return path.read_bytes()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("exit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@pytest.fixture
def peer() -> Any:
    p = CudaPeer(8 << 20)
    yield p
    p.close()


def rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@needs_gpu
def test_device_to_device_between_processes_over_cuda_ipc(peer: CudaPeer, tmp_path: Path) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1")
        src = hixl.cuda_alloc(n, 0)
        src.write(0, rand(n, 1))
        h = e.register(src)
        assert h.domain == "cuda:0" and h.mem_type == MemType.DEVICE
        e.connect(peer.engine, timeout_ms=10_000)
        assert e.stats()[peer.engine]["backend"] == "cuda_ipc"
        assert e.remote_region(peer.engine, "dev").mem_type == MemType.DEVICE
        e.transfer_sync(peer.engine, W, [(src.addr, peer.addr["dev"], n)])
        assert peer.bytes("dev", tmp_path) == rand(n, 1)
        # READ back into other device memory, at an offset.
        assert peer.cmd("fill dev 2") == "OK"
        dst = hixl.cuda_alloc(n + 4096, 0)
        e.register(dst)
        e.transfer_sync(peer.engine, R, [(dst.addr + 4096, peer.addr["dev"], n)])
        assert dst.read(4096, n) == rand(n, 2) and dst.read(0, 4096) == bytes(4096)


@needs_gpu
def test_host_and_device_in_every_pairing(peer: CudaPeer, tmp_path: Path) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1")
        host = np.frombuffer(bytearray(rand(n, 3)), np.uint8)
        e.register(host)
        dev = hixl.cuda_alloc(n, 0)
        dev.write(0, rand(n, 4))
        e.register(dev)
        e.connect(peer.engine, timeout_ms=10_000)
        # H2D: our host memory into the peer's device memory, and back (D2H).
        e.transfer_sync(peer.engine, W, [(int(host.ctypes.data), peer.addr["dev"], n)])
        assert peer.bytes("dev", tmp_path) == rand(n, 3)
        back = np.zeros(n, np.uint8)
        e.register(back)
        e.transfer_sync(peer.engine, R, [(int(back.ctypes.data), peer.addr["dev"], n)])
        assert back.tobytes() == rand(n, 3)
        # Our device memory into the peer's memfd host memory (mapped and pinned here).
        e.transfer_sync(peer.engine, W, [(dev.addr, peer.addr["pinnable"], n)])
        assert peer.bytes("pinnable", tmp_path) == rand(n, 4)
        # ... but not into its plain (pageable) host memory: the documented exception.
        with pytest.raises(hixl.Unsupported, match="alloc"):
            e.transfer_sync(peer.engine, W, [(dev.addr, peer.addr["plain"], n)])
        assert peer.bytes("plain", tmp_path) == bytes(n)
        # Host to host on the same link still goes through shm's path.
        e.transfer_sync(peer.engine, W, [(int(host.ctypes.data), peer.addr["plain"], n)])
        assert peer.bytes("plain", tmp_path) == rand(n, 3)


@needs_gpu
def test_strided_and_many_descriptor_batches_on_device_memory(
    peer: CudaPeer, tmp_path: Path
) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1")
        src = hixl.cuda_alloc(n, 0)
        src.write(0, rand(n, 5))
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        # 1024 scattered 4 KiB blocks, in reverse order at the peer.
        blk, count = 4096, 1024
        descs = [
            (src.addr + i * blk, peer.addr["dev"] + (count - 1 - i) * blk, blk)
            for i in range(count)
        ]
        e.transfer_sync(peer.engine, W, descs)
        got, want = peer.bytes("dev", tmp_path), rand(n, 5)
        for i in range(count):
            j = count - 1 - i
            assert got[j * blk : (j + 1) * blk] == want[i * blk : (i + 1) * blk], i
        # Strided: 256 elements of 1 KiB, remote stride 4 KiB.
        assert peer.cmd("fill dev 6") == "OK"
        e.put_strided(
            peer.engine, src.addr, peer.addr["dev"], hixl.StridedDesc(256, 1024, 1024, 4096)
        )
        got, before = peer.bytes("dev", tmp_path), rand(n, 6)
        for i in range(256):
            assert got[i * 4096 : i * 4096 + 1024] == want[i * 1024 : (i + 1) * 1024], i
            assert (
                got[i * 4096 + 1024 : (i + 1) * 4096] == before[i * 4096 + 1024 : (i + 1) * 4096]
            ), i


@needs_gpu
def test_deregistration_while_copies_are_in_flight_ends_every_request(peer: CudaPeer) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.deregister_timeout_ms": "2000"})
        src = hixl.cuda_alloc(n, 0)
        h = e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        reqs = [
            e.transfer_async(peer.engine, W, [(src.addr, peer.addr["dev"], n)]) for _ in range(64)
        ]
        e.deregister_mem(h)  # waits for the pins (or aborts the link), never hangs
        for r in reqs:
            assert r.wait(30_000) in (hixl.TransferStatus.COMPLETED, hixl.TransferStatus.FAILED)


@needs_gpu
def test_the_owner_deregisters_device_memory_while_a_peer_writes_into_it(peer: CudaPeer) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1")
        src = hixl.cuda_alloc(n, 0)
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        reqs = [
            e.transfer_async(peer.engine, W, [(src.addr, peer.addr["dev"], n)]) for _ in range(64)
        ]
        # The owner's deregistration waits for this engine's confirmation, which waits for the
        # copies already on the GPU; it neither hangs nor fails.
        assert peer.cmd("deregister dev") == "OK"
        for r in reqs:
            assert r.wait(30_000) in (hixl.TransferStatus.COMPLETED, hixl.TransferStatus.FAILED)
        # The region is gone for new transfers.
        with pytest.raises(hixl.ParamInvalid):
            e.transfer_sync(peer.engine, W, [(src.addr, peer.addr["dev"], n)])


@needs_gpu
def test_torch_cuda_tensors_register_as_device_memory() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA")
    t = torch.arange(4096, dtype=torch.float32, device="cuda:0")
    with Hixl() as e:
        e.initialize("127.0.0.1:0")
        # Two regions in one caching-allocator block: each is its own region (the IPC key is
        # the block's handle plus the region's offset in it).
        h = e.register(t[:1024])
        assert (h.addr, h.len, h.domain) == (t.data_ptr(), 4096, "cuda:0")
        h2 = e.register(t[1024:2048])
        assert h2.addr == t.data_ptr() + 4096 and h2.len == 4096
        with pytest.raises(hixl.ParamInvalid, match="contiguous"):
            e.register(t.view(64, 64).t())


@needs_gpu
def test_info_lists_the_gpus_and_a_working_cuda_ipc_path() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hixl", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["cuda"]["available"] and info["cuda"]["devices"], info["cuda"]
    assert info["cuda"]["devices"][0]["ordinal"] == 0 and info["cuda"]["devices"][0]["name"]
    assert info["transports"]["cuda_ipc"]["available"], info["transports"]["cuda_ipc"]


@needs_gpu
def test_bench_with_device_memory_on_both_sides_moves_bytes_over_cuda_ipc() -> None:
    argv = ["bench", "--mem", "cuda:0", "--transport", "cuda_ipc", "--block-sizes", "1M"]
    argv += ["--op", "write", "--iterations", "32", "--json", "-"]
    r = subprocess.run(
        [sys.executable, "-m", "hixl", *argv], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert rows and all(row["transport"] == "cuda_ipc" for row in rows), rows


@needs_gpu
def test_a_peer_killed_mid_copy_fails_every_pending_request_in_time() -> None:
    # Last in the file: a copy into memory of a process that died may leave this process's
    # CUDA context with a sticky error, which no later test here should inherit.
    p = CudaPeer(64 << 20)
    try:
        with Hixl() as e:
            e.initialize(
                "127.0.0.1", {"hixl.transfer_timeout_ms": "10000", "hixl.heartbeat_ms": "200"}
            )
            src = hixl.cuda_alloc(64 << 20, 0)
            e.register(src)
            e.connect(p.engine, timeout_ms=10_000)
            reqs = [
                e.transfer_async(p.engine, W, [(src.addr, p.addr["dev"], 64 << 20)])
                for _ in range(32)
            ]
            p.proc.kill()
            p.proc.wait(10)
            for r in reqs:
                assert r.wait(20_000) != hixl.TransferStatus.WAITING
    finally:
        p.close()
