"""Status codes and the one exception hierarchy of hixl (raised by the Rust bindings too)."""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """Status codes of the public contract: an ``IntEnum`` whose values are the numbers
    ``HixlError.code`` carries. ``hixl._hixl.status_codes()`` is their one definition (the
    engine's); this enum mirrors it."""

    SUCCESS = 0
    PARAM_INVALID = 103900
    TIMEOUT = 103901
    NOT_CONNECTED = 103902
    ALREADY_CONNECTED = 103903
    NOTIFY_FAILED = 103904
    UNSUPPORTED = 103905
    RESOURCE_EXHAUSTED = 203900
    FAILED = 503900


class HixlError(Exception):
    """Base of every hixl error; ``.code`` is the numeric status, ``.status`` the ``Status``
    member and ``.message`` the text (which names the value that was wrong). ``str(err)`` is
    ``"NAME (code): message"``. Catch ``HixlError`` for any failure of the engine."""

    status: Status = Status.FAILED

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> int:
        """The numeric status code (``int(self.status)``), e.g. 103900 for ``ParamInvalid``."""
        return int(self.status)

    def __str__(self) -> str:
        return f"{self.status.name} ({int(self.status)}): {self.message}"


class ParamInvalid(HixlError, ValueError):
    """PARAM_INVALID (103900), also a ``ValueError``: a value passed in is wrong (a bad
    argument, option, address or range, a range outside the registered regions, a WRITE into
    a read-only region); the message names it."""

    status = Status.PARAM_INVALID


class Timeout(HixlError, TimeoutError):
    """TIMEOUT (103901), also a ``TimeoutError``: a deadline passed (a connect nobody
    answered, a transfer's deadline, ``send_notify`` or ``wait_notifies`` waiting too long)."""

    status = Status.TIMEOUT


class NotConnected(HixlError, ConnectionError):
    """NOT_CONNECTED (103902), also a ``ConnectionError``: no usable link to the peer (never
    connected, disconnected, or the link died), or a connect failed other than by a timeout."""

    status = Status.NOT_CONNECTED


class AlreadyConnected(HixlError):
    """ALREADY_CONNECTED (103903): a connect to a peer that has a live link, or whose connect
    is still in progress."""

    status = Status.ALREADY_CONNECTED


class NotifyFailed(HixlError):
    """NOTIFY_FAILED (103904): a notification could not be delivered (the link died or lost
    it)."""

    status = Status.NOTIFY_FAILED


class Unsupported(HixlError):
    """UNSUPPORTED (103905): a memory type or backend not available here (device memory where
    CUDA is not found, a tensor on a device other than the CPU or CUDA, a backend that does not
    move device memory, no backend of ``hixl.backends`` that can reach the peer)."""

    status = Status.UNSUPPORTED


class ResourceExhausted(HixlError):
    """RESOURCE_EXHAUSTED (203900): a bounded resource is full (a link's request queue, the
    peer's pending notifications, the region table)."""

    status = Status.RESOURCE_EXHAUSTED


class Failed(HixlError):
    """FAILED (503900): anything else, including use before ``initialize``, after
    ``finalize`` or after ``fork()``, and requests failed because the engine was finalized."""

    status = Status.FAILED


_BY_CODE = {cls.status: cls for cls in HixlError.__subclasses__()}


def error_for(code: int, message: str) -> HixlError:
    """Builds an instance of the exception class that belongs to ``code`` (``Failed`` for a
    code without a class of its own), with ``message``."""
    return _BY_CODE.get(Status(code), Failed)(message)
