"""The rdma backend from Python, between two processes. On the software provider
(hixl.rdma.provider=soft: a software RC NIC) by default; with HIXL_RDMA_DEVICE set (a real
device: rxe0 in the VM of scripts/rxe_vm.sh, which CI runs) on the real verbs provider with
that device and HIXL_RDMA_GID_INDEX. Bytes are compared byte for byte with what the target
process holds. Without a device the default (verbs) provider offers nothing, and forcing it
raises Unsupported naming why."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from conftest import random_bytes

import hixl
import hixl.metrics
from hixl._hixl import _rdma_info

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
DEVICE = os.environ.get("HIXL_RDMA_DEVICE", "")
# The provider every test here runs on (named SOFT for history: the software NIC unless a
# device is given).
SOFT = (
    {
        "hixl.rdma.provider": "verbs",
        "hixl.rdma.device": DEVICE,
        "hixl.rdma.gid_index": os.environ.get("HIXL_RDMA_GID_INDEX", "0"),
    }
    if DEVICE
    else {"hixl.rdma.provider": "soft"}
)
no_device_here = pytest.mark.skipif(bool(DEVICE), reason="needs a machine without an RDMA device")
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


@no_device_here
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
        # A next backend (tcp) to fail over to, and no failover yet.
        assert (st["failovers"], st["failover"]) == (0, ""), st
    if DEVICE:
        return
    # Without a device here (the default provider finds none), the same target gets tcp, and
    # the reason rdma was passed over is reported.
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")
        e.connect(peer.engine, timeout_ms=5000)
        st = e.stats()[peer.engine]
        assert st["backend"] == "tcp", st
        assert "rdma:" in st["not_chosen"], st


def test_info_reports_the_device_limits_and_the_queue_sizes_used():
    provider = "verbs" if DEVICE else "soft"
    info = _rdma_info(provider)
    name = DEVICE or "soft0"
    assert info.startswith("devices: ") and f"{name} (port 1 active; " in info, info
    m = re.search(r"device max_cqe (\d+) max_qp_wr (\d+) .*hixl uses CQ (\d+) SQ (\d+)", info)
    assert m, info
    max_cqe, max_qp_wr, cq, sq = map(int, m.groups())
    # What the backend uses fits what the device has (rxe: max_cqe 32767 < the 65536 wanted).
    assert cq == min(65536, max_cqe) and sq == min(512, max_qp_wr, cq), info


@pytest.mark.skipif(
    bool(DEVICE), reason="the soft device's limits are set by an environment variable"
)
def test_a_device_with_small_queues_still_moves_scattered_bytes(make_peer, monkeypatch):
    # 64 CQ entries, 16 send-queue slots and 2 SGEs per request: every queue of the backend is
    # cut to the device, batches wait for slots, pieces split across requests.
    small = "max_cqe=64,max_qp_wr=16,max_sge=2,max_qp_rd_atom=1"
    monkeypatch.setenv("HIXL_SOFT_RDMA_LIMITS", small)
    assert "hixl uses CQ 64 SQ 16 SGE 2/2 READs 1/1" in _rdma_info("soft")
    count, slot = 512, 64
    peer = make_peer(count * slot, SOFT)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "rdma", "hixl.rdma.qps": "4", **SOFT})
        e.connect(peer.engine, timeout_ms=5000)
        src = random_bytes(count * slot, 5)
        e.register(src)
        rng = np.random.default_rng(9)
        order = rng.permutation(count)
        # Remote pieces adjacent, local ones scattered: one remote range chains a local piece
        # per SGE, so every request holds the device's 2 SGEs (a request of more is EINVAL).
        local = src.ctypes.data + order * slot
        remote = peer.addr + np.arange(count) * slot
        rows = np.stack([local, remote, np.full(count, slot)], axis=1).astype(np.uint64)
        assert e.transfer_async(peer.engine, W, rows).wait(30_000) == hixl.TransferStatus.COMPLETED
        want = np.concatenate([src[o * slot : (o + 1) * slot] for o in order])
        assert np.array_equal(peer.read(), want)
        back = np.zeros(count * slot, np.uint8)
        e.register(back)
        rows[:, 0] = back.ctypes.data + order * slot
        assert e.transfer_async(peer.engine, R, rows).wait(30_000) == hixl.TransferStatus.COMPLETED
        assert np.array_equal(back, src)


@pytest.mark.parametrize("busy_us", ["0", "100000"])
def test_sync_requests_complete_whether_the_waiter_or_the_poller_takes_the_completion(
    make_peer, busy_us
):
    """hixl.rdma.busy_poll_us: with it the waiting thread drains the CQ itself, without it the
    completion thread does; both complete every request with the right bytes."""
    opts = {"hixl.backends": "rdma", "hixl.rdma.busy_poll_us": busy_us, **SOFT}
    peer = make_peer(1 << 20, SOFT)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", opts)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = random_bytes(1 << 20, 41)
        back = np.zeros(1 << 20, np.uint8)
        e.register(src)
        e.register(back)
        for i in range(128):
            off = i * 8192
            e.transfer_sync(
                peer.engine, W, [(src.ctypes.data + off, peer.addr + off, 8192)], 10_000
            )
            e.transfer_sync(
                peer.engine, R, [(back.ctypes.data + off, peer.addr + off, 8192)], 10_000
            )
        assert np.array_equal(peer.read(), src)
        assert np.array_equal(back, src)
    finally:
        e.finalize()


def test_busy_poll_option_is_bounded() -> None:
    with pytest.raises(hixl.ParamInvalid, match=r"hixl.rdma.busy_poll_us.*100001"):
        hixl.Hixl().initialize("127.0.0.1", {"hixl.rdma.busy_poll_us": "100001"})


@pytest.mark.skipif(
    bool(DEVICE), reason="the soft device's limits are set by an environment variable"
)
@pytest.mark.parametrize("qps", ["1", "4"])
def test_reads_outstanding_follow_the_peer_that_answers_fewer(make_peer, monkeypatch, qps):
    """The target's device answers 2 READs per QP, the initiator's issues 16: the initiator
    learns the target's depth in the QP exchange and keeps at most 2 READs outstanding per QP.
    A QP that sent a third would fail on the target's responder (as on a NIC), and the READ with
    it. Every READ is compared byte for byte."""
    peer = make_peer(
        1 << 20, SOFT, env={"HIXL_SOFT_RDMA_LIMITS": "max_qp_rd_atom=2,max_qp_init_rd_atom=2"}
    )
    monkeypatch.delenv("HIXL_SOFT_RDMA_LIMITS", raising=False)
    assert "READs 16/16" in _rdma_info("soft")
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "rdma", "hixl.rdma.qps": qps, **SOFT})
        e.connect(peer.engine, timeout_ms=5000)
        src = random_bytes(1 << 20, 17)
        e.register(src)
        e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, 1 << 20)], 30_000)
        back = np.zeros(1 << 20, np.uint8)
        e.register(back)
        # 256 remote ranges of 4 KiB, scattered: 256 READ work requests posted together.
        count, slot = 256, 4096
        order = np.random.default_rng(4).permutation(count)
        rows = np.stack(
            [back.ctypes.data + order * slot, peer.addr + order * slot, np.full(count, slot - 1)],
            axis=1,
        ).astype(np.uint64)
        for _ in range(4):
            back[:] = 0
            req = e.transfer_async(peer.engine, R, rows)
            req.wait(30_000)
            req.result()  # raises the request's error, naming the work completion's status
            got = back.reshape(count, slot)[:, : slot - 1]
            assert np.array_equal(got, src.reshape(count, slot)[:, : slot - 1])


@pytest.mark.skipif(bool(DEVICE), reason="the rail's fault is the soft device's")
def test_a_rail_that_failed_comes_back_when_it_works_again(make_peer, monkeypatch):
    """The target's soft1 goes dark after 20 requests and answers again 1.5 s later: the
    initiator leaves that rail out (its parts complete on soft0), probes it, and puts it back
    in the rotation once a fresh QP answers; stats() says so and the rail carries bytes again.
    Every transfer's bytes are compared, before, during and after."""
    size = 2 << 20
    rails = {"hixl.backends": "rdma", "hixl.rdma.device": "soft0,soft1", **SOFT}
    env = {"HIXL_SOFT_RDMA_DEVICES": "2", "HIXL_SOFT_RDMA_FAIL_AFTER": "soft1:20:1500"}
    peer = make_peer(size, rails, env=env)
    monkeypatch.setenv("HIXL_SOFT_RDMA_DEVICES", "2")
    monkeypatch.delenv("HIXL_SOFT_RDMA_FAIL_AFTER", raising=False)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {**rails, "hixl.rdma.qps": "2"})
        e.connect(peer.engine, timeout_ms=5000)
        src = np.zeros(size, np.uint8)
        back = np.zeros(size, np.uint8)
        e.register(src)
        e.register(back)
        seed = [0]

        def round_trip() -> dict:
            seed[0] += 1
            src[:] = random_bytes(size, seed[0])
            e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], 30_000)
            assert np.array_equal(peer.read(), src), f"WRITE {seed[0]}"
            back[:] = 0
            e.transfer_sync(peer.engine, R, [(back.ctypes.data, peer.addr, size)], 30_000)
            assert np.array_equal(back, src), f"READ {seed[0]}"
            st = e.stats()[peer.engine]
            assert st["errors"] == 0 and st["backend"] == "rdma", st
            return st["rails"][1]

        def until(cond, what: str) -> dict:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = round_trip()
                if cond(r):
                    return r
            raise AssertionError(f"{what} within 30 s: {r}")

        out = until(lambda r: not r["up"], "soft1 left out")
        assert out["out_why"] and out["returns"] == 0, out
        carried = out["bytes"]
        back_in = until(lambda r: r["up"], "soft1 back in the rotation")
        assert back_in["returns"] == 1 and back_in["out_why"] == "", back_in
        for _ in range(4):
            last = round_trip()
        assert last["up"] and last["bytes"] > carried, f"soft1 carries bytes again: {last}"
        prom = hixl.metrics.text(e)
        for name, value in [
            ("hixl_rdma_rail_up", 1),
            ("hixl_rdma_rail_returns_total", 1),
            ("hixl_rdma_rail_bytes_total", last["bytes"]),
        ]:
            m = re.search(rf'^{name}{{[^}}]*device="soft1"}} (\d+)$', prom, re.M)
            assert m and int(m.group(1)) == value, (name, prom)
