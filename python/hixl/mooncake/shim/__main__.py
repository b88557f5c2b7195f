"""Prints the shim directory: ``PYTHONPATH=$(python -m hixl.mooncake.shim) python prog.py``."""

from __future__ import annotations

from . import PATH

print(PATH)
