"""The KV core's notification router: the one place the KV faces take their own
notifications from the engine.

A face takes only the names it owns (every other name stays in the engine for the
application's ``get_notifies`` / ``wait_notifies``), either by asking (``take``: the pending
ones a waiter matches, the others kept for later waiters) or by a loop that hands each to a
handler (``serve``: on the face's own thread, until it says stop). A face that owns its whole
engine (the NIXL agent's: every notification is the agent's, whatever its name) takes them
all at once (``take_all``).

Taking a notification out of the engine frees its part of the engine's budget (the options
``hixl.max_notifies``, ``hixl.max_notify_bytes``, ``hixl.max_notifies_total``,
``hixl.max_notify_bytes_total``), so what the router keeps for later counts against a budget
of the same sizes (:class:`Budget`, from the engine's options), per sender and in all; a face
says which of its notifications a later waiter could ever take (``take``'s `keep`), and the
others are dropped at once, counted and logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import Failed, HixlError, Timeout
from .._hixl import NotifyDesc, option_keys
from .._peertext import shown

#: The engine options that bound its pending notifications, in Budget's field order.
BUDGET_OPTIONS = (
    "hixl.max_notifies",
    "hixl.max_notify_bytes",
    "hixl.max_notifies_total",
    "hixl.max_notify_bytes_total",
)


@dataclass(frozen=True)
class Budget:
    """How many notifications (and bytes of names and messages) a router may keep, per sender
    and in all: the engine's own limits (`of` reads them from its options)."""

    per_peer: int
    per_peer_bytes: int
    total: int
    total_bytes: int

    @classmethod
    def of(cls, options: Mapping[str, Any] | None) -> Budget:
        """The budget of an engine initialized with `options` (its defaults where unset)."""
        defaults = {k: d for k, d, _ in option_keys()}
        opts = dict(options or {})
        vals = []
        for key in BUDGET_OPTIONS:
            raw = opts.get(key, defaults[key])
            try:
                vals.append(int(str(raw).strip()))
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not an integer") from None
        return cls(*vals)


def size(n: NotifyDesc) -> int:
    """The bytes a notification counts as (name and message, UTF-8), as the engine counts."""
    return len(n.name.encode()) + len(n.msg.encode())


class Router:
    """The notifications of one engine that a KV face owns. Those no waiter matched wait here
    within `budget` (the engine's limits, per sender and in all; the default ones unless
    given); beyond, and those a waiter's `keep` refuses, are dropped, counted in `dropped`
    and logged on `log` (a face's own logger), one line per take."""

    def __init__(self, engine: Any, log: logging.Logger, budget: Budget | None = None) -> None:
        self.engine = engine
        self.log = log
        self.budget = budget or Budget.of(None)
        self.dropped = 0
        self.pending: list[NotifyDesc] = []
        #: bytes of `pending` in all, and (count, bytes) of it per sender
        self.held_bytes = 0
        self.held: dict[str, tuple[int, int]] = {}
        self.lock = threading.Lock()

    def take(
        self,
        name: str,
        match: Callable[[NotifyDesc], bool],
        keep: Callable[[NotifyDesc], bool] | None = None,
    ) -> list[NotifyDesc]:
        """The pending notifications named `name` that `match`. Of the others named `name`,
        those `keep` accepts (all when it is None: a later waiter may take them) wait here
        within the budget; the rest are dropped."""
        with self.lock:
            try:
                fresh = self.engine.wait_notifies(0, name=name)
            except Timeout:
                fresh = []  # none of ours pending in the engine
            got = [n for n in self.pending if n.name == name and match(n)]
            if got:
                self.pending = [n for n in self.pending if not (n.name == name and match(n))]
                self._recount()
            refused = over = 0
            for n in fresh:
                if n.name == name and match(n):
                    got.append(n)
                elif keep is not None and not keep(n):
                    refused += 1
                elif not self._hold(n):
                    over += 1
            if refused or over:
                self.dropped += refused + over
                self.log.warning(
                    "dropped %d notifications named %r that no receive here will take and %d "
                    "over the budget of those kept for later (%d per sender, %d bytes; %d, %d "
                    "bytes in all); %d dropped so far",
                    refused,
                    name,
                    over,
                    self.budget.per_peer,
                    self.budget.per_peer_bytes,
                    self.budget.total,
                    self.budget.total_bytes,
                    self.dropped,
                )
            return got

    def _hold(self, n: NotifyDesc) -> bool:
        """Keeps `n` for a later waiter when the budget allows (the caller holds the lock)."""
        b, nbytes = self.budget, size(n)
        count, held = self.held.get(n.peer, (0, 0))
        if (
            count >= b.per_peer
            or held + nbytes > b.per_peer_bytes
            or len(self.pending) >= b.total
            or self.held_bytes + nbytes > b.total_bytes
        ):
            return False
        self.pending.append(n)
        self.held[n.peer] = (count + 1, held + nbytes)
        self.held_bytes += nbytes
        return True

    def _recount(self) -> None:
        self.held, self.held_bytes = {}, 0
        for n in self.pending:
            count, held = self.held.get(n.peer, (0, 0))
            nbytes = size(n)
            self.held[n.peer] = (count + 1, held + nbytes)
            self.held_bytes += nbytes

    def take_all(self) -> list[NotifyDesc]:
        """Every notification, whatever its name, in arrival order: those waiting here first,
        then every one pending in the engine. Each is handed out once; when the engine call
        fails (finalized), those waiting here stay for the next call and the error rises."""
        with self.lock:
            fresh = self.engine.get_notifies()
            got, self.pending = self.pending + fresh, []
            self._recount()
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
        when either ends. Whatever `handle` raises for one notification (peers are not
        trusted: a malformed message is refused by raising) is logged with its sender and
        that notification is dropped; the loop goes on, since it serves every peer."""
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
                except Exception as exc:  # noqa: BLE001 - one message never ends the loop
                    self.dropped += 1
                    self.log.warning(
                        "dropped a notification %r from %r: %s: %s",
                        n.name,
                        n.peer,
                        type(exc).__name__,
                        shown(str(exc)),
                    )
