"""The KV core's layerwise engine: a cache's layers sent as they become ready, each
layer's requests on the core's window.

A face says which layer is ready next (``ready``: the layer, or None when none is yet; it
may raise, or make ``going`` false, to stop), how to submit one layer's requests
(``submit``) and whether a layer must be complete before the next is asked for
(``layer_at_a_time``). Requests that end while the engine waits for the next layer are
reaped at once, so their completions are noted as they happen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._window import Window


def send_layers(
    window: Window[Any],
    total: int,
    ready: Callable[[bool], int | None],
    submit: Callable[[int], None],
    going: Callable[[], bool],
    layer_at_a_time: bool = False,
) -> int:
    """Sends up to `total` layers: asks ``ready(busy)`` (busy: requests are in flight, so
    it should not wait long) for the next one and submits it, while ``going()`` holds.
    Ends every request in flight before it returns; returns how many layers it submitted."""
    sent = 0
    while sent < total and going():
        while window.reap(block=False):
            pass
        k = ready(bool(window.inflight))
        if k is None:
            continue
        submit(k)
        sent += 1
        if layer_at_a_time:
            window.drain()
    window.drain()
    return sent
