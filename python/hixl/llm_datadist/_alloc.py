"""Allocation and registration of caches (``allocate_cache``, ``register_cache``, their
blocks-cache forms, ``deallocate_cache``, ``unregister_cache``, ``get_cache_tensors``): host
memory registered with the node's hixl engine, named by cache keys.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from .._kvcore._cache import deregister
from .._layout import aligned_empty
from ._cache import Cache, create_tensors
from ._keys import _ManagerBase
from ._node import KeyIdent, Local
from ._status import LLMStatusCode, check, fail
from ._types import BlocksCacheKey, CacheDesc, CacheKey, MemInfo, Placement, check_int, check_ints


def _host_only(desc: CacheDesc, what: str) -> None:
    if desc.placement != Placement.HOST:
        raise fail(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"{what}: placement={desc.placement} is not supported: hixl's LLM-DataDist layer "
            "keeps caches in host memory; use Placement.HOST (and CPU tensors)",
        )


class _Allocation(_ManagerBase):
    """Allocation and registration: the part of CacheManager that owns caches."""

    def _new(
        self,
        desc: CacheDesc,
        addrs: list[int] | None,
        keys: list[tuple[KeyIdent, int]],
        bkey: BlocksCacheKey | None,
        blocks: bool,
        writable: bool,
        what: str,
    ) -> Cache:
        node = self._live()
        check(isinstance(desc, CacheDesc), f"cache_desc={desc!r} must be a CacheDesc")
        _host_only(desc, what)
        desc = copy.deepcopy(desc)  # the cache keeps its own (the caller may reuse theirs)
        desc._is_blocks = blocks
        owned = []
        if addrs is None:
            owned = [aligned_empty(desc.size) for _ in range(desc.num_tensors)]
            for a in owned:
                a[:] = 0
            addrs = [int(a.ctypes.data) for a in owned]
        handles = node.register(addrs, desc.size, writable)
        cache = self._cache_cls(node.new_id(), desc, addrs, self, addrs is not None, blocks)
        cache._is_registered = not owned
        loc = Local(cache, handles, owned, writable=writable)
        loc.bkey = None if bkey is None else (bkey.cluster_id, bkey.model_id)
        try:
            node.add(loc, keys)
        except BaseException:
            deregister(node.engine, handles, quiet=False)
            raise
        return cache

    # -- allocation and registration ---------------------------------------------------

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = ()) -> Cache:
        """Allocates num_tensors host tensors (zeroed) and registers them; cache_keys[i]
        names batch index i for pull_cache."""
        return self._new(
            cache_desc,
            None,
            self._keys(cache_desc, cache_keys),
            None,
            False,
            True,
            "allocate_cache",
        )

    def allocate_blocks_cache(
        self, cache_desc: CacheDesc, blocks_cache_key: BlocksCacheKey | None = None
    ) -> Cache:
        check(
            blocks_cache_key is None or isinstance(blocks_cache_key, BlocksCacheKey),
            f"blocks_cache_key={blocks_cache_key!r} must be a BlocksCacheKey",
        )
        return self._new(
            cache_desc, None, [], blocks_cache_key, True, True, "allocate_blocks_cache"
        )

    def register_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[int],
        cache_keys: Sequence[CacheKey] = (),
        remote_accessible: bool | None = None,
    ) -> Cache:
        """Registers existing memory (one address per tensor, each cache_desc.size bytes).
        remote_accessible=False: peers may pull it but never push into it."""
        a = check_ints("addrs", addrs)
        check(
            len(a) == cache_desc.num_tensors, f"{len(a)} addrs for {cache_desc.num_tensors} tensors"
        )
        check(all(x != 0 for x in a), "addrs must not be 0")
        return self._new(
            cache_desc,
            a,
            self._keys(cache_desc, cache_keys),
            None,
            False,
            remote_accessible is not False,
            "register_cache",
        )

    def register_blocks_cache(
        self,
        cache_desc: CacheDesc,
        addrs: Sequence[int],
        blocks_cache_key: BlocksCacheKey | None = None,
        remote_accessible: bool | None = None,
    ) -> Cache:
        a = check_ints("addrs", addrs)
        check(
            len(a) == cache_desc.num_tensors, f"{len(a)} addrs for {cache_desc.num_tensors} tensors"
        )
        check(all(x != 0 for x in a), "addrs must not be 0")
        check(
            blocks_cache_key is None or isinstance(blocks_cache_key, BlocksCacheKey),
            f"blocks_cache_key={blocks_cache_key!r} must be a BlocksCacheKey",
        )
        return self._new(
            cache_desc,
            a,
            [],
            blocks_cache_key,
            True,
            remote_accessible is not False,
            "register_blocks_cache",
        )

    def deallocate_cache(self, cache: Cache) -> None:
        """Releases the cache; while CacheKeys still name it (not pulled, not removed) the
        release waits for the last of them."""
        self._mine(cache)
        check(not cache.is_blocks_cache, "deallocate_cache: use deallocate_blocks_cache")
        self._live().drop(cache.cache_id, force=False)

    def deallocate_blocks_cache(self, cache: Cache) -> None:
        self._mine(cache)
        check(cache.is_blocks_cache, "deallocate_blocks_cache: not a blocks cache")
        self._live().drop(cache.cache_id)

    def unregister_cache(self, cache_id: int) -> None:
        """Deregisters a cache (its memory stays the caller's). Unknown ids are ignored."""
        self._live().drop(check_int("cache_id", cache_id, -(2**63), 2**63 - 1))

    def remap_registered_memory(self, mem_infos: MemInfo | list[MemInfo]) -> None:
        raise fail(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            "remap_registered_memory: device memory fault recovery does not exist on hixl",
        )

    def get_cache_tensors(
        self, cache: Cache, tensor_index: int | None = None, framework: str | None = None
    ) -> Any:
        """The cache's tensors as numpy arrays (or torch CPU tensors) viewing its memory;
        one tensor when tensor_index is given."""
        self._mine(cache)
        d = cache.cache_desc
        addrs = cache.tensor_addrs
        if tensor_index is not None:
            check_int("tensor_index", tensor_index, 0, d.num_tensors - 1)
            return create_tensors(d.shape, d.data_type, [addrs[tensor_index]], framework)[0]
        return create_tensors(d.shape, d.data_type, addrs, framework)
