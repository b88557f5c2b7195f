"""The process's one completion queue, shared by everything that waits on it.

The extension queues a token on one queue per process when a request that asked for one
(``TransferReq._report``) settles; its descriptor (``_completion_fd``) is readable while tokens
wait. Whoever drains it (an asyncio loop of ``hixl.aio``, the KV core's executor thread)
drains them all, so tokens come from one counter and every drain goes through ``drain``,
which runs the callbacks registered for the tokens it took and returns all of them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from ._hixl import TransferReq, _drain_completions

_tokens = itertools.count(1)
_lock = threading.Lock()
#: token -> callbacks to run (on the draining thread) when it is drained.
_callbacks: dict[int, list[Callable[[], None]]] = {}


def next_token() -> int:
    """A token no other waiter in this process uses."""
    return next(_tokens)


def on_settle(req: TransferReq, callback: Callable[[], None]) -> bool:
    """Runs `callback` (on whichever thread drains the queue; it must be quick and must not
    raise) once `req` has settled. False, and no callback, when it had settled already."""
    token = req._report(next_token())
    if token is None:
        return False
    with _lock:
        _callbacks.setdefault(token, []).append(callback)
    if int(req.status()) == 0:  # WAITING: its token is still to come
        return True
    # It settled meanwhile: its token may have been drained before the callback was listed.
    with _lock:
        waiting = _callbacks.get(token, [])
        if callback not in waiting:
            return True  # a drain ran it already
        waiting.remove(callback)
        if not waiting:
            _callbacks.pop(token, None)
    return False


def drain() -> list[int]:
    """Takes every token waiting on the queue, runs their callbacks and returns them."""
    tokens = _drain_completions()
    for token in tokens:
        with _lock:
            due = _callbacks.pop(token, [])
        for cb in due:
            cb()
    return tokens
