"""The KV core's executor: a bounded window of engine requests in flight.

Both KV faces move bytes through it: at most ``depth`` requests are submitted and not yet
ended, they end in submission order, and each ends within its own timeout (plus a margin
for the completion to be seen). Nothing here knows a face's error type: a failed request is
handed to ``on_error`` as the engine's ``HixlError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from .._errors import HixlError
from .._errors import Timeout as HixlTimeout
from .._hixl import NotifyDesc, TransferOp, TransferReq, TransferStatus

#: What the caller tracks per request (the face's own request record).
T = TypeVar("T")

#: How long past a request's own timeout its end is waited for before it counts as stuck.
WAIT_MARGIN_MS = 2000


def finish(h: TransferReq, wait_ms: int, stuck: str) -> None:
    """Waits at most `wait_ms` for request `h` to end; raises its HixlError if it failed, or
    hixl.Timeout saying `stuck` if it is still waiting then."""
    st = h.wait(wait_ms)
    if st != TransferStatus.COMPLETED:
        h.result()
        raise HixlTimeout(stuck)


#: One request as a face hands it in: (item, address, op, descriptors, notify, stuck).
Ask = tuple[Any, str, TransferOp, np.ndarray, "NotifyDesc | None", str]


class Entry(Generic[T]):
    """A submitted request: the face's item, the message if it gets stuck, its handle, and
    (on the executor) whether it has settled, when it counts as stuck, and its timer."""

    __slots__ = ("item", "stuck", "h", "settled", "expires", "timer")

    def __init__(self, item: T, stuck: str, h: TransferReq, expires: float = 0.0) -> None:
        self.item, self.stuck, self.h, self.expires = item, stuck, h, expires
        self.settled = False
        self.timer: Any = None


class Requests(Generic[T]):
    """What both windows of the core share: requests of one job on `engine`, at most `depth`
    in flight, each with `timeout_ms`, ended in submission order; ``on_done(item)`` follows
    each completed request, ``on_error(item, exc)`` each failed one (a failed submit
    included; exc is the engine's HixlError). A ``Flight`` also takes ``on_idle()`` (each
    time the last request has ended and none waits) and ``skip(item)`` (a waiting request it
    holds for when its turn comes is dropped); a ``Window`` has no use for them."""

    def __init__(
        self,
        engine: Any,
        depth: int,
        timeout_ms: int,
        on_done: Callable[[T], None],
        on_error: Callable[[T, HixlError], None],
        on_idle: Callable[[], None] | None = None,
        skip: Callable[[T], bool] | None = None,
    ) -> None:
        self.engine, self.depth, self.timeout_ms = engine, max(1, depth), timeout_ms
        self.on_done, self.on_error = on_done, on_error
        self.on_idle, self.skip = on_idle, skip
        self.inflight: deque[Entry[T]] = deque()
        self._setup()

    def _setup(self) -> None:
        """What a kind of window needs besides (called at the end of ``__init__``)."""

    def submit(
        self,
        item: T,
        address: str,
        op: TransferOp,
        descs: np.ndarray,
        notify: NotifyDesc | None = None,
        stuck: str = "request still waiting after its timeout",
    ) -> None:
        """Submits one request (``Window``: first ending the oldest while the window is full;
        ``Flight``: as soon as it has room); `stuck` is the hixl.Timeout's message if it does
        not end within its timeout."""
        self._take((item, address, op, descs, notify, stuck))

    def _take(self, ask: Ask) -> None:
        raise NotImplementedError

    def _submit(self, ask: Ask) -> Entry[T] | None:
        """The submitted request, or None when the submit failed (``on_error`` was called)."""
        item, address, op, descs, notify, stuck = ask
        try:
            h = self.engine.transfer_async(
                address, op, descs, notify=notify, timeout_ms=self.timeout_ms
            )
        except HixlError as exc:
            self.on_error(item, exc)
            return None
        return Entry(item, stuck, h)

    def _end(self, e: Entry[T], wait_ms: int) -> None:
        """Ends `e` (waiting at most `wait_ms`) with ``on_done`` or ``on_error``."""
        try:
            finish(e.h, wait_ms, e.stuck)
        except HixlError as exc:
            self.on_error(e.item, exc)
            return
        self.on_done(e.item)


class Window(Requests[T]):
    """Requests of one job in flight on `engine`, waited for in the caller's thread: at most
    `depth` at a time, ended in submission order, each within its timeout plus
    `WAIT_MARGIN_MS`."""

    def _take(self, ask: Ask) -> None:
        while len(self.inflight) >= self.depth:
            self.reap()
        e = self._submit(ask)
        if e is not None:
            self.inflight.append(e)

    def reap(self, block: bool = True) -> bool:
        """Ends the oldest request (waiting for it unless `block` is False); False if there
        was none to end."""
        if not self.inflight or (
            not block and self.inflight[0].h.status() == TransferStatus.WAITING
        ):
            return False
        self._end(self.inflight.popleft(), self.timeout_ms + WAIT_MARGIN_MS)
        return True

    def drain(self) -> None:
        """Ends every request in flight."""
        while self.reap():
            pass
