"""The readers of an engine's notification descriptors tell one another that they reset it.

Every descriptor ``Hixl._notify_fd()`` hands out shares one counter (an eventfd): an arrival
makes all of them readable, and the first reader that resets it makes all of them unreadable.
A reader in another thread whose poll had not yet looked (the KV executor's thread, an asyncio
loop of ``hixl.aio`` in its own thread) would then sleep through that arrival. So each kind of
reader listens here, and whoever resets a counter calls ``told``: every other listener looks
again at what is pending. A listener that finds nothing new costs one look; none misses an
arrival.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

_lock = threading.Lock()
_listeners: list[Callable[[], None]] = []


def listen(fn: Callable[[], None]) -> Callable[[], None]:
    """Calls `fn` (from any thread: it must be quick and thread-safe) each time another reader
    reset a notification counter. Returns the function that stops it."""
    with _lock:
        _listeners.append(fn)

    def stop() -> None:
        with _lock, contextlib.suppress(ValueError):
            _listeners.remove(fn)

    return stop


def reset(fd: int) -> bool:
    """Reads `fd` (a non-blocking notification eventfd) to reset it; True when it was set
    (the caller then calls ``told``), False when another reader reset it first."""
    try:
        os.read(fd, 8)
    except BlockingIOError:
        return False
    return True


def told(by: Callable[[], None] | None = None) -> None:
    """A counter was reset: calls every listener but `by` (the caller's own)."""
    with _lock:
        listeners = [fn for fn in _listeners if fn is not by]
    for fn in listeners:
        fn()
