"""Where hixl's Python threads run: each pins itself, first thing, to its engine's CPU set
(`Hixl.cpus()`: `hixl.cpus`, `HIXL_CPUS`, or the set the thread calling `initialize` could use),
never to whatever mask the thread that started it had (an inference engine may have pinned that
one to a single busy core after `initialize`). Threads with no engine at hand take the set of
the engine initialized last in the process."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from hixl import _hixl


def engine_cpus(engine: Any = None) -> set[int] | None:
    """`engine`'s CPU set, else the last initialized engine's; None when neither is known."""
    if engine is not None:
        try:
            return set(engine.cpus())
        except Exception:  # noqa: BLE001 - not initialized, finalized, or not an engine
            pass
    cpus = _hixl._process_cpus()
    return set(cpus) if cpus else None


def pin_me(cpus: Iterable[int] | None) -> None:
    """Pins the calling thread to `cpus` (nothing when None; a set the kernel refuses, such as
    one a cgroup change took away, leaves the thread where it is)."""
    if cpus:
        try:
            os.sched_setaffinity(threading.get_native_id(), set(cpus))
        except OSError:
            pass


def thread(
    target: Callable[..., object],
    *,
    name: str,
    engine: Any = None,
    args: tuple[Any, ...] = (),
    daemon: bool = True,
) -> threading.Thread:
    """A (not yet started) thread that pins itself to `engine`'s CPU set (see `engine_cpus`,
    read now, in the starting thread) before it runs ``target(*args)``."""
    cpus = engine_cpus(engine)

    def run() -> None:
        pin_me(cpus)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=daemon)
