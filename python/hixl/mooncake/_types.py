"""Mooncake's small value types: ``TransferOpcode`` and ``TransferNotify``."""

from __future__ import annotations

from enum import IntEnum


class TransferOpcode(IntEnum):
    """The direction of a transfer, with Mooncake's numbers: ``Read`` (0) copies the peer's
    memory here, ``Write`` (1) copies this engine's memory to the peer."""

    Read = 0
    Write = 1


class TransferNotify:
    """A notification that travels with a transfer (``transfer_sync(..., notify)``): the peer
    gets it from ``get_notifies()`` after the transfer's bytes are in its memory.

    ``peer`` is hixl's addition on received ones: the authenticated address of the engine
    that sent it ("" on those made here).
    """

    __slots__ = ("name", "msg", "peer")

    def __init__(self, name: str = "", msg: str = "", *, peer: str = "") -> None:
        """A notification named ``name`` carrying ``msg``."""
        self.name = name
        self.msg = msg
        self.peer = peer

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferNotify):
            return NotImplemented
        return (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None  # type: ignore[assignment]
