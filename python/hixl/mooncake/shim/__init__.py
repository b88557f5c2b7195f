"""The shim directory: put ``python -m hixl.mooncake.shim``'s output on PYTHONPATH and
unchanged programs that do ``from mooncake.engine import TransferEngine`` get hixl's
implementation (see https://github.com/hixl/hixl/blob/main/docs/MOONCAKE.md).

Where the real Mooncake package is installed too, the shim steps aside and hands over to it
unless ``HIXL_MOONCAKE_SHIM=1`` is set; ``HIXL_MOONCAKE_SHIM=0`` turns it off (``import
mooncake`` then fails or finds the real one, as if the shim were not there).
"""

from __future__ import annotations

from pathlib import Path

PATH = str(Path(__file__).resolve().parent)

__all__ = ["PATH"]
