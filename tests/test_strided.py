"""put/get, strided descriptors (64-byte rule, re-packing, padding untouched), aligned buffers,
KV layouts, coalescing: bytes compared against a target in another process."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_bytes

import hixl

BOTH = pytest.mark.parametrize("engine", ["tcp", "shm"], indirect=True)


def aligned_copy(data: np.ndarray) -> np.ndarray:
    out = hixl.aligned_empty(data.nbytes)
    out[:] = data
    return out


@BOTH
def test_put_get_one_range(engine, make_peer):
    peer = make_peer(1 << 16)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(1 << 16, 1)
    engine.register(src)
    engine.put(peer.engine, src.ctypes.data + 10, peer.addr + 100, 5000)
    target = peer.read()
    assert np.array_equal(target[100:5100], src[10:5010])
    assert not target[:100].any() and not target[5100:].any()
    back = np.zeros(5000, np.uint8)
    engine.register(back)
    engine.get(peer.engine, back.ctypes.data, peer.addr + 100, 5000)
    assert np.array_equal(back, src[10:5010])
    req = engine.put_async(peer.engine, src.ctypes.data, peer.addr, 64, user_data="p")
    assert req.wait(5000) == hixl.TransferStatus.COMPLETED and req.user_data == "p"
    req = engine.get_async(peer.engine, back.ctypes.data, peer.addr, 64)
    assert req.wait(5000) == hixl.TransferStatus.COMPLETED
    assert np.array_equal(back[:64], src[:64])


@BOTH
@pytest.mark.parametrize(
    "count,size,stride,rstride",
    [(1, 1, 64, None), (300, 192, 256, 320), (5000, 64, 128, 64), (3, 4096, 4096, 8192)],
)
def test_strided_write_read_repack(engine, make_peer, count, size, stride, rstride):
    rs = rstride or stride
    peer = make_peer(count * rs + 4096)
    engine.connect(peer.engine, timeout_ms=5000)
    src = aligned_copy(random_bytes(count * stride + 64, count))
    engine.register(src)
    base = peer.addr + 64 - peer.addr % 64 if peer.addr % 64 else peer.addr
    off = base - peer.addr
    d = hixl.StridedDesc(count, size, stride, rstride)
    engine.put_strided(peer.engine, src.ctypes.data, base, d, timeout_ms=10_000)
    expect = np.zeros(peer.size, np.uint8)
    for i in range(count):
        expect[off + i * rs : off + i * rs + size] = src[i * stride : i * stride + size]
    assert np.array_equal(peer.read(), expect), "elements placed, padding and guards untouched"
    back = hixl.aligned_empty(count * stride + 64)
    back[:] = 0
    engine.register(back)
    req = engine.get_strided_async(peer.engine, back.ctypes.data, base, d, user_data=1)
    assert req.wait(10_000) == hixl.TransferStatus.COMPLETED
    want = np.zeros_like(back)
    for i in range(count):
        want[i * stride : i * stride + size] = src[i * stride : i * stride + size]
    assert np.array_equal(back, want)


def test_strided_validation_errors(engine, make_peer):
    peer = make_peer(1 << 16)
    engine.connect(peer.engine, timeout_ms=5000)
    src = hixl.aligned_empty(1 << 16)
    engine.register(src)
    a = src.ctypes.data
    r = peer.addr + (-peer.addr) % 64
    cases = [
        (a, r, hixl.StridedDesc(0, 64, 64), "count=0"),
        (a, r, hixl.StridedDesc(2, 0, 64), "size=0"),
        (a, r, hixl.StridedDesc(2, 128, 64), "stride=64 is smaller than size=128"),
        (a, r, hixl.StridedDesc(2, 64, 64, 32), "remote_stride=32"),
        (a + 1, r, hixl.StridedDesc(2, 64, 64), "local_base="),
        (a, r + 8, hixl.StridedDesc(2, 64, 64), "remote_base="),
        (a, r, hixl.StridedDesc(2, 64, 100), "stride=0x64 (100) is not a multiple of 64"),
        (a, r, hixl.StridedDesc(2, 64, 64, 96), "remote_stride=0x60 (96)"),
        (a, r, hixl.StridedDesc(2048, 64, 64), "one region"),
    ]
    for lb, rb, d, words in cases:
        with pytest.raises(hixl.ParamInvalid) as ei:
            engine.put_strided(peer.engine, lb, rb, d)
        assert words in str(ei.value), str(ei.value)
    with pytest.raises(hixl.ParamInvalid, match="count=-1"):
        hixl.StridedDesc(-1, 1, 1)
    assert not peer.read().any(), "nothing was written"


def test_relaxed_alignment(make_peer):
    peer = make_peer(4096)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.strict_alignment": "0", "hixl.backends": "tcp"})
        e.connect(peer.engine, timeout_ms=5000)
        src = random_bytes(4096, 3)
        e.register(src)
        e.put_strided(
            peer.engine, src.ctypes.data + 3, peer.addr + 5, hixl.StridedDesc(10, 7, 13, 11)
        )
        t = peer.read()
        for i in range(10):
            assert np.array_equal(t[5 + i * 11 : 12 + i * 11], src[3 + i * 13 : 10 + i * 13])


def test_aligned_empty_and_kv_layout():
    a = hixl.aligned_empty((3, 7), np.float32, alignment=256)
    assert a.shape == (3, 7) and a.dtype == np.float32 and a.ctypes.data % 256 == 0
    with pytest.raises(hixl.ParamInvalid, match="alignment=3"):
        hixl.aligned_empty(8, alignment=3)
    lay = hixl.kv.KVLayout(32, 8, 96, np.float16, block_tokens=16, num_blocks=4)
    assert (lay.head_bytes, lay.head_stride) == (192, 256)
    assert lay.nbytes == 32 * 2 * 4 * 16 * 8 * 256
    off, d = lay.layer_desc(1)
    assert off == lay.layer_stride and (d.count, d.size, d.stride) == (2 * 4 * 16 * 8, 192, 256)
    runs = lay.block_descs([0, 1, 3], layers=range(1))
    assert [(o, x.count) for o, x in runs] == [
        (0, 2 * 16 * 8), (3 * lay.block_stride, 16 * 8),
        (lay.kv_stride, 2 * 16 * 8), (lay.kv_stride + 3 * lay.block_stride, 16 * 8),
    ]  # fmt: skip
    with pytest.raises(hixl.ParamInvalid, match="head=8"):
        lay.head_desc(0, 8)


@BOTH
def test_kv_layer_strided_equals_head_by_head(engine, make_peer):
    lay = hixl.kv.KVLayout(32, 8, 96, np.float16, block_tokens=4, num_blocks=2)
    peer = make_peer(2 * lay.nbytes + 4096)
    engine.connect(peer.engine, timeout_ms=5000)
    src = lay.empty()
    src[:] = random_bytes(lay.nbytes, 32)
    engine.register(src)
    base = peer.addr + (-peer.addr) % 4096
    ref = base + lay.nbytes
    for layer in range(32):  # one strided call per layer ...
        off, d = lay.layer_desc(layer)
        engine.put_strided(peer.engine, src.ctypes.data + off, base + off, d)
        for head in range(8):  # ... versus one call per head, into the second copy
            off, d = lay.head_desc(layer, head)
            engine.put_strided(peer.engine, src.ctypes.data + off, ref + off, d)
    o = base - peer.addr
    t = peer.read(o, 2 * lay.nbytes)
    assert np.array_equal(t[: lay.nbytes], t[lay.nbytes :]), "layer calls == head-by-head"
    rows = t[: lay.nbytes].reshape(-1, lay.head_stride)
    want = src.reshape(-1, lay.head_stride)
    assert np.array_equal(rows[:, :192], want[:, :192]), "every head row arrived"
    assert not rows[:, 192:].any(), "padding was never written"


def test_coalescing_keeps_individual_completion(make_peer):
    peer = make_peer(1 << 20)
    with hixl.Hixl() as e:
        e.initialize(
            "127.0.0.1",
            {
                "hixl.backends": "tcp",
                "hixl.tcp.coalesce_us": "100",
                "hixl.tcp.coalesce_max_ops": "32",
            },
        )
        e.connect(peer.engine, timeout_ms=5000)
        src = random_bytes(1 << 20, 4)
        e.register(src)
        reqs = [
            e.put_async(peer.engine, src.ctypes.data + i * 4096, peer.addr + i * 4096, 4096,
                        user_data=i)
            for i in range(256)
        ]  # fmt: skip
        assert [r.wait(10_000) for r in reqs] == [hixl.TransferStatus.COMPLETED] * 256
        assert [r.user_data for r in reqs] == list(range(256))
        assert np.array_equal(peer.read(), src)
