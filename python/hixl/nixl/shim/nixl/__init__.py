"""``nixl`` as seen by programs run with hixl's shim directory on PYTHONPATH.

It hands over to the real NIXL when that is installed too, unless HIXL_NIXL_SHIM=1; with
HIXL_NIXL_SHIM=0 it behaves as if it were absent.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path


def _real_nixl() -> importlib.machinery.ModuleSpec | None:
    here = str(Path(__file__).resolve().parent.parent)
    rest = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    return importlib.machinery.PathFinder.find_spec("nixl", rest)


_mode = os.environ.get("HIXL_NIXL_SHIM", "")
_real = None if _mode == "1" else _real_nixl()
if _mode == "0" or _real is not None:
    # Step aside: load the real package under this name (or fail as if we were not here).
    if _real is None or _real.loader is None:
        del sys.modules[__name__]
        raise ImportError("No module named 'nixl' (hixl's shim is off: HIXL_NIXL_SHIM=0)")
    _mod = importlib.util.module_from_spec(_real)
    sys.modules[__name__] = _mod
    _real.loader.exec_module(_mod)
else:
    from hixl.nixl import *  # noqa: F403
    from hixl.nixl import __all__  # noqa: F401

    __hixl__ = True
