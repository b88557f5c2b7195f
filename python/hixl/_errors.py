"""Status codes and the one exception hierarchy of hixl (raised by the Rust bindings too)."""

from __future__ import annotations

from enum import IntEnum


class Status(IntEnum):
    """Status codes of the public contract."""

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
    """Base of every hixl error; ``.code`` is the numeric status, ``.status`` the enum."""

    status: Status = Status.FAILED

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    @property
    def code(self) -> int:
        return int(self.status)

    def __str__(self) -> str:
        return f"{self.status.name} ({int(self.status)}): {self.message}"


class ParamInvalid(HixlError, ValueError):
    """A value passed in is wrong; the message names it."""

    status = Status.PARAM_INVALID


class Timeout(HixlError, TimeoutError):
    """The peer did not answer within the timeout."""

    status = Status.TIMEOUT


class NotConnected(HixlError, ConnectionError):
    """No usable link to the peer."""

    status = Status.NOT_CONNECTED


class AlreadyConnected(HixlError):
    """A second connect to the same peer."""

    status = Status.ALREADY_CONNECTED


class NotifyFailed(HixlError):
    """A notification could not be delivered."""

    status = Status.NOTIFY_FAILED


class Unsupported(HixlError):
    """Memory type or backend not available on this machine."""

    status = Status.UNSUPPORTED


class ResourceExhausted(HixlError):
    """A bounded resource (request queue, notify buffer) is full."""

    status = Status.RESOURCE_EXHAUSTED


class Failed(HixlError):
    """Anything else, including use after finalize."""

    status = Status.FAILED


_BY_CODE = {cls.status: cls for cls in HixlError.__subclasses__()}


def error_for(code: int, message: str) -> HixlError:
    """Builds the exception class that belongs to ``code``."""
    return _BY_CODE.get(Status(code), Failed)(message)
