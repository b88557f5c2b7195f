"""hixl.aio.wait_notifies: awaiting notifications a real peer process sends, with the blocking
call's filters and Timeout, no thread per waiter, cancellation that takes nothing, several
loops, and no arrival slept through when another reader (another loop, the KV executor's
thread) resets the engine's notification counter first."""

from __future__ import annotations

import asyncio
import os
import select
import threading
import time
from collections.abc import Iterator

import pytest
from _lineproc import LineProc

import hixl
import hixl.aio
from hixl._kvcore._executor import executor

LOOPS = ["asyncio"]
try:
    import uvloop  # noqa: F401

    LOOPS.append("uvloop")
except ImportError:
    pass


def run(coro_fn, loop_kind: str = "asyncio"):
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(coro_fn())
    return asyncio.run(coro_fn())


@pytest.fixture
def target() -> Iterator[hixl.Hixl]:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
    yield e
    e.finalize()


@pytest.fixture
def sender(target) -> Iterator[LineProc]:
    """A process connected to `target` that sends the notifications it is told to."""
    p = LineProc(["_notify_sender.py", target.local_engine])
    yield p
    p.close()


def sent(sender: LineProc, *names: str) -> None:
    """Has `sender` send one notification per name; returns once the target has them all."""
    answer = sender.cmd("send", *names)
    assert answer.startswith("SENT"), answer


def names(notes: list[hixl.NotifyDesc]) -> list[str]:
    return [n.name for n in notes]


def until(cond, what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_awaiting_gets_what_matches_and_leaves_the_rest(target, sender, loop_kind) -> None:
    async def main() -> tuple[list[str], list[str], list[str]]:
        one = asyncio.create_task(hixl.aio.wait_notifies(target, 10_000, "layer.3"))
        several = asyncio.create_task(hixl.aio.wait_notifies(target, 10_000, ["a", "b"]))
        await asyncio.sleep(0)  # both asleep
        sender.send("send", "other", "b", "layer.3")  # answered below: the loop must run
        got_one, got_several = await one, await several
        any_one = await hixl.aio.wait_notifies(target, 10_000)  # the one nobody took
        return names(got_one), names(got_several), names(any_one)

    assert run(main, loop_kind) == (["layer.3"], ["b"], ["other"])
    assert sender.line().startswith("SENT")
    assert target.get_notifies() == []


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_fifty_waiters_on_one_loop_take_no_thread(target, sender, loop_kind) -> None:
    threads_before = threading.active_count()

    async def main() -> tuple[list[list[str]], int]:
        waiters = [
            asyncio.create_task(hixl.aio.wait_notifies(target, 20_000, f"n{i}")) for i in range(50)
        ]
        await asyncio.sleep(0)  # each has watched the descriptor and is asleep
        most = threading.active_count()
        sender.send("send", *(f"n{i}" for i in reversed(range(50))))
        pending = set(waiters)
        while pending:  # sample the thread count while they wait
            _, pending = await asyncio.wait(pending, timeout=0.01)
            most = max(most, threading.active_count())
        return [names(w.result()) for w in waiters], most

    got, most = run(main, loop_kind)
    assert got == [[f"n{i}"] for i in range(50)]
    assert most == threads_before
    assert sender.line().startswith("SENT")


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_cancelled_wait_takes_nothing(target, sender, loop_kind) -> None:
    async def main() -> None:
        # Cancelled while asleep, with nothing sent yet (asyncio.wait_for's timeout).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(hixl.aio.wait_notifies(target, 10_000, "k"), 0.05)
        # Cancelled after the notification is in the engine and the descriptor readable,
        # before the task ran again: the loop is held here until the target has it.
        task = asyncio.create_task(hixl.aio.wait_notifies(target, 10_000, "k"))
        await asyncio.sleep(0)
        sent(sender, "k")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main, loop_kind)
    assert names(target.wait_notifies(5_000, "k")) == ["k"]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_deadline_raises_timeout_like_the_blocking_call(target, loop_kind) -> None:
    async def main() -> None:
        t0 = time.monotonic()
        with pytest.raises(hixl.Timeout) as one:
            await hixl.aio.wait_notifies(target, 200, "never")
        assert time.monotonic() - t0 >= 0.2
        assert 'no notification named "never" arrived within timeout_ms=200' in str(one.value)
        with pytest.raises(hixl.Timeout, match=r'one of \["x", "y"\].*timeout_ms=0'):
            await hixl.aio.wait_notifies(target, 0, ("x", "y"))
        # Bad arguments are refused before any wait, as the blocking call refuses them.
        with pytest.raises(hixl.ParamInvalid, match="timeout_ms=-1"):
            await hixl.aio.wait_notifies(target, -1)
        with pytest.raises(hixl.ParamInvalid, match="timeout_ms=nan"):
            await hixl.aio.wait_notifies(target, float("nan"))
        with pytest.raises(TypeError, match="'5' is not a number of milliseconds"):
            await hixl.aio.wait_notifies(target, "5")  # type: ignore[arg-type]
        with pytest.raises(hixl.ParamInvalid, match=r"name=\[\]"):
            await hixl.aio.wait_notifies(target, 1000, [])

    run(main, loop_kind)


def test_finalized_engine_raises_failed() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0")
    e.finalize()
    with pytest.raises(hixl.Failed):
        run(lambda: hixl.aio.wait_notifies(e, 1000))


#: A waiter's timeout that no test reaches (its last look at the deadline would find what it
#: slept through), and how long a test gives a waiter to wake once told.
LONG_MS, WOKEN_S = 600_000, 20


def counter_reset(target: hixl.Hixl) -> bool:
    """Whether the engine's notification counter (shared by all its descriptors) is 0."""
    fd = target._notify_fd()
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return not p.poll(0)
    finally:
        os.close(fd)


def test_a_loop_that_did_not_see_the_arrival_is_told_by_the_loop_that_did(target, sender) -> None:
    """Loop B is held while the notification for it arrives and loop A (waiting for another
    name) resets the shared counter: B's own descriptor is no longer readable, yet B's task
    gets its notification because A told it."""
    b_asleep, release_b = threading.Event(), threading.Event()
    out: dict[str, object] = {}

    def loop_b() -> None:
        async def main() -> list[str]:
            task = asyncio.create_task(hixl.aio.wait_notifies(target, LONG_MS, "for-b"))
            await asyncio.sleep(0)
            b_asleep.set()
            release_b.wait(30)  # holds this loop: it cannot see the descriptor meanwhile
            return names(await asyncio.wait_for(task, WOKEN_S))

        try:
            out["b"] = run(main)
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["b"] = exc

    async def loop_a() -> None:
        waiting_a = asyncio.create_task(hixl.aio.wait_notifies(target, LONG_MS, "for-a"))
        await asyncio.sleep(0)
        tb = threading.Thread(target=loop_b)
        tb.start()
        assert await asyncio.to_thread(b_asleep.wait, 30)
        sender.send("send", "for-b")
        while not counter_reset(target) or not sender.lines.qsize():
            await asyncio.sleep(0.005)  # A woke, reset the counter, found nothing for it
        assert sender.line().startswith("SENT")
        release_b.set()
        await asyncio.to_thread(tb.join, 2 * WOKEN_S)
        sent(sender, "for-a")
        assert names(await asyncio.wait_for(waiting_a, WOKEN_S)) == ["for-a"]

    run(loop_a)
    assert out["b"] == ["for-b"]


def test_the_kv_executor_and_a_loop_tell_each_other_when_they_reset_the_counter(
    target, sender
) -> None:
    """The KV executor's thread watches a descriptor of the same engine: when it resets the
    shared counter first, the loop's waiter still wakes; when the loop resets it first, the
    executor's watch still runs."""
    ex = executor()
    seen: list[int] = []
    stop = ex.watch(target._notify_fd(), lambda: seen.append(1))
    try:
        # 1. The executor resets it while the loop is held.
        async def held_loop() -> list[str]:
            task = asyncio.create_task(hixl.aio.wait_notifies(target, LONG_MS, "one"))
            await asyncio.sleep(0)
            before = len(seen)
            sent(sender, "one")
            until(lambda: len(seen) > before, "the executor's watch")  # it has read the fd
            assert counter_reset(target)
            return names(await asyncio.wait_for(task, WOKEN_S))

        assert run(held_loop) == ["one"]

        # 2. The loop resets it while the executor's thread is held.
        hold, held = threading.Event(), threading.Event()
        ex.post(lambda: (held.set(), hold.wait(30)))
        assert held.wait(10)

        async def loop_takes() -> list[str]:
            task = asyncio.create_task(hixl.aio.wait_notifies(target, LONG_MS, "two"))
            await asyncio.sleep(0)  # asleep: the arrival wakes it through its descriptor
            sender.send("send", "two")
            return names(await asyncio.wait_for(task, WOKEN_S))

        before = len(seen)
        try:
            assert run(loop_takes) == ["two"]
            until(lambda: counter_reset(target), "the loop to reset the counter")
        finally:
            hold.set()
        assert sender.line().startswith("SENT")
        until(lambda: len(seen) > before, "the executor's watch after the loop's reset")
    finally:
        stop()
