"""Same-host specifics: backend choice and fallback, peer exit during a direct copy.
(Byte-for-byte WRITE/READ over forced shm runs in test_transfer.py, parametrized.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hixl

W = hixl.TransferOp.WRITE
INITIATOR = Path(__file__).with_name("_initiator.py")


def test_auto_picks_shm_on_this_host(make_peer):
    peer = make_peer(4096)
    # Where CUDA is installed, cuda_ipc (which carries host memory through shm's path) comes
    # first; without it, shm.
    no_cuda = hixl.cuda_info()["reason"].startswith("CUDA was not found")
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")  # hixl.backends defaults to auto
        e.connect(peer.engine, timeout_ms=5000)
        assert e.stats()[peer.engine]["backend"] == ("shm" if no_cuda else "cuda_ipc")
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        e.connect(peer.engine, timeout_ms=5000)
        assert e.stats()[peer.engine]["backend"] == "tcp"
    with pytest.raises(hixl.ParamInvalid, match="hixl.backends"):
        hixl.Hixl().initialize("127.0.0.1", {"hixl.backends": "rdma-please"})


def test_backends_are_tried_in_the_order_given(make_peer):
    peer = make_peer(4096)
    for backends, want in [("auto", "shm"), ("shm,tcp", "shm"), ("tcp,shm", "tcp"), ("tcp", "tcp")]:
        with hixl.Hixl() as e:
            e.initialize("127.0.0.1", {"hixl.backends": backends})
            e.connect(peer.engine, timeout_ms=5000)
            assert e.stats()[peer.engine]["backend"] == want, backends
    with pytest.raises(hixl.ParamInvalid, match=r"hixl.backends=.*shm, rdma, tcp"):
        hixl.Hixl().initialize("127.0.0.1", {"hixl.backends": "ib"})


def _can_drop_ptrace() -> str | None:
    if os.geteuid() != 0:
        return "needs root to drop CAP_SYS_PTRACE for the initiator"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    return None


@pytest.mark.skipif(_can_drop_ptrace() is not None, reason=str(_can_drop_ptrace()))
def test_unreachable_target_falls_back_to_tcp_and_refuses_forced_shm(make_peer):
    # The target makes itself non-dumpable, and the initiator runs without CAP_SYS_PTRACE:
    # the kernel refuses cross-memory attach between them, as between two users.
    size = 1 << 20
    peer = make_peer(size, env={"HIXL_TEST_NONDUMPABLE": "1"})
    cmd = [
        "setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace",
        sys.executable, str(INITIATOR), peer.engine, str(peer.addr), str(size),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["auto_backend"] == "tcp"
    assert out["auto_bytes_ok"]
    name, code, msg = out["shm_error"]
    assert (name, code) == ("Unsupported", 103905), msg
    assert "cannot be reached directly" in msg and "Operation not permitted" in msg, msg
    # This process keeps CAP_SYS_PTRACE: it may still use shm to the same target.
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        e.connect(peer.engine, timeout_ms=5000)


def test_peer_exit_during_long_shm_transfers_fails_cleanly(make_peer):
    size = 128 << 20
    peer = make_peer(size)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(size, np.uint8)
        e.register(src)
        errors: list[BaseException] = []
        stop = threading.Event()

        def hammer():
            try:
                while not stop.is_set():
                    e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], 10_000)
            except hixl.HixlError as x:
                errors.append(x)

        t = threading.Thread(target=hammer)
        t.start()
        time.sleep(0.2)
        peer.proc.kill()
        peer.proc.wait(10)
        t.join(20)
        stop.set()
        assert not t.is_alive(), "a transfer hung after the peer died"
        assert errors, "transfers to a dead peer must fail"
        assert isinstance(errors[0], hixl.NotConnected | hixl.Failed), repr(errors[0])
        with pytest.raises(hixl.NotConnected):
            e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, 4096)])


def test_alloc_gives_aligned_shared_memory_that_transfers_and_outlives_deregistration():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with hixl.Hixl() as t, hixl.Hixl() as e:
        t.initialize("127.0.0.1:0")
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        dst = t.alloc(3 << 20)  # rounded up to 4 MiB
        src = e.alloc(1 << 20)
        assert isinstance(dst, np.ndarray) and dst.dtype == np.uint8 and dst.nbytes == 4 << 20
        assert dst.ctypes.data % (2 << 20) == 0 and src.ctypes.data % (2 << 20) == 0
        assert not dst.any(), "zero-filled"
        src[:] = np.random.default_rng(3).integers(0, 256, src.nbytes, dtype=np.uint8)
        e.connect(t.local_engine, timeout_ms=5000)
        assert e.remote_mems(t.local_engine) == [hixl.MemDesc(dst.ctypes.data, 4 << 20)]
        e.transfer_sync(t.local_engine, W, [(src.ctypes.data, dst.ctypes.data + 4096, src.nbytes)])
        assert np.array_equal(dst[4096 : 4096 + src.nbytes], src)
        assert not dst[:4096].any() and not dst[4096 + src.nbytes :].any()
        assert e.stats()[t.local_engine]["direct_parts"] >= 1, "copied through the mapping"
        h = t.register(dst)  # the same range: the handle of the allocation
        t.deregister_mem(h)
        dst[:] = 1  # still mapped: the array holds the memory
        assert dst.sum() == dst.nbytes
        with pytest.raises(hixl.ParamInvalid):
            e.transfer_sync(t.local_engine, W, [(src.ctypes.data, dst.ctypes.data, 16)])
        with pytest.raises(hixl.ParamInvalid, match="size=0"):
            e.alloc(0)
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before, "nothing left in /dev/shm"


def test_async_small_requests_finish_without_anyone_waiting_and_overlap_safely(make_peer):
    """Asynchronous same-host requests are copied by the engine's copy workers, not by the
    submitting thread: they must complete when nobody waits for them (only `status()` is
    polled), including bursts after the workers went to sleep, and requests in flight
    together must each land their own bytes. A thread that waits copies queued parts itself;
    both paths run here."""
    size, n = 16 * 1024, 48
    peer = make_peer(n * size)
    src = np.random.default_rng(7).integers(0, 256, n * size, dtype=np.uint8)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        e.register(src)
        e.connect(peer.engine, timeout_ms=5000)
        for burst in range(3):
            time.sleep(0.05)  # longer than the workers poll: the next burst must wake one
            lo = burst * (n // 3)
            reqs = [
                e.transfer_async(
                    peer.engine, W, [(src.ctypes.data + i * size, peer.addr + i * size, size)]
                )
                for i in range(lo, lo + n // 3)
            ]
            deadline = time.monotonic() + 10
            if burst == 1:
                for r in reqs:  # waiters: they copy queued parts themselves
                    assert r.wait(10_000) == hixl.TransferStatus.COMPLETED
            while any(r.status() == hixl.TransferStatus.WAITING for r in reqs):
                assert time.monotonic() < deadline, "async requests did not finish without a waiter"
                time.sleep(0.0005)
            assert all(r.status() == hixl.TransferStatus.COMPLETED for r in reqs)
    assert np.array_equal(peer.read(), src), "every block landed once, at its place"


def test_a_waiter_copies_small_queued_parts_but_leaves_big_ones_to_the_workers(make_peer):
    """With one copy worker busy on a big part, a thread waiting for a small request copies it
    itself (it finishes long before the big copies), and a waiter never takes on another
    request's big part: its own short timeout still returns on time."""
    big, small = 256 << 20, 4096
    peer = make_peer(big + small)
    src = np.random.default_rng(3).integers(0, 256, big + small, dtype=np.uint8)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "shm", "hixl.shm.threads": "1"})
        e.register(src)
        e.connect(peer.engine, timeout_ms=5000)
        whole = [(src.ctypes.data, peer.addr, big)]
        # Warm the pages up, so that the timed copies below are memory-bound, not page faults.
        e.transfer_sync(peer.engine, W, whole, 30_000)
        t0 = time.monotonic()
        first = e.transfer_async(peer.engine, W, whole, timeout_ms=30_000)  # the worker's
        second = e.transfer_async(peer.engine, W, whole, timeout_ms=30_000)  # queued, big
        tail = [(src.ctypes.data + big, peer.addr + big, small)]
        last = e.transfer_async(peer.engine, W, tail, timeout_ms=30_000)  # queued after it
        t1 = time.monotonic()
        # The waiter pops the big queued part first: it must hand it back, not copy it.
        assert last.wait(1) in (hixl.TransferStatus.WAITING, hixl.TransferStatus.COMPLETED)
        waited = time.monotonic() - t1
        assert last.wait(30_000) == hixl.TransferStatus.COMPLETED
        # Copied by this waiting thread: done while the worker is still on the first big part.
        assert first.status() == hixl.TransferStatus.WAITING, (
            "the small request waited for the big ones"
        )
        for r in (first, second):
            assert r.wait(30_000) == hixl.TransferStatus.COMPLETED
        both = time.monotonic() - t0
    # Two 256 MiB copies take tens of milliseconds here; the 1 ms wait must not have done one.
    assert waited < both / 3, (
        f"a 1 ms wait took {waited * 1e3:.1f} ms (two big copies: {both * 1e3:.1f} ms)"
    )
    assert np.array_equal(peer.read(big, small), src[big:]), "the small request's bytes"
