"""The shim directory: put ``python -m hixl.nixl.shim``'s output on PYTHONPATH and unchanged
programs that ``import nixl`` get hixl's implementation (see https://github.com/hixl/hixl/blob/main/docs/NIXL.md).

Where the real NIXL is installed too, the shim steps aside and hands over to it unless
``HIXL_NIXL_SHIM=1`` is set; ``HIXL_NIXL_SHIM=0`` turns it off (``import nixl`` then fails or
finds the real one, as if the shim were not there).
"""

from __future__ import annotations

from pathlib import Path

PATH = str(Path(__file__).resolve().parent)

__all__ = ["PATH"]
