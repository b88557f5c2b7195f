"""Device memory over the `tcp` backend: staged through pinned host buffers in chunks
(`hixl.cuda.stage_chunk`, `hixl.cuda.stage_depth`), on the initiator's side and on the
target's. Needs a GPU: every test here skips, with the reason, without CUDA. (Without CUDA the
same paths are covered by `cargo test -p hixl-core engine::stage_tests`, which checks that
both sides refuse with Unsupported "CUDA was not found" and move no byte.)

Each test forces `hixl.backends=tcp` on the initiator, so the two processes of this host talk
over TCP as two hosts would; the bytes are compared on the host afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cuda import CudaPeer, needs_gpu, rand

import hixl
from hixl import Hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
TCP = {"hixl.backends": "tcp"}
# Small slots, so that a few MiB make many chunks and the ring wraps several times.
SMALL = {**TCP, "hixl.cuda.stage_chunk": str(256 << 10), "hixl.cuda.stage_depth": "3"}


@pytest.fixture
def peer() -> Any:
    # The target stages too: it is forced onto tcp as well.
    p = CudaPeer(8 << 20, TCP)
    yield p
    p.close()


@needs_gpu
@pytest.mark.parametrize("opts", [TCP, SMALL], ids=["4MiB-x4", "256KiB-x3"])
def test_device_to_device_over_tcp_staging(peer: CudaPeer, tmp_path: Path, opts: Any) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1", opts)
        src = hixl.cuda_alloc(n, 0)
        src.write(0, rand(n, 11))
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        assert e.stats()[peer.engine]["backend"] == "tcp"
        e.transfer_sync(peer.engine, W, [(src.addr, peer.addr["dev"], n)], timeout_ms=60_000)
        assert peer.bytes("dev", tmp_path) == rand(n, 11)
        # READ back into other device memory at an odd offset, around untouched bytes.
        assert peer.cmd("fill dev 12") == "OK"
        dst = hixl.cuda_alloc(n + 8192, 0)
        e.register(dst)
        e.transfer_sync(peer.engine, R, [(dst.addr + 4097, peer.addr["dev"], n)], timeout_ms=60_000)
        assert dst.read(4097, n) == rand(n, 12)
        assert dst.read(0, 4097) == bytes(4097) and dst.read(4097 + n, 8192 - 4097) == bytes(4095)


@needs_gpu
def test_device_and_host_over_tcp_staging_in_every_pairing(peer: CudaPeer, tmp_path: Path) -> None:
    n = peer.size
    with Hixl() as e:
        e.initialize("127.0.0.1", SMALL)
        host = np.frombuffer(bytearray(rand(n, 21)), np.uint8)
        e.register(host)
        dev = hixl.cuda_alloc(n, 0)
        dev.write(0, rand(n, 22))
        e.register(dev)
        e.connect(peer.engine, timeout_ms=10_000)
        # D2H: device here -> plain host memory there (staged here).
        e.transfer_sync(peer.engine, W, [(dev.addr, peer.addr["plain"], n)], timeout_ms=60_000)
        assert peer.bytes("plain", tmp_path) == rand(n, 22)
        # H2D: host here -> device there (staged by the target).
        e.transfer_sync(
            peer.engine, W, [(host.ctypes.data, peer.addr["dev"], n)], timeout_ms=60_000
        )
        assert peer.bytes("dev", tmp_path) == rand(n, 21)
        # READ device there -> host here, and host there -> device here.
        assert peer.cmd("fill dev 23") == "OK" and peer.cmd("fill plain 24") == "OK"
        e.transfer_sync(
            peer.engine, R, [(host.ctypes.data, peer.addr["dev"], n)], timeout_ms=60_000
        )
        assert host.tobytes() == rand(n, 23)
        e.transfer_sync(peer.engine, R, [(dev.addr, peer.addr["plain"], n)], timeout_ms=60_000)
        assert dev.read(0, n) == rand(n, 24)


@needs_gpu
def test_scattered_and_strided_device_blocks_over_tcp_staging(
    peer: CudaPeer, tmp_path: Path
) -> None:
    n, block = peer.size, 64 << 10
    blocks = n // block
    with Hixl() as e:
        e.initialize("127.0.0.1", SMALL)
        src = hixl.cuda_alloc(n, 0)
        src.write(0, rand(n, 31))
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        # Block i here goes to block (blocks - 1 - i) there, with a notify after the data.
        descs = [
            (src.addr + i * block, peer.addr["dev"] + (blocks - 1 - i) * block, block)
            for i in range(blocks)
        ]
        req = e.transfer_async(peer.engine, W, descs, timeout_ms=60_000)
        assert req.wait(60_000) == hixl.TransferStatus.COMPLETED
        got, want = peer.bytes("dev", tmp_path), rand(n, 31)
        for i in range(blocks):
            j = blocks - 1 - i
            assert got[j * block : (j + 1) * block] == want[i * block : (i + 1) * block], i
        # Strided: every other 4 KiB element of device memory here, packed there.
        dst_before = peer.bytes("dev", tmp_path)
        e.put_strided(
            peer.engine, src.addr, peer.addr["dev"], hixl.StridedDesc(64, 4096, 8192, 4096)
        )
        got = peer.bytes("dev", tmp_path)
        packed = b"".join(want[k * 8192 : k * 8192 + 4096] for k in range(64))
        assert got[: 64 * 4096] == packed and got[64 * 4096 :] == dst_before[64 * 4096 :]
        s = e.stats()[peer.engine]
        assert s["backend"] == "tcp" and s["in_flight"] == 0
