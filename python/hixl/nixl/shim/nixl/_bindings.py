"""``nixl._bindings`` from hixl (the shim): NIXL's exception types and descriptor lists."""

from hixl.nixl._bindings import *  # noqa: F403
