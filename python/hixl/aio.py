"""asyncio support: await transfers on an event loop without a thread or polling per request.

``await req`` works on every :class:`hixl.TransferReq` (``transfer_async``, ``put_async`` /
``get_async``, the strided variants). It returns ``None`` when the request completed and
raises its error otherwise (:class:`hixl.Timeout` past its deadline, :class:`hixl.Failed`,
...), like ``req.result()`` after ``req.wait()``.

How it waits: the extension keeps one completion queue per process with one eventfd. A request
that is awaited asks to have a token queued there when it settles; every event loop that awaits
hixl requests watches that descriptor (``loop.add_reader``) and, when it becomes readable,
drains the tokens and resolves their futures (on their own loop, if several loops in several
threads await). One descriptor, no thread, no polling. A request's deadline is a timer on its
loop.

Cancelling a task that awaits a request abandons the wait, not the transfer: its bytes may
already be on the wire, so the request runs to its end and its status stays available
(``req.status()``, ``req.wait()``); awaiting it again is allowed.

The helpers below add what an event loop needs beyond ``await req``: ``submit`` (and
``transfer``, ``put``, ``get``, ``put_strided``, ``get_strided``) wait for room when the link's
request queue is full instead of raising :class:`hixl.ResourceExhausted`, ``connect`` runs
a blocking connect off the loop, and ``wait_notifies`` awaits notifications.

How ``wait_notifies`` waits: each loop with tasks waiting for an engine's notifications
watches one notification descriptor of that engine (``Hixl._notify_fd()``, an eventfd that an
arrival makes readable). When it becomes readable, every task of every loop waiting on that
engine wakes and takes what matches its filter with a non-blocking ``wait_notifies(0, name)``
inside the task itself, so a task cancelled before it ran has taken nothing: every
notification stays in the engine for later callers. The engine's descriptors share one
counter, and whoever resets it (a loop here, the KV executor's thread) tells the others
(``hixl._arrivals``), so no reader in another thread sleeps through an arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, SupportsIndex

from . import _arrivals
from ._completions import drain as _drain_completions
from ._completions import next_token
from ._errors import HixlError, ParamInvalid, ResourceExhausted, Timeout
from ._hixl import (
    Hixl,
    NotifyDesc,
    StridedDesc,
    TransferOp,
    TransferReq,
    _completion_fd,
)

__all__ = [
    "connect",
    "get",
    "get_strided",
    "put",
    "put_strided",
    "submit",
    "transfer",
    "wait",
    "wait_notifies",
]

_lock = threading.Lock()
#: token -> the (loop, future, request) of every wait on that request (one token per request:
#: a request awaited twice keeps the token of its first await).
_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]", TransferReq]
_waiting: dict[int, list[_Waiter]] = {}
#: Per loop: an event set whenever a request settles (room may have opened in a queue).
_room: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = (
    weakref.WeakKeyDictionary()
)


def _finish(fut: asyncio.Future[None], req: TransferReq) -> None:
    """Resolves `fut` from the settled request (on the future's own loop)."""
    if fut.done():
        return
    try:
        req.result()
    except HixlError as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


def _resolve(waiters: list[_Waiter], loop: asyncio.AbstractEventLoop | None) -> None:
    """Resolves each waiter on its own loop (at once when that is `loop`)."""
    for owner, fut, req in waiters:
        if owner is loop:
            _finish(fut, req)
            continue
        try:
            owner.call_soon_threadsafe(_finish, fut, req)
        except RuntimeError:
            pass  # that loop has closed: nobody waits there any more


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """The descriptor is readable: resolve every settled request, each on its own loop."""
    tokens = _drain_completions()
    for token in tokens:
        with _lock:
            waiters = _waiting.pop(token, [])
        _resolve(waiters, loop)  # none: its waiters have gone (cancelled, or it settled first)
    if tokens:
        with _lock:
            rooms = list(_room.items())
        for other, room in rooms:
            if other is loop:
                room.set()
            else:
                try:
                    other.call_soon_threadsafe(room.set)
                except RuntimeError:
                    pass  # closed


def _room_event(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """This loop's room event; the first call also starts watching the descriptor."""
    with _lock:
        room = _room.get(loop)
    if room is None:
        loop.add_reader(_completion_fd(), _drain, loop)
        room = asyncio.Event()
        with _lock:
            _room[loop] = room
    return room


def _forget(token: int, fut: asyncio.Future[None]) -> None:
    with _lock:
        rest = [w for w in _waiting.get(token, []) if w[1] is not fut]
        if rest:
            _waiting[token] = rest
        else:
            _waiting.pop(token, None)


def _expire(token: int, fut: asyncio.Future[None], req: TransferReq) -> None:
    """The request's deadline passed: `status()` turns it into TIMEOUT, which reports it."""
    if int(req.status()) != 0:  # no longer WAITING
        _forget(token, fut)
        _finish(fut, req)
    elif not fut.done():  # the loop's clock ran a little ahead of the request's
        fut.get_loop().call_later(0.005, _expire, token, fut, req)


async def wait(req: TransferReq) -> None:
    """Waits for `req` on the running loop; what ``await req`` does. Returns None when it
    completed, raises its error otherwise. A request may be awaited by several tasks, or again
    after a cancelled wait."""
    loop = asyncio.get_running_loop()
    _room_event(loop)
    fut: asyncio.Future[None] = loop.create_future()
    token = req._report(next_token())
    if token is None:  # settled already
        _finish(fut, req)
        return await fut
    with _lock:
        _waiting.setdefault(token, []).append((loop, fut, req))
    # It may have settled (and its token been drained) before this waiter was listed.
    if int(req.status()) != 0:
        _forget(token, fut)
        _finish(fut, req)
        return await fut
    timer = loop.call_later(req._seconds_left() + 0.001, _expire, token, fut, req)
    try:
        return await fut
    finally:
        timer.cancel()
        _forget(token, fut)


async def submit(
    call: Callable[..., TransferReq], *args: Any, room_timeout_ms: float | None = None, **kw: Any
) -> None:
    """Calls ``call(*args, **kw)`` (an engine's ``*_async`` method) and awaits the request.
    While the link's request queue is full (ResourceExhausted), waits on the loop for another
    request to settle and tries again, for up to `room_timeout_ms` (default 10,000 ms), then
    raises that ResourceExhausted."""
    loop = asyncio.get_running_loop()
    room = _room_event(loop)
    deadline: float | None = None
    while True:
        room.clear()
        try:
            req = call(*args, **kw)
        except ResourceExhausted:
            if deadline is None:
                wait_s = 10.0 if room_timeout_ms is None else room_timeout_ms / 1000
                deadline = time.monotonic() + wait_s
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            try:
                await asyncio.wait_for(room.wait(), timeout=min(left, 0.05))
            except TimeoutError:
                pass  # a request settled elsewhere (sync waits) does not set the event
            continue
        await wait(req)
        return


async def transfer(
    engine: Hixl,
    remote: str,
    op: TransferOp | str,
    descs: Any,
    *,
    notify: NotifyDesc | None = None,
    timeout_ms: float | None = None,
) -> None:
    """``transfer_async`` awaited, waiting for queue room instead of raising."""
    await submit(engine.transfer_async, remote, op, descs, notify=notify, timeout_ms=timeout_ms)


async def put(
    engine: Hixl,
    remote: str,
    local: SupportsIndex,
    remote_addr: SupportsIndex,
    n: SupportsIndex,
    timeout_ms: float | None = None,
) -> None:
    """One-sided WRITE of `n` bytes, awaited (``put_async``)."""
    await submit(engine.put_async, remote, local, remote_addr, n, timeout_ms=timeout_ms)


async def get(
    engine: Hixl,
    remote: str,
    local: SupportsIndex,
    remote_addr: SupportsIndex,
    n: SupportsIndex,
    timeout_ms: float | None = None,
) -> None:
    """One-sided READ of `n` bytes, awaited (``get_async``)."""
    await submit(engine.get_async, remote, local, remote_addr, n, timeout_ms=timeout_ms)


async def put_strided(
    engine: Hixl,
    remote: str,
    local: SupportsIndex,
    remote_addr: SupportsIndex,
    desc: StridedDesc,
    timeout_ms: float | None = None,
) -> None:
    """Strided WRITE, awaited (``put_strided_async``)."""
    await submit(engine.put_strided_async, remote, local, remote_addr, desc, timeout_ms=timeout_ms)


async def get_strided(
    engine: Hixl,
    remote: str,
    local: SupportsIndex,
    remote_addr: SupportsIndex,
    desc: StridedDesc,
    timeout_ms: float | None = None,
) -> None:
    """Strided READ, awaited (``get_strided_async``)."""
    await submit(engine.get_strided_async, remote, local, remote_addr, desc, timeout_ms=timeout_ms)


async def connect(engine: Hixl, remote: str, timeout_ms: float | None = None) -> None:
    """``engine.connect`` without blocking the loop: it runs on the loop's default executor
    (a connect is rare and slow; transfers never take this path)."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, lambda: engine.connect(remote, timeout_ms=timeout_ms))


class _NotifyWatch:
    """One loop's watch of one engine's notification descriptor, while tasks of that loop
    wait for that engine's notifications (touched on its loop only, but `loop` and `users`)."""

    __slots__ = ("loop", "engine", "fd", "users", "wakes")

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: Hixl, fd: int) -> None:
        self.loop, self.engine, self.fd, self.users = loop, engine, fd, 0
        #: The futures the waiting tasks sleep on, in the order they began to sleep.
        self.wakes: dict[asyncio.Future[None], None] = {}

    def wake_all(self) -> None:
        """Every waiting task of this loop looks at what is pending (on this loop)."""
        for fut in list(self.wakes):
            _wake_up(fut)


#: (loop, id(engine)) -> its watch (which holds the engine, so the id stays its own).
_notify_watches: dict[tuple[asyncio.AbstractEventLoop, int], _NotifyWatch] = {}
_unlisten: list[Callable[[], None]] = []


def _told() -> None:
    """A notification counter was reset (here or by another reader): every waiting task of
    every loop looks again, each on its own loop. Any thread."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    with _lock:
        watches = list(_notify_watches.values())
    for w in watches:
        if w.loop is running:
            w.wake_all()
            continue
        with contextlib.suppress(RuntimeError):  # that loop has closed
            w.loop.call_soon_threadsafe(w.wake_all)


def _wake_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _on_arrival(w: _NotifyWatch) -> None:
    """`w`'s descriptor is readable: reset it and wake every waiter (others are told)."""
    try:
        was_set = _arrivals.reset(w.fd)
    except OSError:
        was_set = False  # closed under us (the loop closing): its waiters see their deadlines
    if was_set:
        _arrivals.told()  # _told among the listeners: every loop's waiters
    else:
        w.wake_all()


def _watch_notifies(loop: asyncio.AbstractEventLoop, engine: Hixl) -> _NotifyWatch:
    """The loop's watch of `engine`'s notifications, one more user; the first also asks the
    engine for a descriptor (arrivals from then on make it readable) and watches it."""
    key = (loop, id(engine))
    with _lock:
        w = _notify_watches.get(key)
        if not _unlisten:
            _unlisten.append(_arrivals.listen(_told))
    if w is None:
        w = _NotifyWatch(loop, engine, engine._notify_fd())
        try:
            loop.add_reader(w.fd, _on_arrival, w)
        except BaseException:
            os.close(w.fd)
            raise
        with _lock:
            _notify_watches[key] = w
    w.users += 1
    return w


def _unwatch_notifies(w: _NotifyWatch) -> None:
    """One user less; the last one stops watching and closes the descriptor."""
    w.users -= 1
    if w.users > 0:
        return
    with _lock:
        _notify_watches.pop((w.loop, id(w.engine)), None)
    with contextlib.suppress(Exception):  # the loop may be closing
        w.loop.remove_reader(w.fd)
    os.close(w.fd)


def _millis(timeout_ms: Any) -> float:
    """`timeout_ms` as a float, checked as the engine checks it."""
    if isinstance(timeout_ms, (str, bytes, bytearray)):
        raise TypeError(
            f"{timeout_ms!r} is not a number of milliseconds: pass an int or a float (100, 2.5)"
        )
    try:
        t = float(timeout_ms)
    except (TypeError, ValueError):
        raise TypeError(
            f"{timeout_ms!r} is not a number of milliseconds: pass an int or a float (100, 2.5)"
        ) from None
    if not math.isfinite(t) or t < 0:
        raise ParamInvalid(f"timeout_ms={timeout_ms} must be a non-negative number of milliseconds")
    return t


async def wait_notifies(
    engine: Hixl, timeout_ms: float, name: str | Sequence[str] | None = None
) -> list[NotifyDesc]:
    """``engine.wait_notifies(timeout_ms, name)`` on the running loop, without a thread:
    waits until a notification (named `name`, or one of the names of a list or tuple; None:
    any) is pending, then returns every pending one that matches, in arrival order; the others
    stay. Raises :class:`hixl.Timeout` when none came within `timeout_ms` (0: only what is
    pending now), ``ParamInvalid`` for a negative or non-finite `timeout_ms` or an empty list of
    names, ``Failed`` before ``initialize`` or after ``finalize``.

    Cancelling the task takes nothing: the notifications stay in the engine for the next
    caller. Any number of tasks, on one loop or several, may wait on one engine; a notification
    goes to the first of them (in the order they began to wait) whose filter it matches."""
    t = _millis(timeout_ms)
    loop = asyncio.get_running_loop()
    w = _watch_notifies(loop, engine)  # before the first look: later arrivals wake it
    try:
        deadline = loop.time() + t / 1000
        while True:
            try:
                return engine.wait_notifies(0, name)
            except Timeout as exc:
                left = deadline - loop.time()
                if left <= 0:
                    what = exc.message.rsplit(" arrived within ", 1)[0]
                    raise Timeout(f"{what} arrived within timeout_ms={timeout_ms}") from None
            wake: asyncio.Future[None] = loop.create_future()
            w.wakes[wake] = None
            timer = loop.call_at(deadline, _wake_up, wake)
            try:
                await wake
            finally:
                timer.cancel()
                w.wakes.pop(wake, None)
    finally:
        _unwatch_notifies(w)
