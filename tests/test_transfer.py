"""WRITE then READ back real bytes between two processes over TCP, compared byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_bytes

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
GUARD = 64


BOTH = pytest.mark.parametrize("engine", ["tcp", "shm"], indirect=True)


@BOTH
@pytest.mark.parametrize("size", [1, 7, 4096, 65_537, 1 << 20, 5_000_003, 128 << 20])
def test_write_then_read_back(engine, make_peer, size):
    peer = make_peer(size + 2 * GUARD)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(size, size)
    engine.register(src)
    dst_off = GUARD
    engine.transfer_sync(
        peer.engine, W, [hixl.TransferOpDesc(src.ctypes.data, peer.addr + dst_off, size)], 30_000
    )
    target = peer.read()
    assert np.array_equal(target[dst_off : dst_off + size], src)
    assert not target[:dst_off].any() and not target[dst_off + size :].any(), "guard bytes"

    back = np.zeros(size + 2 * GUARD, np.uint8)
    engine.register(back)
    engine.transfer_sync(
        peer.engine,
        R,
        [hixl.TransferOpDesc(back.ctypes.data + GUARD, peer.addr + dst_off, size)],
        30_000,
    )
    assert np.array_equal(back[GUARD : GUARD + size], src)
    assert not back[:GUARD].any() and not back[GUARD + size :].any()


@BOTH
@pytest.mark.parametrize("count", [1, 2, 100, 1024, 8192])
@pytest.mark.parametrize("as_array", [False, True])
def test_scattered_batches(engine, make_peer, count, as_array):
    rng = np.random.default_rng(count)
    slot = 256
    sizes = rng.integers(1, slot + 1, count)
    local_slots = rng.permutation(count)
    remote_slots = rng.permutation(count)
    peer = make_peer(count * slot)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(count * slot, 7)
    engine.register(src)
    rows = np.stack(
        [src.ctypes.data + local_slots * slot, peer.addr + remote_slots * slot, sizes], axis=1
    ).astype(np.uint64)
    descs = rows if as_array else [hixl.TransferOpDesc(*map(int, r)) for r in rows]
    req = engine.transfer_async(peer.engine, W, descs, user_data={"n": count})
    assert req.wait(30_000) == hixl.TransferStatus.COMPLETED
    assert req.user_data == {"n": count}
    expect = np.zeros(count * slot, np.uint8)
    for ls, rs, n in zip(local_slots, remote_slots, sizes, strict=True):
        expect[rs * slot : rs * slot + n] = src[ls * slot : ls * slot + n]
    assert np.array_equal(peer.read(), expect), "scattered write, gaps untouched"

    # READ the same scattered layout back into a fresh buffer.
    back = np.zeros(count * slot, np.uint8)
    engine.register(back)
    rows[:, 0] = back.ctypes.data + local_slots * slot
    engine.transfer_sync(peer.engine, R, rows if as_array else [tuple(map(int, r)) for r in rows])
    want = np.zeros(count * slot, np.uint8)
    for ls, n in zip(local_slots, sizes, strict=True):
        want[ls * slot : ls * slot + n] = src[ls * slot : ls * slot + n]
    assert np.array_equal(back, want)


@BOTH
def test_many_async_requests_complete_individually(engine, make_peer, request):
    peer = make_peer(1 << 20)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(1 << 20, 3)
    engine.register(src)
    reqs = [
        engine.transfer_async(
            peer.engine, W, [(src.ctypes.data + i * 4096, peer.addr + i * 4096, 4096)], user_data=i
        )
        for i in range(256)
    ]
    statuses = engine.get_transfer_status(reqs)
    assert all(s in (hixl.TransferStatus.WAITING, hixl.TransferStatus.COMPLETED) for s in statuses)
    for i, r in enumerate(reqs):
        assert r.wait(10_000) == hixl.TransferStatus.COMPLETED
        assert r.user_data == i
    assert engine.get_transfer_status(reqs[0]) == hixl.TransferStatus.COMPLETED
    assert np.array_equal(peer.read(), src)
    st = engine.stats()[peer.engine]
    assert (
        st["backend"] == request.node.callspec.params["engine"]
        and st["bytes_write"] == 1 << 20
        and st["ops_write"] == 256
    )
    assert st["latency_us"]["count"] == 256


@BOTH
def test_notify_after_transfer_arrives_after_the_bytes(engine, make_peer):
    peer = make_peer(8 << 20)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(8 << 20, 11)
    engine.register(src)
    req = engine.transfer_async(
        peer.engine,
        W,
        [(src.ctypes.data, peer.addr, 8 << 20)],
        notify=hixl.NotifyDesc("kv", "req-1"),
    )
    assert req.wait(10_000) == hixl.TransferStatus.COMPLETED
    assert peer.notifies() == [["kv", "req-1"]]
    assert np.array_equal(peer.read(), src)
    engine.send_notify(peer.engine, hixl.NotifyDesc("done", ""), timeout_ms=5000)
    assert peer.notifies() == [["done", ""]]
    assert peer.notifies() == [], "get_notifies returns and clears"


def test_remote_mems_and_ipv6(make_peer):
    peer = make_peer(4096)
    with hixl.Hixl() as e:
        e.initialize("[::1]:0")
        assert e.local_engine.startswith("[::1]:")
        e.connect(peer.engine, timeout_ms=5000)
        assert e.remote_mems(peer.engine) == [hixl.MemDesc(peer.addr, 4096)]
        with pytest.raises(hixl.AlreadyConnected) as ei:
            e.connect(peer.engine)
        assert ei.value.code == 103903 and peer.engine in str(ei.value)
        e.disconnect(peer.engine)
        assert e.get_async_connect_status(peer.engine) == hixl.AsyncConnectStatus.NOT_CONNECT
        e.connect_async(peer.engine)
        for _ in range(5000):
            s = e.get_async_connect_status(peer.engine)
            if s != hixl.AsyncConnectStatus.CONNECTING:
                break
            import time

            time.sleep(0.001)
        assert s == hixl.AsyncConnectStatus.CONNECTED


def test_batch_status_query_reports_each_final_status_once(engine, make_peer):
    peer = make_peer(64 * 1024)
    engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(64 * 1024, 9)
    engine.register(src)
    reqs = [
        engine.transfer_async(
            peer.engine,
            W,
            [(src.ctypes.data + i * 4096, peer.addr + i * 4096, 4096)],
            user_data=f"blk{i}",
        )
        for i in range(16)
    ]
    for r in reqs:
        assert r.wait(10_000) == hixl.TransferStatus.COMPLETED
    got = engine.get_transfer_status()
    assert sorted(got) == sorted((f"blk{i}", hixl.TransferStatus.COMPLETED) for i in range(16))
    assert engine.get_transfer_status() == [], "final statuses are reported once"
    assert np.array_equal(peer.read(), src)


@pytest.mark.parametrize("backends", ["tcp", "shm,tcp", "self,tcp"])
def test_batch_across_adjacent_regions(backends):
    """Two regions registered back to back at the target, and a batch whose descriptors are
    contiguous on both sides across their boundary: the engine must not merge them into one
    segment that no single region holds (the target would refuse it); the bytes arrive."""
    t = hixl.Hixl()
    t.initialize("127.0.0.1:0", {"hixl.backends": backends})
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backends})
    try:
        big = hixl.aligned_empty(8192)
        big[:] = 0
        t.register(big[:4096], name="first")
        t.register(big[4096:], name="second")
        src = random_bytes(8192, 5)
        e.register(src)
        e.connect(t.local_engine, timeout_ms=5000)
        s, a = src.ctypes.data, big.ctypes.data
        e.transfer_sync(t.local_engine, W, [(s, a, 4096), (s + 4096, a + 4096, 4096)], 5000)
        assert bytes(big) == bytes(src)
    finally:
        e.finalize()
        t.finalize()
