"""The rdma backend from Python, between two processes, on the software provider
(hixl.rdma.provider=soft: a software RC NIC; no RDMA hardware exists here). Bytes are compared
byte for byte with what the target process holds. Without a device the default (verbs)
provider offers nothing, and forcing it raises Unsupported naming why."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_bytes

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
SOFT = {"hixl.rdma.provider": "soft"}
GUARD = 64


@pytest.fixture
def rdma_engine():
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "rdma", **SOFT})
    yield e
    e.finalize()


@pytest.mark.parametrize("size", [1, 4097, 1 << 20, 9_000_001])
def test_soft_rdma_write_then_read_back(rdma_engine, make_peer, size):
    peer = make_peer(size + 2 * GUARD, SOFT)
    rdma_engine.connect(peer.engine, timeout_ms=5000)
    assert rdma_engine.stats()[peer.engine]["backend"] == "rdma"
    src = random_bytes(size, size)
    rdma_engine.register(src)
    rdma_engine.transfer_sync(
        peer.engine, W, [hixl.TransferOpDesc(src.ctypes.data, peer.addr + GUARD, size)], 30_000
    )
    target = peer.read()
    assert np.array_equal(target[GUARD : GUARD + size], src)
    assert not target[:GUARD].any() and not target[GUARD + size :].any(), "guard bytes"
    back = np.zeros(size, np.uint8)
    rdma_engine.register(back)
    rdma_engine.transfer_sync(
        peer.engine, R, [hixl.TransferOpDesc(back.ctypes.data, peer.addr + GUARD, size)], 30_000
    )
    assert np.array_equal(back, src)


def test_soft_rdma_scattered_batch_and_notify(rdma_engine, make_peer):
    count, slot = 4096, 256
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, slot + 1, count)
    local, remote = rng.permutation(count), rng.permutation(count)
    peer = make_peer(count * slot, SOFT)
    rdma_engine.connect(peer.engine, timeout_ms=5000)
    src = random_bytes(count * slot, 11)
    rdma_engine.register(src)
    rows = np.stack(
        [src.ctypes.data + local * slot, peer.addr + remote * slot, sizes], axis=1
    ).astype(np.uint64)
    req = rdma_engine.transfer_async(peer.engine, W, rows, notify=hixl.NotifyDesc("batch", "done"))
    assert req.wait(30_000) == hixl.TransferStatus.COMPLETED
    target = peer.read()
    want = np.zeros(count * slot, np.uint8)
    for lo, ro, n in zip(local, remote, sizes, strict=True):
        want[ro * slot : ro * slot + n] = src[lo * slot : lo * slot + n]
    assert np.array_equal(target, want)
    assert ["batch", "done"] in peer.notifies()


def test_forced_rdma_without_a_device_is_unsupported(make_peer):
    peer = make_peer(4096)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "rdma"})
        with pytest.raises(hixl.Unsupported) as exc:
            e.connect(peer.engine, timeout_ms=5000)
    assert "rdma" in str(exc.value), exc.value


def test_auto_prefers_rdma_over_tcp_where_both_sides_have_a_device(make_peer):
    # The target offers rdma and tcp only (no same-host path), so auto's order decides.
    peer = make_peer(1 << 16, {"hixl.backends": "rdma,tcp", **SOFT})
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", SOFT)  # hixl.backends=auto
        e.connect(peer.engine, timeout_ms=5000)
        st = e.stats()[peer.engine]
        assert st["backend"] == "rdma", st
        assert "shm: the peer does not offer it" in st["not_chosen"], st
    # Without a device here (the default provider finds none), the same target gets tcp, and
    # the reason rdma was passed over is reported.
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")
        e.connect(peer.engine, timeout_ms=5000)
        st = e.stats()[peer.engine]
        assert st["backend"] == "tcp", st
        assert "rdma:" in st["not_chosen"], st
