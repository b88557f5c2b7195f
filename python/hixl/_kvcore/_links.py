"""The KV core's way of linking several peers at once: one thread a peer, all joined."""

from __future__ import annotations

from collections.abc import Callable

from .. import _place


def in_parallel(job: Callable[[int], None], n: int, name: str) -> None:
    """Runs ``job(0)`` ... ``job(n - 1)`` each on a daemon thread called `name` and waits for
    all of them. `job` keeps its own results and errors: one that escapes is that thread's."""
    threads = [_place.thread(job, args=(i,), name=name) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
