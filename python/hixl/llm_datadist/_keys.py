"""The cache managers' base: their lifetime and argument checks, and cache keys (the key
lists caches are allocated or registered under, ``remove_cache_key``, and the remote cache,
batch entry or blocks cache that a CacheKey, CacheKeyByIdAndIndex or BlocksCacheKey names).

``CacheManager`` (``_manager``) is put together from classes built on ``_ManagerBase``, one per
responsibility: ``_alloc._Allocation`` (allocation and registration), ``_transfer._Transfers``
(pulls, pushes, layerwise sends) and ``_copy._Copies`` (local copies and swaps).
"""

from __future__ import annotations

from typing import Any

from ._cache import Cache
from ._node import KeyIdent, Node, RemoteCache, RemoteView
from ._status import LLMStatusCode, check, fail
from ._types import INVALID_ID, BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex


def _key_ok(k: CacheKey) -> None:
    check(
        (k.req_id == INVALID_ID) != (k.prefix_id == INVALID_ID),
        f"{k!r}: exactly one of req_id and prefix_id must be set",
    )


class _ManagerBase:
    """Lifetime, argument checks and cache keys, shared by every part of CacheManager."""

    _cache_cls: type[Cache] = Cache

    def __init__(self, node: Node, remote_accessible: bool) -> None:
        self._node = node
        self._remote_accessible = remote_accessible
        self._initialized = True

    def is_initialized(self) -> bool:
        """False once the LLMDataDist is finalized."""
        return self._initialized

    # -- helpers -------------------------------------------------------------------------

    def _live(self) -> Node:
        if not self._initialized:
            raise fail(LLMStatusCode.LLM_ENGINE_FINALIZED, "the LLMDataDist was finalized")
        return self._node

    def _mine(self, cache: Any, what: str = "cache") -> Cache:
        check(isinstance(cache, Cache), f"{what}={cache!r} must be a Cache")
        check(cache._valid, f"{what} {cache.cache_id} was deallocated")
        return cache  # type: ignore[no-any-return]

    def _push_enabled(self, what: str) -> None:
        if not self._remote_accessible:
            raise fail(
                LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                f"{what} needs LLMConfig.enable_remote_cache_accessible = True",
            )

    # -- cache keys ----------------------------------------------------------------------

    @staticmethod
    def _keys(desc: CacheDesc, cache_keys: Any) -> list[tuple[KeyIdent, int]]:
        check(
            isinstance(cache_keys, (list, tuple))
            and all(isinstance(k, CacheKey) for k in cache_keys),
            f"cache_keys={cache_keys!r} must be a list or tuple of CacheKey",
        )
        check(
            len(cache_keys) <= desc.batch_size,
            f"{len(cache_keys)} cache keys for a batch of {desc.batch_size}",
        )
        out = []
        for i, k in enumerate(cache_keys):
            if k.req_id == INVALID_ID and k.prefix_id == INVALID_ID:
                continue  # a placeholder for an unused batch index
            _key_ok(k)
            out.append(((k.cluster_id, k.req_id, k.model_id, k.prefix_id), i))
        return out

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """The key no longer names its cache (pull_cache by it fails); a deallocated cache
        whose last key this was is released. Unknown keys are ignored."""
        check(isinstance(cache_key, CacheKey), f"cache_key={cache_key!r} must be a CacheKey")
        self._live().remove_key(tuple(cache_key.ident()))  # type: ignore[arg-type]

    # -- remote lookups --------------------------------------------------------------------

    def _entry_source(self, key: Any) -> tuple[RemoteView, RemoteCache, int, KeyIdent | None]:
        """The remote cache and batch index a CacheKey / CacheKeyByIdAndIndex names."""
        node = self._live()
        if isinstance(key, CacheKey):
            _key_ok(key)
            view = node.view(key.cluster_id)
            k: KeyIdent = tuple(key.ident())  # type: ignore[assignment]
            hit = view.keys.get(k)
            with node.lock:
                used = node.consumed.get(k)
            if hit is None or used == hit[0] or hit[0] not in view.caches:
                raise fail(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"{key!r} names no cache on cluster {key.cluster_id} (never registered, "
                    "removed, or already pulled)",
                )
            return view, view.caches[hit[0]], hit[1], k
        check(isinstance(key, CacheKeyByIdAndIndex), f"cache key {key!r} has the wrong type")
        view = node.view(key.cluster_id)
        rc = view.caches.get(key.cache_id)
        if rc is None:
            raise fail(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"cluster {key.cluster_id} has no cache {key.cache_id} "
                f"(it has: {sorted(view.caches) or 'none'})",
            )
        return view, rc, key.batch_index, None

    def _blocks_target(self, key: BlocksCacheKey) -> tuple[RemoteView, RemoteCache]:
        view = self._live().view(key.cluster_id)
        cid = view.bkeys.get((key.cluster_id, key.model_id))
        if cid is None or cid not in view.caches:
            raise fail(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"{key!r}: cluster {key.cluster_id} registered no blocks cache under it",
            )
        return view, view.caches[cid]
