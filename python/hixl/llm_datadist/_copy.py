"""Copies within this process (``copy_cache``, ``copy_blocks``, ``swap_blocks``): memmove
between caches' host memory, planned like transfers (``_plan``).
"""

from __future__ import annotations

import ctypes

from ._cache import Cache
from ._keys import _ManagerBase
from ._plan import _block_offsets, _entry, _pairs, _tensor_pairs
from ._status import check
from ._types import check_int, check_ints


class _Copies(_ManagerBase):
    """Local copies and swaps: the part of CacheManager that moves nothing over a link."""

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
