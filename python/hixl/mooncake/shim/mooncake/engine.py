"""``mooncake.engine`` from hixl (the shim): ``TransferEngine``, ``TransferOpcode``, ..."""

from hixl.mooncake.engine import *  # noqa: F403
from hixl.mooncake.engine import __all__  # noqa: F401
