"""The KV core's notification router: the one place the KV faces take their own
notifications from the engine.

A face takes only the names it owns (every other name stays in the engine for the
application's ``get_notifies`` / ``wait_notifies``), either by asking (``take``: the pending
ones a waiter matches, the others kept for later waiters) or by a loop that hands each to a
handler (``serve``: on the face's own thread, until it says stop). A face that owns its whole
engine (the NIXL agent's: every notification is the agent's, whatever its name) takes them
all at once (``take_all``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .._errors import Failed, HixlError, Timeout
from .._hixl import NotifyDesc


class Router:
    """The notifications of one engine that a KV face owns. At most `keep` that no waiter
    matched wait here; beyond, the oldest are dropped, counted in `dropped` and logged on
    `log` (a face's own logger)."""

    def __init__(self, engine: Any, log: logging.Logger, keep: int = 65536) -> None:
        self.engine = engine
        self.log = log
        self.keep = keep
        self.dropped = 0
        self.pending: list[NotifyDesc] = []
        self.lock = threading.Lock()

    def take(self, name: str, match: Callable[[NotifyDesc], bool]) -> list[NotifyDesc]:
        """The pending notifications named `name` that `match`; the others named `name` wait."""
        with self.lock:
            try:
                self.pending += self.engine.wait_notifies(0, name=name)
            except Timeout:
                pass  # none of ours pending in the engine
            got = [n for n in self.pending if n.name == name and match(n)]
            if got:
                self.pending = [n for n in self.pending if not (n.name == name and match(n))]
            over = len(self.pending) - self.keep
            if over > 0:
                del self.pending[:over]
                self.dropped += over
                self.log.warning(
                    "dropped the %d oldest of the layer's notifications no receive took "
                    "(at most %d wait; %d dropped so far)",
                    over,
                    self.keep,
                    self.dropped,
                )
            return got

    def take_all(self) -> list[NotifyDesc]:
        """Every notification, whatever its name, in arrival order: those waiting here first,
        then every one pending in the engine. Each is handed out once; when the engine call
        fails (finalized), those waiting here stay for the next call and the error rises."""
        with self.lock:
            fresh = self.engine.get_notifies()
            got, self.pending = self.pending + fresh, []
            return got

    def serve(
        self,
        names: list[str],
        handle: Callable[[NotifyDesc], None],
        running: Callable[[], bool],
        wait_ms: int = 200,
    ) -> None:
        """Hands every notification named in `names` to `handle`, in arrival order (the
        names are taken in one wait), while `running()` holds and the engine is up; returns
        when either ends. `handle` raising ValueError, TypeError, KeyError or AttributeError
        (a malformed message: peers are not trusted) skips that notification."""
        while running():
            try:
                notes = self.engine.wait_notifies(wait_ms, name=names)
            except Timeout:
                continue
            except (Failed, HixlError):
                return  # finalized
            for n in notes:
                try:
                    handle(n)
                except (ValueError, TypeError, KeyError, AttributeError):
                    continue
