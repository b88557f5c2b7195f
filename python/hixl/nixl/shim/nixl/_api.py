"""``nixl._api`` from hixl (the shim)."""

from hixl.nixl import *  # noqa: F403
from hixl.nixl._api import *  # noqa: F403
