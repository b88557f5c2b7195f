"""hixl's log records in Python's ``logging``: under the ``hixl`` logger (``hixl.core.*``
children, named after the Rust module), so that applications route them like any other
library's.

The engine's threads format each record into a bounded queue (4,096 records) and go on: they
never take the GIL. One daemon thread here takes the records in batches and hands them to
``logging``; records lost while the queue was full are counted (``hixl.log_dropped()``) and
reported with one WARNING. ``HIXL_LOG_LEVEL`` (and ``hixl.set_log_level``) still choose which
records are made at all, and set the ``hixl`` logger's level to match. When no handler would
show a record (the application configured no logging), it goes to stderr as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from . import _hixl, _place

#: hixl level rank (0 ERROR .. 3 DEBUG) -> logging level.
LEVELS = [logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]

logger = logging.getLogger("hixl")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (it may be replaced)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


_fallback = _Stderr()
_fallback.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
#: Test hook: while cleared, the drain thread leaves records queued (to prove drops are
#: counted); set otherwise.
_running = threading.Event()
_running.set()
_emit_lock = threading.Lock()
_reported_drops = 0


def _logger_for(target: str) -> logging.Logger:
    """``hixl_core::transport::tcp`` -> ``hixl.core.transport.tcp``."""
    name = target.replace("hixl_core", "core", 1).replace("::", ".")
    return logging.getLogger(f"hixl.{name}")


def _emit(records: list[tuple[int, str, str]]) -> None:
    global _reported_drops
    with _emit_lock:
        dropped = _hixl.log_dropped()
        if dropped > _reported_drops:
            n, _reported_drops = dropped - _reported_drops, dropped
            note = f"{n} log records dropped: the queue was full (hixl.log_dropped() counts them)"
            records = [(1, "hixl_core::log", note), *records]
        for level, target, message in records:
            log = _logger_for(target)
            lvl = LEVELS[min(level, 3)]
            if not log.isEnabledFor(lvl):
                continue
            record = log.makeRecord(log.name, lvl, "(hixl)", 0, message, (), None)
            if log.hasHandlers():
                log.handle(record)
            else:
                _fallback.handle(record)


_stop = threading.Event()


def _drain_forever() -> None:
    pinned = None
    while not _stop.is_set():
        _running.wait(0.2)
        # Started at import, before any engine: follows the last initialized engine's CPUs
        # (initialize wakes this thread).
        cpus = _hixl._process_cpus()
        if cpus != pinned:
            _place.pin_me(cpus)
            pinned = cpus
        if not _running.is_set():
            continue
        # A record wakes the wait at once, and _at_exit wakes it with _log_wake: an idle
        # process wakes for this thread once a minute, the bound every wait has.
        batch = _hixl._log_take(60_000)
        if batch or _hixl.log_dropped() > _reported_drops:
            try:
                _emit(batch)
            except Exception:  # noqa: BLE001 - a broken handler must not stop hixl's logging
                pass


def flush() -> None:
    """Hands every record queued now to ``logging``."""
    _emit(_hixl._log_take(0))


def _at_exit() -> None:
    """Stops the drain thread before the interpreter finalizes (a daemon thread still inside
    the extension then would be torn down mid-call), then flushes what is left."""
    _stop.set()
    _running.set()
    _hixl._log_wake()
    try:
        _drainer.join(2)
        flush()
    except KeyboardInterrupt:
        # Ctrl-C while the process ends: end quietly (no "Exception ignored in atexit");
        # what is still queued is lost, as on any interrupted exit.
        pass


def sync_level() -> None:
    """Sets the ``hixl`` logger's level to hixl's own (``HIXL_LOG_LEVEL``/``set_log_level``)."""
    logger.setLevel(getattr(logging, _hixl.get_log_level().replace("WARN", "WARNING")))


def set_log_level(level: str) -> None:
    """Sets hixl's log level ("DEBUG", "INFO", "WARN" or "ERROR"): which records the engine
    makes, and the ``hixl`` logger's level."""
    _hixl.set_log_level(level)
    sync_level()


def _start_drainer() -> threading.Thread:
    t = _place.thread(_drain_forever, name="hixl-log")
    t.start()
    return t


def _after_fork_in_child() -> None:
    """Threads do not survive fork(): a child gets a drain thread of its own."""
    global _drainer
    _drainer = _start_drainer()


sync_level()
_drainer = _start_drainer()
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
