"""``hixl.mooncake.engine``: the names of ``mooncake.engine``, for code that imports that path."""

from . import Read, TransferEngine, TransferNotify, TransferOpcode, Write

__all__ = ["Read", "TransferEngine", "TransferNotify", "TransferOpcode", "Write"]
