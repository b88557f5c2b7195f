"""Peers that freeze or die mid-transfer: every pending request ends within its timeout, new
transfers fail clearly, other peers are unaffected, and a restarted peer works again."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from conftest import Lateness, random_bytes

import hixl

W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
ENDED = {hixl.TransferStatus.COMPLETED, hixl.TransferStatus.FAILED, hixl.TransferStatus.TIMEOUT}


def error_of(req: hixl.TransferReq) -> hixl.HixlError | None:
    try:
        req.result()
    except hixl.HixlError as exc:
        return exc
    return None


def wait_not_connected(
    e: hixl.Hixl, peer: str, src: np.ndarray, remote: int, within_s: float
) -> float:
    """Seconds until a new transfer to `peer` raises NotConnected (fails the test after
    `within_s`)."""
    t0 = time.monotonic()
    while True:
        try:
            e.transfer_sync(peer, W, [(src.ctypes.data, remote, 4096)], timeout_ms=200)
        except hixl.NotConnected:
            return time.monotonic() - t0
        except hixl.Timeout:
            pass
        assert time.monotonic() - t0 < within_s, (
            "transfers to the dead peer never said NotConnected"
        )
        time.sleep(0.02)


def test_frozen_peer_is_declared_dead_within_three_heartbeats(make_peer) -> None:
    size = 64 << 20
    peer = make_peer(size)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "200"})
    try:
        src = random_bytes(size, 3)
        e.register(src)
        e.connect(peer.engine, timeout_ms=5000)
        with peer.stopped(), Lateness() as late:
            t0 = time.monotonic()
            req = e.transfer_async(
                peer.engine, W, [(src.ctypes.data, peer.addr, size)], timeout_ms=30_000
            )
            st = req.wait(10_000)
            took = time.monotonic() - t0
            assert st == hixl.TransferStatus.FAILED, st
            assert "stopped answering" in str(error_of(req))
            print(f"fault: frozen peer, heartbeat 200 ms: request failed after {took:.3f} s")
            # 3 to 4 intervals (0.8 s), with room for the write itself, and for how late this
            # process ran (a late sample gives the peer one more interval).
            bound = 2.5 + 2 * late.worst
            assert took < bound, f"declared dead after {took:.2f} s (3 x 200 ms expected)"
            with pytest.raises(hixl.NotConnected, match="stopped answering"):
                e.put(peer.engine, src.ctypes.data, peer.addr, 4096)
        # Resumed, the peer is reachable again through a new connect.
        e.connect(peer.engine, timeout_ms=5000)
        e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, size)], timeout_ms=20_000)
        assert (peer.read() == src).all()
    finally:
        e.finalize()


def test_idle_frozen_peer_is_declared_dead_within_four_intervals(make_peer) -> None:
    # README (hixl.heartbeat_ms): dead at the third sample without progress, between 3 and 4
    # intervals after the peer stopped; 4 intervals is the worst case. Several freezes, as
    # where it falls between two samples differs from one to the next. A sample this process
    # takes late counts no miss and gives the peer one more interval (docs/RELIABILITY.md), so
    # the bound grows by one interval when this process ran late, and by how late it ran.
    every = 0.5
    margin = 0.3  # this loop's own polling and wake-ups
    peer = make_peer(4096)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "500"})
    took, bounds = [], []
    try:
        for _ in range(8):
            e.connect(peer.engine, timeout_ms=5000)
            time.sleep(3 * every)  # a few heartbeats answered
            with peer.stopped(), Lateness() as late:
                t0 = time.monotonic()
                while e.stats()[peer.engine]["alive"]:
                    assert time.monotonic() - t0 < 20, "the frozen peer was never declared dead"
                    time.sleep(0.002)
                took.append(time.monotonic() - t0)
            extra = late.worst + (every if late.worst > every / 2 else 0.0)
            bounds.append(4 * every + margin + extra)
    finally:
        e.finalize()
    print(f"fault: idle frozen peer, heartbeat 500 ms: declared dead after {max(took):.3f} s")
    pairs = zip(took, bounds, strict=True)
    over = [f"{t / every:.2f} intervals > {b / every:.2f}" for t, b in pairs if t > b]
    assert not over, over


def test_idle_link_to_a_frozen_peer_dies_and_a_busy_live_one_does_not(make_peer) -> None:
    # 250 ms heartbeats: a live peer starved of CPU for three of them (a loaded 2-core
    # machine does that to 100 ms ones) would be indistinguishable from a frozen one, whose
    # socket takes nothing either; the frozen one still dies within about a second.
    size = 256 << 20
    live, frozen = make_peer(size), make_peer(4096)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "250"})
    try:
        src = random_bytes(size, 4)
        e.register(src)
        e.connect(live.engine, timeout_ms=5000)
        e.connect(frozen.engine, timeout_ms=5000)
        with frozen.stopped():
            # A long stream of big writes to the live peer (many heartbeat intervals long),
            # until the idle link to the frozen one died...
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5 or e.stats()[frozen.engine]["alive"]:
                assert time.monotonic() - t0 < 30, "the idle link to the frozen peer lived on"
                e.transfer_sync(live.engine, W, [(src.ctypes.data, live.addr, size)], 30_000)
            # ...never looks like silence.
            assert e.stats()[live.engine]["alive"]
            assert not e.stats()[frozen.engine]["alive"]
        assert (live.read() == src).all()
    finally:
        e.finalize()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_sigkill_mid_transfer_then_restart_on_the_same_address(
    make_peer, free_port, transport: str
) -> None:
    size = 64 << 20
    addr = f"127.0.0.1:{free_port}"
    victim = make_peer(size, env={"HIXL_TEST_LISTEN": addr})
    bystander = make_peer(size)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": transport})
    try:
        src = random_bytes(size, 5)
        e.register(src)
        e.connect(victim.engine, timeout_ms=5000)
        e.connect(bystander.engine, timeout_ms=5000)
        assert e.stats()[victim.engine]["backend"] == transport

        # The bystander keeps transferring the whole time; every one must succeed.
        stop, errors, rounds = threading.Event(), [], [0]

        def other() -> None:
            try:
                while not stop.is_set():
                    e.transfer_sync(
                        bystander.engine, W, [(src.ctypes.data, bystander.addr, size)], 20_000
                    )
                    rounds[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        th = threading.Thread(target=other)
        th.start()
        timeout_ms = 5000
        reqs = [
            e.transfer_async(
                victim.engine, W, [(src.ctypes.data, victim.addr, size)], timeout_ms=timeout_ms
            )
            for _ in range(32)
        ]
        time.sleep(0.02)
        t0 = time.monotonic()
        victim.proc.kill()
        victim.proc.wait()
        statuses = [r.wait(timeout_ms + 2000) for r in reqs]
        ended_after = time.monotonic() - t0
        assert set(statuses) <= ENDED, statuses
        failed = [
            r for r, st in zip(reqs, statuses, strict=True) if st != hixl.TransferStatus.COMPLETED
        ]
        assert failed, "every request finished before the kill: nothing was tested"
        assert ended_after < timeout_ms / 1000 + 1, (
            f"pending requests ended after {ended_after:.1f} s"
        )
        detect = wait_not_connected(e, victim.engine, src, victim.addr, within_s=5)
        print(
            f"fault: SIGKILL over {transport}: {len(failed)} pending ended within "
            f"{ended_after:.3f} s; NotConnected after {detect:.3f} s more"
        )
        stop.set()
        th.join(60)
        assert not errors, errors
        assert rounds[0] >= 1
        assert (bystander.read() == src).all()

        # The peer comes back on the same address: connect works again and bytes are right.
        again = make_peer(size, env={"HIXL_TEST_LISTEN": addr})
        assert again.engine == victim.engine
        e.connect(again.engine, timeout_ms=5000)
        e.transfer_sync(again.engine, W, [(src.ctypes.data, again.addr, size)], 20_000)
        assert (again.read() == src).all()
    finally:
        e.finalize()


def test_garbage_collected_request_and_buffer_while_pending(make_peer) -> None:
    size = 64 << 20
    peer = make_peer(size)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        src = random_bytes(size, 6)
        expected = src.copy()
        h = e.register(src)
        del src  # the engine keeps the registered buffer alive
        gc.collect()
        e.connect(peer.engine, timeout_ms=5000)
        for _ in range(8):
            e.transfer_async(peer.engine, W, [(h.addr, peer.addr, size)])  # dropped at once
        gc.collect()
        # Nobody holds the requests any more, yet they run to the end and nothing crashes.
        deadline = time.monotonic() + 30
        while not (peer.read() == expected).all():
            assert time.monotonic() < deadline, "dropped requests never finished"
            time.sleep(0.05)
        # The bytes are at the target before its Ack is back: the request (and the count of
        # completed writes) ends a moment later.
        while e.stats()[peer.engine]["ops_write"] < 1:
            assert time.monotonic() < deadline, "dropped requests never completed"
            time.sleep(0.05)
        e.deregister_mem(h)  # now the buffer may go
        gc.collect()
        assert peer.read(0, 16).size == 16
    finally:
        e.finalize()
    e.finalize()  # twice is fine
    with pytest.raises(hixl.Failed, match="finalized"):
        e.connect(peer.engine)
