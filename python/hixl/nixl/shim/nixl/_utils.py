"""``nixl._utils`` from hixl (the shim)."""

from hixl.nixl._utils import *  # noqa: F403
