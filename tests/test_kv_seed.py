"""The seed article's KV-cache examples (shared/seeds, 003) run on hixl as written, with only
their device lines changed: its layerwise loop never reads a layer that has not arrived, and
its error names are aliases of hixl's codes."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_kv import Rank, filled

import hixl


def test_seed_layerwise_example_runs() -> None:
    shape = (8192, 8192)  # 128 MiB of fp16, described as 32 layers of 256 rows
    prompt = Rank(1, "prompt")
    try:
        prompt.ok("alloc", name="kv", shape=list(shape), dtype="float16", seed=7)
        hixl.kv.init(cluster_id=0, role="decoder", peers={1: prompt.address})
        try:
            want = filled(shape, 7)
            decoded: list[int] = []

            def decode_layer(k: int) -> None:
                rows = slice(k * 256, (k + 1) * 256)
                assert big_cache[rows].tobytes() == want[rows].tobytes(), f"layer {k} absent"
                decoded.append(k)

            # The seed's example; device lines: torch NPU tensor -> host array, "device" -> "host".
            big_cache = np.zeros(shape, dtype=np.float16)
            layers = hixl.kv.allocate_cache(
                big_cache, mem_type="host", name="kv", layer_axis=0, block_axis=None
            )
            syncer = hixl.kv.LayerTracker(total_layers=32, sync_interval=1)
            async_task = hixl.kv.transfer_cache_async(
                remote_rank=1, local_cache=layers, synchronizer=syncer
            )
            while not async_task.is_done():
                current_layer = syncer.get_current_layer()
                decode_layer(current_layer)
                syncer.wait_sync()

            res = async_task.wait(60_000)
            assert res.bytes == big_cache.nbytes
            assert decoded and decoded == sorted(decoded) and decoded[-1] <= 31
            assert syncer.get_current_layer() == 31 and syncer.get_layer_count() == 32
            assert big_cache.tobytes() == want.tobytes()
        finally:
            hixl.kv.finalize()
    finally:
        prompt.close()


def test_get_current_layer_waits_for_the_first_layer() -> None:
    s = hixl.kv.LayerTracker(4, timeout_ms=150)
    assert s.get_layer_count() == 0
    t0 = time.monotonic()
    with pytest.raises(hixl.Timeout, match="0 of 4 layers"):
        s.get_current_layer()
    assert 0.1 < time.monotonic() - t0 < 5
    s.layer_ready(1)
    with pytest.raises(hixl.Timeout):
        s.get_current_layer()  # layer 0 still absent: no complete prefix yet
    s.layer_ready(0)
    assert (s.get_current_layer(), s.get_layer_count()) == (1, 2)
    s.layer_ready(2)
    assert (s.get_current_layer(), s.get_layer_count()) == (2, 3)
    with pytest.raises(hixl.ParamInvalid, match="timeout_ms"):
        hixl.kv.LayerTracker(4, timeout_ms=0)


def test_synchronizer_layers_must_divide_the_cache_layers() -> None:
    hixl.kv.init(cluster_id=0, role="decoder")
    try:
        c = hixl.kv.allocate_cache(
            np.zeros((12, 64), np.uint8), name="x", layer_axis=0, block_axis=None
        )
        with pytest.raises(hixl.ParamInvalid, match="total_layers=5"):
            hixl.kv.transfer_cache_async(1, c, hixl.kv.LayerTracker(5))
    finally:
        hixl.kv.finalize()


def test_seed_error_names_alias_the_codes() -> None:
    assert hixl.kv.HIXL_001001 is hixl.Status.PARAM_INVALID
    assert hixl.kv.HIXL_001002 is hixl.Status.TIMEOUT
    assert hixl.kv.HIXL_001003 is hixl.Status.FAILED
    e = hixl.Hixl()
    e.initialize("127.0.0.1")
    buf = hixl.aligned_empty(8192)
    e.register(buf[:4096])
    with pytest.raises(hixl.HixlError) as ei:  # overlapping memory: registration fails
        e.register_mem(hixl.MemDesc(buf.ctypes.data + 2048, 4096))
    assert ei.value.code == hixl.kv.HIXL_001001
    with pytest.raises(hixl.HixlError) as ei:
        hixl.kv.init(cluster_id=0, role="decoder", peers={1: "127.0.0.1:9"}, link_timeout_ms=300)
    assert ei.value.code == hixl.kv.HIXL_001002 or ei.value.status == hixl.Status.NOT_CONNECTED
    e.finalize()
    with pytest.raises(hixl.HixlError) as ei:
        e.register(np.zeros(64, np.uint8))
    assert ei.value.code == hixl.kv.HIXL_001003
