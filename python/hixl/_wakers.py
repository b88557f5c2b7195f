"""Futures of asyncio event loops that wait for something a hixl thread finishes (a KV-layer
task's end, a layer's arrival): the thread resolves them with ``call_soon_threadsafe``, so an
awaiting loop needs no thread and no polling of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], bool]]


class Wakers:
    """Waiting futures, each with the condition it waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[_Waiter] = []

    def add(self, ready: Callable[[], bool]) -> asyncio.Future[Any]:
        """A future of the running loop, resolved by the first `wake` after which `ready()`
        holds (call `wake` once right after, in case it holds already)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._waiting.append((loop, fut, ready))
        return fut

    def wake(self, value: Callable[[], Any], error: BaseException | None = None) -> None:
        """Resolves every waiter whose condition holds (all of them with `error`), each on its
        own loop; call after the state changed. Any thread."""
        with self._lock:
            due = [w for w in self._waiting if error is not None or w[2]() or w[1].done()]
            self._waiting = [w for w in self._waiting if w not in due]
        for loop, fut, _ in due:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, fut, value(), error)
