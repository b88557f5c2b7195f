"""asyncio: `await req` on every request kind, waking the loop through one descriptor (no
thread per request, no polling), with deadlines, cancellation that abandons the wait but not
the transfer, back-pressure instead of ResourceExhausted, several loops, and uvloop."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import hixl
import hixl.aio

LOOPS = ["asyncio"]
try:
    import uvloop  # noqa: F401

    LOOPS.append("uvloop")
except ImportError:
    pass


def run(coro_fn, loop_kind: str):
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(coro_fn())
    return asyncio.run(coro_fn())


def initiator(backend: str, **opts: str) -> hixl.Hixl:
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backend, **opts})
    return e


@pytest.mark.parametrize("loop_kind", LOOPS)
@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_many_concurrent_awaited_transfers_move_every_byte(make_peer, backend, loop_kind) -> None:
    n, block = 256, 4096
    peer = make_peer(n * block)
    e = initiator(backend, **{"hixl.strict_alignment": "0"})  # the peer's buffer is plain numpy
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.random.default_rng(7).integers(0, 256, n * block, dtype=np.uint8)
        back = np.zeros_like(src)
        e.register(src)
        e.register(back)
        threads_before = threading.active_count()

        async def main() -> int:
            # Every kind of request: batches, put/get, strided.
            writes = [
                e.put_async(peer.engine, src.ctypes.data + i * block, peer.addr + i * block, block)
                for i in range(n - 4)
            ]
            await asyncio.gather(*writes)
            await e.transfer_async(
                peer.engine,
                hixl.TransferOp.WRITE,
                [
                    (src.ctypes.data + i * block, peer.addr + i * block, block)
                    for i in (n - 4, n - 3)
                ],  # noqa: E501
            )
            d = hixl.StridedDesc(count=2, size=block, stride=block)
            off = (n - 2) * block
            await e.put_strided_async(peer.engine, src.ctypes.data + off, peer.addr + off, d)
            peak = threading.active_count()
            reads = [
                e.get_async(peer.engine, back.ctypes.data + i * block, peer.addr + i * block, block)
                for i in range(n)
            ]
            await asyncio.gather(*reads)
            return peak

        peak = run(main, loop_kind)
        assert back.tobytes() == src.tobytes()
        assert bytes(peer.read()) == src.tobytes()
        assert peak <= threads_before + 1, "awaiting must not start a thread per request"
    finally:
        e.finalize()


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_await_raises_the_request_error_at_its_deadline(make_peer, loop_kind) -> None:
    peer = make_peer(1 << 16)
    e = initiator("tcp")
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 16, np.uint8)
        e.register(src)

        async def main() -> float:
            req = e.put_async(peer.engine, src.ctypes.data, peer.addr, 1 << 16, timeout_ms=300)
            t0 = time.monotonic()
            with pytest.raises(hixl.Timeout):
                await req
            return time.monotonic() - t0

        with peer.stopped():
            took = run(main, loop_kind)
        assert 0.25 < took < 3.0, took
    finally:
        e.finalize()


def test_cancelling_the_wait_leaves_the_transfer_running(make_peer) -> None:
    peer = make_peer(1 << 16)
    e = initiator("tcp")
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.arange(1 << 16, dtype=np.uint8)
        e.register(src)
        holder: list[hixl.TransferReq] = []

        async def main() -> None:
            req = e.put_async(peer.engine, src.ctypes.data, peer.addr, 1 << 16, timeout_ms=20000)
            holder.append(req)
            task = asyncio.ensure_future(hixl.aio.wait(req))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        with peer.stopped():
            asyncio.run(main())
            assert holder[0].status() == hixl.TransferStatus.WAITING
        assert holder[0].wait(10000) == hixl.TransferStatus.COMPLETED
        assert bytes(peer.read()) == src.tobytes()

        async def again() -> None:
            await holder[0]  # a settled request may be awaited again

        asyncio.run(again())
    finally:
        e.finalize()


def test_awaited_submits_wait_for_room_instead_of_raising(make_peer) -> None:
    import os
    import signal

    n, block = 32, 1 << 20
    peer = make_peer(n * block)
    e = initiator("tcp", **{"hixl.queue_depth": "4"})
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.random.default_rng(3).integers(0, 256, n * block, dtype=np.uint8)
        e.register(src)
        # Plain submits against a stopped target fill the queue and raise.
        reqs = []
        with peer.stopped(), pytest.raises(hixl.ResourceExhausted):
            for _ in range(1000):
                reqs.append(e.put_async(peer.engine, src.ctypes.data, peer.addr, block))
        for r in reqs:
            assert r.wait(10000) == hixl.TransferStatus.COMPLETED

        async def main() -> None:
            await asyncio.gather(
                *(
                    hixl.aio.put(
                        e, peer.engine, src.ctypes.data + i * block, peer.addr + i * block, block
                    )
                    for i in range(n)
                )
            )

        # The same against a target stopped for the first 0.3 s: they wait for room.
        os.kill(peer.proc.pid, signal.SIGSTOP)
        resume = threading.Timer(0.3, os.kill, (peer.proc.pid, signal.SIGCONT))
        resume.start()
        try:
            asyncio.run(main())
        finally:
            resume.join()
            os.kill(peer.proc.pid, signal.SIGCONT)
        assert bytes(peer.read()) == src.tobytes()
    finally:
        e.finalize()


def test_two_loops_in_two_threads_each_get_their_own_results(make_peer) -> None:
    n, block = 64, 4096
    peer = make_peer(2 * n * block)
    e = initiator("tcp")
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.random.default_rng(5).integers(0, 256, 2 * n * block, dtype=np.uint8)
        e.register(src)
        errors: list[BaseException] = []

        def worker(half: int) -> None:
            async def main() -> None:
                base = half * n * block
                await asyncio.gather(
                    *(
                        e.put_async(
                            peer.engine,
                            src.ctypes.data + base + i * block,
                            peer.addr + base + i * block,
                            block,
                        )
                        for i in range(n)
                    )
                )

            try:
                asyncio.run(asyncio.wait_for(main(), 20))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(h,)) for h in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert bytes(peer.read()) == src.tobytes()
    finally:
        e.finalize()


def test_connect_does_not_block_the_loop(make_peer) -> None:
    peer = make_peer(4096)
    e = initiator("tcp")
    try:

        async def main() -> int:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            t = asyncio.ensure_future(ticker())
            await hixl.aio.connect(e, peer.engine, timeout_ms=5000)
            t.cancel()
            return ticks

        assert asyncio.run(main()) >= 1
        assert peer.engine in e.stats()
    finally:
        e.finalize()


def test_one_request_awaited_twice_or_again_after_a_cancel_ends_with_it(make_peer) -> None:
    """A request reports one token: two tasks awaiting it, or a second await after a cancelled
    one, must all end when it does, not at its deadline."""
    peer = make_peer(1 << 16)
    e = initiator("tcp")
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 16, np.uint8)
        e.register(src)

        async def main() -> tuple[float, float]:
            req = e.put_async(peer.engine, src.ctypes.data, peer.addr, 1 << 16, timeout_ms=20_000)
            t0 = time.monotonic()
            await asyncio.gather(hixl.aio.wait(req), hixl.aio.wait(req))
            both = time.monotonic() - t0
            req2 = e.put_async(peer.engine, src.ctypes.data, peer.addr, 1 << 16, timeout_ms=20_000)
            first = asyncio.ensure_future(hixl.aio.wait(req2))
            await asyncio.sleep(0)
            first.cancel()
            t1 = time.monotonic()
            await req2
            return both, time.monotonic() - t1

        both, again = asyncio.run(main())
        assert both < 5 and again < 5, (both, again)  # the deadline was 20 s
    finally:
        e.finalize()
