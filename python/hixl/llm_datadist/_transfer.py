"""Moves between this process's caches and remote ones, one-sided over hixl: ``pull_cache``,
``pull_blocks``, ``push_cache``, ``push_blocks`` and the layer-by-layer
``transfer_cache_async``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _place
from .._errors import HixlError
from .._errors import Timeout as HixlTimeout
from .._hixl import TransferOp
from .._kvcore._executor import Flight
from .._kvcore._layers import feed_layers
from .._kvcore._plan import descs
from .._kvcore._window import WAIT_MARGIN_MS
from ._cache import Cache, CacheTask
from ._keys import _ManagerBase
from ._plan import (
    _block_bytes,
    _block_offsets,
    _entry,
    _entry_offsets,
    _entry_to_blocks,
    _flip,
    _pairs,
    _tensor_pairs,
)
from ._status import LLMException, LLMStatusCode, check, code_of, wrap
from ._types import (
    TENSORS_PER_LAYER,
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_int,
    check_ints,
)


class _Transfers(_ManagerBase):
    """Pulls, pushes and layerwise sends: the part of CacheManager that uses the links."""

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
            # Arguments before link state: a length error is not hidden by "not linked".
            check(
                len(sbl) == len(dbl), f"{len(sbl)} source blocks but {len(dbl)} destination blocks"
            )
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

        stopped = [False]

        def ready(layer: int) -> bool:
            """Whether synchronize_layer says `layer` is computed; on False (or its error)
            every destination still going gets that status, and the send stops."""
            why = LLMStatusCode.LLM_TIMEOUT  # synchronize_layer said False
            try:
                ok = bool(layer_synchronizer.synchronize_layer(layer, node.timeout_ms))
            except Exception as exc:  # noqa: BLE001 - recorded on the task
                task.error, ok, why = exc, False, code_of(exc)
            if ok:
                return True
            for i in range(len(plans)):
                if task._results[i] == LLMStatusCode.LLM_SUCCESS:
                    task._results[i] = why
            stopped[0] = True
            return False

        def failed(i: int, exc: Exception) -> None:
            err = exc
            if isinstance(exc, HixlError):
                err = wrap(exc, node.what(plans[i][0], TransferOp.WRITE))
                if err is not exc:
                    err.__cause__ = exc
            task._results[i] = code_of(err)
            task.error = err

        # The layers' requests are completed on the KV core's executor; this task's thread
        # only waits for the user's synchronize_layer.
        flight: Flight[int] = Flight(
            node.engine, 1, node.timeout_ms, lambda _: None, failed, lambda: None
        )
        wait_s = len(plans) * (node.timeout_ms + WAIT_MARGIN_MS) / 1000 + 1

        def submit(layer: int) -> None:
            """Layer `layer` to every destination that has not failed, one after the other."""
            for i, (_cluster, address, per_layer) in enumerate(plans):
                if layer not in per_layer or task._results[i] != LLMStatusCode.LLM_SUCCESS:
                    continue
                if not per_layer[layer]:
                    continue
                try:
                    flight.submit(
                        i, address, TransferOp.WRITE, descs(per_layer[layer]), stuck=node.stuck
                    )
                except Exception as exc:  # noqa: BLE001 - recorded on the task
                    failed(i, exc)

        def run() -> None:
            try:
                feed_layers(flight, order, ready, submit, lambda: not stopped[0], wait_s)
            except HixlTimeout as exc:
                for i in range(len(plans)):
                    if task._results[i] == LLMStatusCode.LLM_SUCCESS:
                        task._results[i] = LLMStatusCode.LLM_TIMEOUT
                task.error = exc
            finally:
                task._finish()

        _place.thread(run, name="hixl-lldd-layerwise").start()
        return task
