"""KV-cache layouts for strided transfers (``hixl.kv.KVLayout``)."""

from .._layout import KVLayout

__all__ = ["KVLayout"]
