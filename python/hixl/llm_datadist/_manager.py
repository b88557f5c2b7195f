"""CacheManager (``LLMDataDist.cache_manager``) and KvCacheManager (the older
``kv_cache_manager``): caches in registered host memory, moved one-sidedly by hixl."""

from __future__ import annotations

import copy
import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from .._hixl import TransferOp
from .._layout import aligned_empty
from ..datadist._cache import block_runs
from ._cache import Cache, CacheTask, KvCache, create_tensors
from ._node import KeyIdent, Local, Node, RemoteCache, RemoteView
from ._status import LLMException, LLMStatusCode, check, code_of, fail, wrap
from ._types import (
    INVALID_ID,
    TENSORS_PER_LAYER,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    MemInfo,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_int,
    check_ints,
    check_layer_range,
)

Offsets = list[tuple[int, int, int]]  # (source offset, destination offset, length)


def _host_only(desc: CacheDesc, what: str) -> None:
    if desc.placement != Placement.HOST:
        raise fail(
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"{what}: placement={desc.placement} is not supported: hixl's LLM-DataDist layer "
            "keeps caches in host memory; use Placement.HOST (and CPU tensors)",
        )


def _key_ok(k: CacheKey) -> None:
    check(
        (k.req_id == INVALID_ID) != (k.prefix_id == INVALID_ID),
        f"{k!r}: exactly one of req_id and prefix_id must be set",
    )


def _tensor_pairs(
    n_src: int, n_dst: int, src_range: Any, dst_range: Any, tpl: int
) -> list[tuple[int, int]]:
    """(source tensor, destination tensor) for the layer ranges (None: every layer)."""
    tpl = check_int("tensor_num_per_layer", tpl, 1, 2**32 - 1)
    src_range = check_layer_range("src_layer_range", src_range)
    dst_range = check_layer_range("dst_layer_range", dst_range)
    if src_range is None and dst_range is None:
        check(n_src == n_dst, f"source has {n_src} tensors, destination {n_dst}")
        return [(i, i) for i in range(n_src)]
    src_range = src_range or range(0, n_src // tpl)
    dst_range = dst_range or range(0, n_dst // tpl)
    check(
        len(src_range) == len(dst_range),
        f"src_layer_range={src_range} and dst_layer_range={dst_range} differ in length",
    )
    out = []
    for s, d in zip(src_range, dst_range, strict=True):
        for t in range(tpl):
            si, di = s * tpl + t, d * tpl + t
            check(si < n_src, f"source layer {s} is out of range ({n_src} tensors, {tpl} a layer)")
            check(di < n_dst, f"destination layer {d} is out of range ({n_dst} tensors)")
            out.append((si, di))
    return out


def _entry(desc: CacheDesc, index: int, what: str) -> list[tuple[int, int]]:
    check_int(f"{what} batch index", index, 0, 2**32 - 1)
    check(
        index < desc.batch_size,
        f"{what} batch index {index} is out of range (batch size {desc.batch_size})",
    )
    return desc.batch_pieces(index)


def _entry_offsets(src: CacheDesc, sb: int, dst: CacheDesc, db: int, size: int) -> Offsets:
    """One batch entry of each tensor: source entry `sb` into destination entry `db`; `size`
    bytes of it (-1: all of the source entry, which must fit)."""
    sp, dp = _entry(src, sb, "source"), _entry(dst, db, "destination")
    check(
        len(sp) == len(dp),
        f"batch entries differ in layout (source {src!r}, destination {dst!r})",
    )
    check(size == -1 or (size > 0 and len(sp) == 1), f"size={size} must be -1 or > 0")
    out = []
    for (so, sn), (do, dn) in zip(sp, dp, strict=True):
        n = sn if size == -1 else size
        check(n <= sn, f"size={n} is larger than a source batch entry ({sn} bytes)")
        check(n <= dn, f"{n} bytes do not fit in a destination batch entry ({dn} bytes)")
        out.append((so, do, n))
    return out


def _block_bytes(desc: CacheDesc, what: str) -> int:
    pieces = desc.batch_pieces(0)
    check(len(pieces) == 1, f"{what}: blocks must be the first dimension ({desc!r})")
    return pieces[0][1]


def _block_offsets(src: CacheDesc, sbl: list[int], dst: CacheDesc, dbl: list[int]) -> Offsets:
    check(len(sbl) == len(dbl), f"{len(sbl)} source blocks but {len(dbl)} destination blocks")
    sbb, dbb = _block_bytes(src, "source"), _block_bytes(dst, "destination")
    check(sbb == dbb, f"block sizes differ: source {sbb} bytes, destination {dbb}")
    for what, desc, ids in (("source", src, sbl), ("destination", dst, dbl)):
        bad = [b for b in ids if b >= desc.batch_size]
        check(not bad, f"{what} block {bad[:1]} is out of range (blocks: {desc.batch_size})")
    return [(s * sbb, d * dbb, n * sbb) for s, d, n in block_runs(sbl, dbl)]


def _entry_to_blocks(src: CacheDesc, sb: int, dst: CacheDesc, dbl: list[int]) -> Offsets:
    """A plain cache's batch entry cut into the destination's blocks, in order (as much of
    it as the blocks hold)."""
    sp = _entry(src, sb, "source")
    check(len(sp) == 1, f"source batch entries must be contiguous ({src!r})")
    (so, sn), dbb = sp[0], _block_bytes(dst, "destination")
    bad = [b for b in dbl if b >= dst.batch_size]
    check(not bad, f"destination block {bad[:1]} is out of range (blocks: {dst.batch_size})")
    out = []
    for j, b in enumerate(dbl):
        n = min(dbb, sn - j * dbb)
        if n <= 0:
            break
        out.append((so + j * dbb, b * dbb, n))
    return out


def _pairs(
    tensors: list[tuple[int, int]], src_addrs: list[int], dst_addrs: list[int], offs: Offsets
) -> list[tuple[int, int, int]]:
    """(source address, destination address, length) of every piece."""
    return [(src_addrs[s] + so, dst_addrs[d] + do, n) for s, d in tensors for so, do, n in offs]


def _flip(p: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [(d, s, n) for s, d, n in p]


class CacheManager:
    """Allocates, registers and moves caches. Every failure raises LLMException with an
    LLMStatusCode; see docs/LLM_DATADIST.md for how each call maps to hixl."""

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
            for h in handles:
                node.engine.deregister_mem(h)
            raise
        return cache

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

    def remove_cache_key(self, cache_key: CacheKey) -> None:
        """The key no longer names its cache (pull_cache by it fails); a deallocated cache
        whose last key this was is released. Unknown keys are ignored."""
        check(isinstance(cache_key, CacheKey), f"cache_key={cache_key!r} must be a CacheKey")
        self._live().remove_key(tuple(cache_key.ident()))  # type: ignore[arg-type]

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

    # -- pulls and pushes ------------------------------------------------------------------

    def pull_cache(
        self,
        cache_key: CacheKey | CacheKeyByIdAndIndex,
        cache: Cache,
        batch_index: int = 0,
        size: int = -1,
        **kwargs: Any,
    ) -> None:
        """Reads the remote batch entry that cache_key names into batch entry `batch_index`
        of `cache` (every tensor, or the tensors of src/dst_layer_range); `size` bytes per
        tensor (-1: the whole entry). Pulling by CacheKey uses the key up."""
        node = self._live()
        self._mine(cache)
        check(not cache.is_blocks_cache, "pull_cache: cache is a blocks cache (use pull_blocks)")
        check_int("size", size, -1, 2**63 - 1)
        try:
            view, rc, rb, k = self._entry_source(cache_key)
            check(not rc.desc._is_blocks, f"remote cache {rc.cache_id} is a blocks cache")
            tp = _tensor_pairs(
                rc.desc.num_tensors,
                cache.cache_desc.num_tensors,
                kwargs.get("src_layer_range"),
                kwargs.get("dst_layer_range"),
                kwargs.get("tensor_num_per_layer", TENSORS_PER_LAYER),
            )
            offs = _entry_offsets(rc.desc, rb, cache.cache_desc, batch_index, size)
            pairs = _flip(_pairs(tp, rc.addrs, cache.tensor_addrs, offs))
            node.transfer(cache_key.cluster_id, view.address, TransferOp.READ, pairs)
        except LLMException:
            raise
        except Exception as exc:
            raise wrap(exc, "pull_cache") from exc
        if k is not None:
            node.release(cache_key.cluster_id, view.address, k, rc.cache_id)

    def pull_blocks(
        self,
        src_cache_key: CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey,
        dst_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        **kwargs: Any,
    ) -> None:
        """Reads remote blocks src_blocks into dst_blocks of dst_cache (a blocks cache); with
        a CacheKey / CacheKeyByIdAndIndex (src_blocks empty) the remote batch entry is cut
        into dst_blocks in order."""
        node = self._live()
        self._mine(dst_cache, "dst_cache")
        check(dst_cache.is_blocks_cache, "pull_blocks: dst_cache must be a blocks cache")
        sbl, dbl = check_ints("src_blocks", src_blocks), check_ints("dst_blocks", dst_blocks)
        check(len(dbl) > 0, "dst_blocks must not be empty")
        k = None
        if isinstance(src_cache_key, BlocksCacheKey):
            check(len(sbl) > 0, "src_blocks must not be empty with a BlocksCacheKey")
            view, rc = self._blocks_target(src_cache_key)
            offs = _block_offsets(rc.desc, sbl, dst_cache.cache_desc, dbl)
        else:
            check(not sbl, "src_blocks must be empty unless src_cache_key is a BlocksCacheKey")
            view, rc, rb, k = self._entry_source(src_cache_key)
            offs = _entry_to_blocks(rc.desc, rb, dst_cache.cache_desc, dbl)
        tp = _tensor_pairs(
            rc.desc.num_tensors,
            dst_cache.cache_desc.num_tensors,
            kwargs.get("src_layer_range"),
            kwargs.get("dst_layer_range"),
            kwargs.get("tensor_num_per_layer", TENSORS_PER_LAYER),
        )
        pairs = _flip(_pairs(tp, rc.addrs, dst_cache.tensor_addrs, offs))
        node.transfer(src_cache_key.cluster_id, view.address, TransferOp.READ, pairs)
        if k is not None:
            node.release(src_cache_key.cluster_id, view.address, k, rc.cache_id)

    def push_cache(
        self,
        dst_cache_key: CacheKeyByIdAndIndex,
        src_cache: Cache,
        src_batch_index: int = 0,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        size: int = -1,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """Writes batch entry src_batch_index of src_cache into the remote entry that
        dst_cache_key names (needs enable_remote_cache_accessible)."""
        node = self._live()
        self._push_enabled("push_cache")
        check(
            isinstance(dst_cache_key, CacheKeyByIdAndIndex),
            f"dst_cache_key={dst_cache_key!r} must be a CacheKeyByIdAndIndex",
        )
        self._mine(src_cache, "src_cache")
        check(not src_cache.is_blocks_cache, "push_cache: src_cache is a blocks cache")
        check(size == -1, f"size={size}: push_cache moves whole entries (size=-1)")
        view, rc, db, _ = self._entry_source(dst_cache_key)
        check(not rc.desc._is_blocks, f"remote cache {rc.cache_id} is a blocks cache")
        tp = _tensor_pairs(
            src_cache.cache_desc.num_tensors,
            rc.desc.num_tensors,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        offs = _entry_offsets(src_cache.cache_desc, src_batch_index, rc.desc, db, -1)
        pairs = _pairs(tp, src_cache.tensor_addrs, rc.addrs, offs)
        node.transfer(dst_cache_key.cluster_id, view.address, TransferOp.WRITE, pairs)

    def push_blocks(
        self,
        dst_cache_key: BlocksCacheKey,
        src_cache: Cache,
        src_blocks: Sequence[int] = (),
        dst_blocks: Sequence[int] = (),
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        tensor_num_per_layer: int = TENSORS_PER_LAYER,
    ) -> None:
        """Writes src_blocks of src_cache into dst_blocks of the remote blocks cache; a plain
        src_cache (src_blocks empty) has its batch entry 0 cut into dst_blocks."""
        node = self._live()
        self._push_enabled("push_blocks")
        check(
            isinstance(dst_cache_key, BlocksCacheKey),
            f"dst_cache_key={dst_cache_key!r} must be a BlocksCacheKey",
        )
        self._mine(src_cache, "src_cache")
        sbl, dbl = check_ints("src_blocks", src_blocks), check_ints("dst_blocks", dst_blocks)
        check(len(dbl) > 0, "dst_blocks must not be empty")
        view, rc = self._blocks_target(dst_cache_key)
        if src_cache.is_blocks_cache:
            offs = _block_offsets(src_cache.cache_desc, sbl, rc.desc, dbl)
        else:
            check(not sbl, "src_blocks must be empty when src_cache is not a blocks cache")
            offs = _entry_to_blocks(src_cache.cache_desc, 0, rc.desc, dbl)
        tp = _tensor_pairs(
            src_cache.cache_desc.num_tensors,
            rc.desc.num_tensors,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        pairs = _pairs(tp, src_cache.tensor_addrs, rc.addrs, offs)
        node.transfer(dst_cache_key.cluster_id, view.address, TransferOp.WRITE, pairs)

    # -- local copies ------------------------------------------------------------------

    @staticmethod
    def _memmove(pairs: list[tuple[int, int, int]]) -> None:
        for s, d, n in pairs:
            ctypes.memmove(d, s, n)

    def copy_cache(
        self,
        dst: Cache,
        src: Cache,
        dst_batch_index: int = 0,
        src_batch_index: int = 0,
        offset: int = 0,
        size: int = -1,
        req_id: int | None = None,
    ) -> None:
        """Copies batch entry src_batch_index of every tensor of src into dst's entry,
        from byte `offset` of the entry, `size` bytes (-1: to the end)."""
        self._live()
        self._mine(dst, "dst")
        self._mine(src, "src")
        check(
            not src.is_blocks_cache and not dst.is_blocks_cache,
            "copy_cache: blocks caches are copied with copy_blocks",
        )
        check_int("offset", offset)
        check_int("size", size, -1, 2**63 - 1)
        sp = _entry(src.cache_desc, src_batch_index, "source")
        dp = _entry(dst.cache_desc, dst_batch_index, "destination")
        check(len(sp) == 1 and len(dp) == 1, "copy_cache needs contiguous batch entries")
        n = sp[0][1] - offset if size == -1 else size
        check(n > 0 and offset + n <= sp[0][1], f"offset={offset}, size={size} exceed the entry")
        check(offset + n <= dp[0][1], f"offset={offset}, size={n} exceed the destination entry")
        tp = _tensor_pairs(src.cache_desc.num_tensors, dst.cache_desc.num_tensors, None, None, 1)
        self._memmove(
            _pairs(
                tp, src.tensor_addrs, dst.tensor_addrs, [(sp[0][0] + offset, dp[0][0] + offset, n)]
            )
        )

    def copy_blocks(self, cache: Cache, copy_block_info: dict[int, list[int]]) -> None:
        """Within one blocks cache: block s is copied to each block of copy_block_info[s]."""
        self._live()
        self._mine(cache)
        check(cache.is_blocks_cache, "copy_blocks: cache must be a blocks cache")
        check(isinstance(copy_block_info, dict), "copy_block_info must be a dict")
        src, dst = [], []
        for s, ds in copy_block_info.items():
            for d in check_ints("copy_block_info value", ds):
                src.append(check_int("copy_block_info key", s))
                dst.append(d)
        offs = _block_offsets(cache.cache_desc, src, cache.cache_desc, dst)
        n = cache.cache_desc.num_tensors
        self._memmove(
            _pairs([(i, i) for i in range(n)], cache.tensor_addrs, cache.tensor_addrs, offs)
        )

    def swap_blocks(self, src_cache: Cache, dst_cache: Cache, src_to_dst: dict[int, int]) -> None:
        """Copies blocks between two blocks caches of this process (on Ascend: device <->
        host swap; here both are host memory)."""
        self._live()
        for what, c in (("src_cache", src_cache), ("dst_cache", dst_cache)):
            self._mine(c, what)
            check(c.is_blocks_cache, f"swap_blocks: {what} must be a blocks cache")
        check(isinstance(src_to_dst, dict), "src_to_dst must be a dict")
        check(
            src_cache.cache_desc.num_tensors == dst_cache.cache_desc.num_tensors,
            "swap_blocks: the caches have different numbers of tensors",
        )
        sbl = check_ints("src_to_dst keys", list(src_to_dst))
        dbl = check_ints("src_to_dst values", list(src_to_dst.values()))
        offs = _block_offsets(src_cache.cache_desc, sbl, dst_cache.cache_desc, dbl)
        n = src_cache.cache_desc.num_tensors
        self._memmove(
            _pairs([(i, i) for i in range(n)], src_cache.tensor_addrs, dst_cache.tensor_addrs, offs)
        )

    # -- layerwise ----------------------------------------------------------------------

    def transfer_cache_async(
        self,
        src_cache: Cache,
        layer_synchronizer: LayerSynchronizer,
        transfer_configs: Sequence[TransferConfig | TransferWithCacheKeyConfig],
        src_block_indices: Sequence[int] | None = None,
        dst_block_indices: Sequence[int] | None = None,
        dst_block_memory_size: int | None = None,
    ) -> CacheTask:
        """Sends src_cache layer by layer to every destination in transfer_configs, in the
        background: before layer k it calls layer_synchronizer.synchronize_layer(k, timeout)
        and sends layer k once that returns True. Returns a CacheTask at once."""
        node = self._live()
        self._mine(src_cache, "src_cache")
        check(
            isinstance(layer_synchronizer, LayerSynchronizer),
            "layer_synchronizer must be an llm_datadist LayerSynchronizer (subclass it)",
        )
        check(
            isinstance(transfer_configs, (list, tuple)) and len(transfer_configs) > 0,
            "transfer_configs must be a non-empty list",
        )
        desc = src_cache.cache_desc
        tpl = TENSORS_PER_LAYER if desc.num_tensors % TENSORS_PER_LAYER == 0 else 1
        layers = desc.num_tensors // tpl
        sbi = (
            None
            if src_block_indices is None
            else check_ints("src_block_indices", src_block_indices)
        )
        dbi = (
            None
            if dst_block_indices is None
            else check_ints("dst_block_indices", dst_block_indices)
        )
        check((sbi is None) == (dbi is None), "give both src_block_indices and dst_block_indices")
        check(sbi is None or src_cache.is_blocks_cache, "block indices need a blocks src_cache")
        # plans[i]: (cluster, address, {src layer: [(local, remote, n)]})
        plans: list[tuple[int, str, dict[int, list[tuple[int, int, int]]]]] = []
        for cfg in transfer_configs:
            src_range = cfg.src_layer_range or range(0, layers)
            check(
                src_range.stop <= layers,
                f"src_layer_range={src_range}: the cache has {layers} layers",
            )
            if isinstance(cfg, TransferConfig):
                address = node.peer_address(cfg.dst_cluster_id)
                check(
                    len(cfg.dst_addrs) == len(src_range) * tpl,
                    f"{len(cfg.dst_addrs)} dst_addrs for {len(src_range)} layers of {tpl} tensors",
                )
                if sbi is not None:
                    bb = _block_bytes(desc, "source")
                    dbs = (
                        bb
                        if dst_block_memory_size is None
                        else check_int("dst_block_memory_size", dst_block_memory_size, 1)
                    )
                    check(bb <= dbs, f"a block is {bb} bytes, dst_block_memory_size {dbs}")
                    check(len(sbi) == len(dbi or []), "block index lists differ in length")
                    offs = [(s * bb, d * dbs, bb) for s, d in zip(sbi, dbi or [], strict=True)]
                elif src_cache.is_blocks_cache:
                    offs = [(0, 0, desc.size)]
                else:
                    pieces = _entry(desc, cfg.src_batch_index, "source")
                    offs, at = [], 0
                    for o, n in pieces:
                        offs.append((o, at, n))
                        at += n
                per_layer = {}
                for j, layer in enumerate(src_range):
                    tp = [(layer * tpl + t, j * tpl + t) for t in range(tpl)]
                    per_layer[layer] = _pairs(tp, src_cache.tensor_addrs, cfg.dst_addrs, offs)
                plans.append((cfg.dst_cluster_id, address, per_layer))
            else:
                check(
                    isinstance(cfg, TransferWithCacheKeyConfig),
                    f"transfer config {cfg!r} must be a TransferConfig or "
                    "TransferWithCacheKeyConfig",
                )
                self._push_enabled("transfer_cache_async with a cache key")
                key = cfg.cache_key
                if isinstance(key, BlocksCacheKey):
                    view, rc = self._blocks_target(key)
                    if sbi is not None:
                        offs = _block_offsets(desc, sbi, rc.desc, dbi or [])
                    else:
                        check(
                            src_cache.is_blocks_cache,
                            "a plain src_cache needs a CacheKeyByIdAndIndex",
                        )
                        check(
                            desc.size <= rc.desc.size,
                            "the source tensors are larger than the destination's",
                        )
                        offs = [(0, 0, desc.size)]
                else:
                    view, rc, db, _ = self._entry_source(key)
                    check(
                        not src_cache.is_blocks_cache, "a blocks src_cache needs a BlocksCacheKey"
                    )
                    offs = _entry_offsets(desc, cfg.src_batch_index, rc.desc, db, -1)
                dst_range = cfg.dst_layer_range or range(src_range.start, src_range.stop)
                check(len(dst_range) == len(src_range), "src and dst layer ranges differ in length")
                per_layer = {}
                for layer, dl in zip(src_range, dst_range, strict=True):
                    tp = [(layer * tpl + t, dl * tpl + t) for t in range(tpl)]
                    check(
                        all(d < rc.desc.num_tensors for _, d in tp),
                        f"destination layer {dl} is out of range",
                    )
                    per_layer[layer] = _pairs(tp, src_cache.tensor_addrs, rc.addrs, offs)
                plans.append((key.cluster_id, view.address, per_layer))
        task = CacheTask(len(plans))
        order = sorted({layer for _, _, pl in plans for layer in pl})

        def run() -> None:
            try:
                for layer in order:
                    why = LLMStatusCode.LLM_TIMEOUT  # synchronize_layer said False
                    try:
                        ok = bool(layer_synchronizer.synchronize_layer(layer, node.timeout_ms))
                    except Exception as exc:  # noqa: BLE001 - recorded on the task
                        task.error, ok, why = exc, False, code_of(exc)
                    if not ok:
                        for i in range(len(plans)):
                            if task._results[i] == LLMStatusCode.LLM_SUCCESS:
                                task._results[i] = why
                        return
                    for i, (cluster, address, per_layer) in enumerate(plans):
                        if layer not in per_layer or task._results[i] != LLMStatusCode.LLM_SUCCESS:
                            continue
                        try:
                            node.transfer(cluster, address, TransferOp.WRITE, per_layer[layer])
                        except Exception as exc:  # noqa: BLE001 - recorded on the task
                            task._results[i] = code_of(exc)
                            task.error = exc
            finally:
                task._finish()

        threading.Thread(target=run, name="hixl-lldd-layerwise", daemon=True).start()
        return task


class KvCacheManager(CacheManager):
    """The older API (``LLMDataDist.kv_cache_manager``, without enable_cache_manager): the
    same operations, with KvCache handles."""

    _cache_cls = KvCache


__all__ = ["CacheManager", "KvCacheManager"]
