"""Deprecated alias of :mod:`hixl.kv` (the KV-cache layer's old module path).

Importing it gives one DeprecationWarning; every name it had is the same object in
``hixl.kv``, and its private submodules (``hixl.datadist._context``, ...) are those of
``hixl.kv``. It goes in the next release: import ``hixl.kv`` instead.
"""

from __future__ import annotations

import importlib
import sys
import warnings

from .. import kv as _kv
from ..kv import *  # noqa: F403
from ..kv import __all__ as __all__

#: The private modules of the old path, as the same module objects of hixl.kv (one
#: ``context()``, one directory).
_SUBMODULES = (
    "_cache",
    "_context",
    "_directory",
    "_discovery",
    "_entries",
    "_errors",
    "_etcd",
    "_layerwise",
    "_sender",
    "_transfer",
)
for _sub in _SUBMODULES:
    sys.modules[f"{__name__}.{_sub}"] = importlib.import_module(f"{_kv.__name__}.{_sub}")
    globals()[_sub] = sys.modules[f"{__name__}.{_sub}"]
del _sub

# Its names as they were: the renamed classes under their old names too (this module's one
# warning covers them).
for _old, _new in _kv.RENAMED.items():
    globals()[_old] = getattr(_kv, _new)
del _old, _new

warnings.warn(
    "hixl.datadist is deprecated and goes in the next release: import hixl.kv "
    f"(the same names: {_kv.__name__}.Cache, {_kv.__name__}.init, ...)",
    DeprecationWarning,
    stacklevel=2,
)
