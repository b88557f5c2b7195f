"""The KV core's executor: one thread per process that completes the in-flight requests of
every asynchronous KV task, driven by the process's completion queue, not a thread per task.

The thread (``hixl-kv-executor``, started on first use) waits on the completion queue's
descriptor (``hixl._completions``), its own wake pipe and the descriptors it watches for a face
(``watch``: an engine's notification eventfd), at most until its next timer. It runs, in this
order, the callbacks of settled requests, those of the watched descriptors that became readable,
the timers that are due and the jobs posted to it. Everything a face runs there must be quick
and must not block for long: a job that waits holds up every other task's completions (they
still end in the engine; only their callbacks wait).

``Flight`` is the window of one job on it: at most ``depth`` requests submitted and not yet
ended, the others waiting in order; they end in submission order, each within its own
timeout plus ``WAIT_MARGIN_MS`` (its deadline is a timer, as a request past its deadline only
reports itself when asked). A synchronous call keeps the blocking ``Window`` in its own
thread: that is the caller's wait.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _arrivals, _completions, _place
from .._hixl import TransferStatus, _completion_fd
from ._window import WAIT_MARGIN_MS, Ask, Entry, Requests

log = logging.getLogger("hixl.kv")

#: What the caller tracks per request (the face's own request record).
T = TypeVar("T")

#: The longest the thread sleeps without a timer (it wakes for jobs and completions anyway).
IDLE_WAIT_MS = 1000


class Timer:
    """A callback due at a time (time.monotonic()); ``cancel()`` keeps it from running."""

    __slots__ = ("when", "fn", "cancelled")

    def __init__(self, when: float, fn: Callable[[], None]) -> None:
        self.when, self.fn, self.cancelled = when, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class Executor:
    """The process's executor thread: jobs, timers and request completions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        #: Watched descriptors and their callbacks; the poller follows on the thread's next turn.
        self._watched: dict[int, Callable[[], None]] = {}
        self._unwatched: list[int] = []
        #: Told when another reader (an asyncio loop of hixl.aio) reset a notification counter
        #: that the watched descriptors share: the thread may have slept through an arrival.
        self._told: Callable[[], None] = lambda: self.post(self._rerun_watches)
        self._unlisten: Callable[[], None] | None = None

    def on_thread(self) -> bool:
        """Whether the caller is the executor thread."""
        return threading.current_thread() is self._thread

    def post(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the executor thread, after the jobs posted before it. Any thread."""
        with self._lock:
            self._jobs.append(fn)
            self._start()
        self._wake()

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        """Runs `fn` on the executor thread at `when` (time.monotonic()) or soon after."""
        t = Timer(when, fn)
        with self._lock:
            heapq.heappush(self._timers, (when, next(self._seq), t))
            self._start()
        self._wake()
        return t

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Timer:
        """Runs `fn` on the executor thread in `seconds`."""
        return self.call_at(time.monotonic() + seconds, fn)

    def watch(self, fd: int, fn: Callable[[], None]) -> Callable[[], None]:
        """Runs `fn` on the executor thread each time `fd` (an eventfd, which the executor owns
        and closes from now on) becomes readable, after reading it to reset it. Returns the
        function that stops it (any thread; once is enough, again does nothing)."""
        with self._lock:
            self._watched[fd] = fn
            self._start()
            if self._unlisten is None:
                self._unlisten = _arrivals.listen(self._told)
        self._wake()

        def stop() -> None:
            with self._lock:
                # Only this watch's own entry: after its fd was closed the number may be
                # another watch's.
                if self._watched.get(fd) is fn:
                    del self._watched[fd]
                    self._unwatched.append(fd)
            self._wake()

        return stop

    def _follow_watches(self, poller: select.poll, polled: set[int]) -> None:
        """Brings the poller in line with the watched descriptors (on the executor thread:
        a descriptor is closed only after the poller has let it go)."""
        with self._lock:
            watched, gone, self._unwatched = set(self._watched), self._unwatched, []
        for fd in gone:
            if fd in polled:
                poller.unregister(fd)
                polled.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in watched - polled:
            try:
                poller.register(fd, select.POLLIN)
            except (OSError, ValueError) as exc:
                self._drop_broken(fd, exc)
                continue
            polled.add(fd)

    def _ready_watches(self, events: list[tuple[int, int]]) -> None:
        """Resets each watched descriptor that polled readable and runs its callback; then
        tells the other readers of those counters (hixl._arrivals) when it reset one."""
        was_set = False
        for fd, _ in events:
            with self._lock:
                fn = self._watched.get(fd)
            if fn is None:
                continue
            try:
                was_set = _arrivals.reset(fd) or was_set  # False: reset by an earlier turn
            except OSError as exc:  # closed behind our back: must not stop the thread
                self._drop_broken(fd, exc)
            self._run(fn)
        if was_set:
            _arrivals.told(by=self._told)

    def _rerun_watches(self) -> None:
        """Runs every watch's callback (another reader reset the counters they share)."""
        with self._lock:
            fns = list(self._watched.values())
        for fn in fns:
            self._run(fn)

    def _drop_broken(self, fd: int, exc: BaseException) -> None:
        """Stops watching a descriptor that cannot be polled or read (closed on the thread's
        next turn), so that one broken descriptor cannot stop every task's completions. A
        receive that watched it still ends at its gap timer."""
        log.error("the KV executor stops watching descriptor %d: %s", fd, exc)
        with self._lock:
            if self._watched.pop(fd, None) is not None:
                self._unwatched.append(fd)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = _place.thread(self._loop, name="hixl-kv-executor")
            self._thread.start()

    def _wake(self) -> None:
        if not self.on_thread():
            try:
                os.write(self._wfd, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(_completion_fd(), select.POLLIN)
        poller.register(self._rfd, select.POLLIN)
        polled: set[int] = set()
        while True:
            self._follow_watches(poller, polled)
            with self._lock:
                if self._jobs:
                    wait_ms = 0
                elif self._timers:
                    left = (self._timers[0][0] - time.monotonic()) * 1000
                    wait_ms = max(0, min(IDLE_WAIT_MS, int(left) + 1))
                else:
                    wait_ms = IDLE_WAIT_MS
            events = poller.poll(wait_ms)
            try:
                while os.read(self._rfd, 4096):
                    pass
            except BlockingIOError:
                pass
            self._run(_completions.drain)
            self._ready_watches(events)
            now = time.monotonic()
            due: list[Timer] = []
            with self._lock:
                while self._timers and self._timers[0][0] <= now:
                    due.append(heapq.heappop(self._timers)[2])
            for t in due:
                if not t.cancelled:
                    self._run(t.fn)
            with self._lock:
                jobs, self._jobs = self._jobs, deque()
            for fn in jobs:
                self._run(fn)

    @staticmethod
    def _run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # a face's bug must not stop every other task's completions
            log.exception("a KV executor job failed")


_executor: Executor | None = None
_executor_lock = threading.Lock()


def executor() -> Executor:
    """The process's executor (made on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = Executor()
        return _executor


def _forget_after_fork() -> None:
    global _executor
    if _executor is not None and _executor._unlisten is not None:
        _executor._unlisten()
    _executor = None  # the thread did not survive the fork


os.register_at_fork(after_in_child=_forget_after_fork)


class Flight(Requests[T]):
    """The requests of one job in flight on `engine`, completed on the executor thread: at
    most `depth` submitted and not yet ended, the rest waiting in order (``submit``); they end
    in submission order, with the callbacks of ``Requests`` (``on_idle`` and ``skip``
    included). Only the executor thread
    calls its methods; ``abandon()`` ends every callback (the requests still end in the
    engine)."""

    def _setup(self) -> None:
        self.ex = executor()
        self.waiting: deque[Ask] = deque()
        self.abandoned = False

    def _take(self, ask: Ask) -> None:
        self.waiting.append(ask)
        self._pump()

    def idle(self) -> bool:
        """No request in flight and none waiting."""
        return not self.inflight and not self.waiting

    def abandon(self) -> None:
        """No more submissions and no more callbacks."""
        self.abandoned = True
        self.waiting.clear()
        for e in self.inflight:
            if e.timer is not None:
                e.timer.cancel()
        self.inflight.clear()

    def _pump(self) -> None:
        """Ends the settled requests at the head, submits waiting ones while there is room,
        and says when the flight is idle."""
        while not self.abandoned:
            self._reap()
            if not self.waiting or len(self.inflight) >= self.depth:
                break
            ask = self.waiting.popleft()
            if self.skip is not None and self.skip(ask[0]):
                continue
            e: Entry[T] | None = self._submit(ask)
            if e is None:
                continue
            e.expires = time.monotonic() + (self.timeout_ms + WAIT_MARGIN_MS) / 1000
            self.inflight.append(e)
            if _completions.on_settle(e.h, self._poster(e)):
                e.timer = self.ex.call_later(e.h._seconds_left() + 0.001, self._checker(e))
            else:
                e.settled = True  # it had ended already
        if self.idle() and not self.abandoned and self.on_idle is not None:
            self.on_idle()

    def _poster(self, e: Entry[T]) -> Callable[[], None]:
        """The completion callback of `e`: it runs on the draining thread, so it only posts."""
        return lambda: self.ex.post(lambda: self._settle(e))

    def _checker(self, e: Entry[T]) -> Callable[[], None]:
        return lambda: self._check(e)

    def _check(self, e: Entry[T]) -> None:
        """The request's deadline passed: asking its status turns it TIMEOUT (and reports
        it); one still waiting `WAIT_MARGIN_MS` later is stuck."""
        if e.settled or self.abandoned:
            return
        if e.h.status() != TransferStatus.WAITING or time.monotonic() >= e.expires:
            self._settle(e)
        else:
            later = min(e.expires, time.monotonic() + 0.005)
            e.timer = self.ex.call_at(later, self._checker(e))

    def _settle(self, e: Entry[T]) -> None:
        if e.settled or self.abandoned:
            return
        e.settled = True
        if e.timer is not None:
            e.timer.cancel()
        self._pump()

    def _reap(self) -> None:
        """Ends the settled requests at the head of the window, in submission order."""
        while self.inflight and self.inflight[0].settled and not self.abandoned:
            self._end(self.inflight.popleft(), 0)  # settled: no wait
