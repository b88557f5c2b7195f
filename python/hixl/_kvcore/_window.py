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


def finish(h: TransferReq, timeout_ms: int, stuck: str) -> None:
    """Waits for request `h` to end; raises its HixlError if it failed, or hixl.Timeout
    saying `stuck` if it is still waiting `WAIT_MARGIN_MS` after its own timeout."""
    st = h.wait(timeout_ms + WAIT_MARGIN_MS)
    if st != TransferStatus.COMPLETED:
        h.result()
        raise HixlTimeout(stuck)


class Window(Generic[T]):
    """Requests of one job in flight on `engine`: at most `depth` at a time, ended in
    submission order. ``on_done(item)`` follows each completed request, ``on_error(item,
    exc)`` each failed one (a failed submit included); neither is called for the others."""

    def __init__(
        self,
        engine: Any,
        depth: int,
        timeout_ms: int,
        on_done: Callable[[T], None],
        on_error: Callable[[T, HixlError], None],
    ) -> None:
        self.engine, self.depth, self.timeout_ms = engine, max(1, depth), timeout_ms
        self.on_done, self.on_error = on_done, on_error
        self.inflight: deque[tuple[T, str, TransferReq]] = deque()

    def submit(
        self,
        item: T,
        address: str,
        op: TransferOp,
        descs: np.ndarray,
        notify: NotifyDesc | None = None,
        stuck: str = "request still waiting after its timeout",
    ) -> None:
        """Submits one request (first ending the oldest while the window is full); `stuck`
        is the hixl.Timeout's message if it does not end within its timeout."""
        while len(self.inflight) >= self.depth:
            self.reap()
        try:
            h = self.engine.transfer_async(
                address, op, descs, notify=notify, timeout_ms=self.timeout_ms
            )
        except HixlError as exc:
            self.on_error(item, exc)
            return
        self.inflight.append((item, stuck, h))

    def reap(self, block: bool = True) -> bool:
        """Ends the oldest request (waiting for it unless `block` is False); False if there
        was none to end."""
        if not self.inflight or (
            not block and self.inflight[0][2].status() == TransferStatus.WAITING
        ):
            return False
        item, stuck, h = self.inflight.popleft()
        try:
            finish(h, self.timeout_ms, stuck)
        except HixlError as exc:
            self.on_error(item, exc)
            return True
        self.on_done(item)
        return True

    def drain(self) -> None:
        """Ends every request in flight."""
        while self.reap():
            pass
