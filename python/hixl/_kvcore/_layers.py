"""The KV core's layerwise feed: a face's layers handed, one at a time, from a thread that
may block (LLM-DataDist's ``synchronize_layer`` is the user's own blocking call) to the
executor, whose one thread completes their requests.

``hixl.kv``'s push needs no thread of its own: ``layer_ready`` wakes its job on the executor
directly (see ``hixl.kv._layerwise``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import Timeout as HixlTimeout
from ._executor import Flight


def feed_layers(
    flight: Flight[Any],
    layers: Iterable[int],
    ready: Callable[[int], bool],
    submit: Callable[[int], None],
    going: Callable[[], bool],
    wait_s: float,
) -> int:
    """For each of `layers` in order while ``going()`` holds: asks ``ready(layer)`` on this
    thread (False: stop), runs ``submit(layer)`` on the executor (it adds the layer's
    requests to `flight`) and waits until all of them have ended, at most `wait_s` (else
    hixl.Timeout), before the next layer. Takes over ``flight.on_idle``. Returns how many
    layers were submitted."""
    sent = 0
    for layer in layers:
        if not going() or not ready(layer):
            break
        ended = threading.Event()
        flight.on_idle = ended.set

        def run(layer: int = layer, ended: threading.Event = ended) -> None:
            try:
                submit(layer)
            finally:
                if flight.idle():
                    ended.set()

        flight.ex.post(run)
        sent += 1
        if not ended.wait(wait_s):
            flight.ex.post(flight.abandon)
            raise HixlTimeout(f"the requests of layer {layer} had not ended after {wait_s:.1f} s")
    return sent
