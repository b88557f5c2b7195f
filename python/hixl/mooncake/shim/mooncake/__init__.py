"""``mooncake`` as seen by programs run with hixl's shim directory on PYTHONPATH.

It hands over to the real Mooncake package when that is installed too, unless
HIXL_MOONCAKE_SHIM=1; with HIXL_MOONCAKE_SHIM=0 it behaves as if it were absent. Only
``mooncake.engine`` is provided (the transfer engine); Mooncake Store and the other modules
of the real package are not.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def _real_mooncake() -> importlib.machinery.ModuleSpec | None:
    here = str(Path(__file__).resolve().parent.parent)
    rest = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    return importlib.machinery.PathFinder.find_spec("mooncake", rest)


_mode = os.environ.get("HIXL_MOONCAKE_SHIM", "")
_real = None if _mode == "1" else _real_mooncake()
if _mode == "0" or _real is not None:
    # Step aside: load the real package under this name (or fail as if we were not here).
    if _real is None or _real.loader is None:
        del sys.modules[__name__]
        raise ImportError("No module named 'mooncake' (hixl's shim is off: HIXL_MOONCAKE_SHIM=0)")
    _mod = importlib.util.module_from_spec(_real)
    sys.modules[__name__] = _mod
    _real.loader.exec_module(_mod)
else:
    __hixl__ = True
