"""The KV layer's arguments: a cache's layout is given, never guessed, and bad arguments are
ParamInvalid (a ValueError) naming what is wrong, before or while a task runs."""

from __future__ import annotations

import numpy as np
import pytest
import test_kv
from test_kv import DT, SHAPE, filled

import hixl

ranks, kv = test_kv.ranks, test_kv.kv  # the fixtures: a worker process per rank, hixl.kv.init


def test_the_cache_layout_is_given_never_guessed(ranks, kv) -> None:
    """A (layers, blocks, block_bytes) uint8 pool, as a new user wrote it: without a layout
    allocate_cache refuses, naming block_axis (the old default, block_axis=2, took each byte
    for a block and moved wrong bytes under LLM_SUCCESS); with layer_axis=0, block_axis=1 on
    both sides the selected blocks arrive whole; a side that gives another block axis gets an
    error naming block_axis; a layout= of another shape, or an axis the shape lacks, refused."""
    shape = (4, 16, 64)  # layers, blocks, bytes per block
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=shape, dtype="uint8", seed=5, layer_axis=0, block_axis=1)
    prompt.ok("alloc", name="odd", shape=shape, dtype="uint8", seed=5, layer_axis=0, block_axis=2)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    with pytest.raises(hixl.ParamInvalid, match="block_axis"):
        hixl.kv.allocate_cache(np.zeros(shape, np.uint8), name="c")
    with pytest.raises(hixl.ParamInvalid, match="without layer_axis"):
        hixl.kv.allocate_cache(np.zeros(shape, np.uint8), name="c", block_axis=1)
    with pytest.raises(hixl.ParamInvalid, match="block_axis=3 is not an axis"):
        hixl.kv.allocate_cache(np.zeros(shape, np.uint8), name="c", layer_axis=0, block_axis=3)
    lay = hixl.kv.KVLayout(4, 2, 64, np.float16, 16, 8)
    with pytest.raises(hixl.ParamInvalid, match="layout.array"):
        hixl.kv.allocate_cache(np.zeros(shape, np.uint8), name="c", layout=lay)
    # Nothing was kept by the refusals: the name is free.
    c = hixl.kv.allocate_cache(np.zeros(shape, np.uint8), name="c", layer_axis=0, block_axis=1)
    src, dst = [3, 4, 5, 9], [0, 1, 2, 7]
    res = hixl.kv.pull_blocks(0, c, src, dst, remote_name="kv").wait()
    want = np.zeros(shape, np.uint8)
    want[:, dst] = filled(shape, 5, np.uint8)[:, src]
    assert c.array.tobytes() == want.tobytes()
    assert res.bytes == len(src) * 4 * 64
    with pytest.raises(hixl.kv.KVError, match=r"block_axis=2\).*same layout="):
        hixl.kv.pull_blocks(0, c, src, dst, remote_name="odd")
    assert c.array.tobytes() == want.tobytes(), "a refused pull moved nothing"
    lc = hixl.kv.allocate_cache(lay.array(), name="paged", layout=lay)
    assert (lc.num_layers, lc.info.num_blocks) == (4, 8)


def test_bad_arguments_met_while_a_task_runs_are_param_invalid(ranks, kv) -> None:
    """These were a KVError printed `103900: cache transfer: PARAM_INVALID (103900): ...`:
    a bad argument is a ParamInvalid (a ValueError, as docs/KV.md says), still a KVError with
    the task's result, and its text names the code once."""
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=3)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    local = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    want = "PARAM_INVALID (103900): cache transfer: remote block id 16 is out of range 0..15"
    with pytest.raises(hixl.ParamInvalid) as e:
        hixl.kv.pull_blocks(0, local, [16], [0])  # synchronous: raises from the call
    assert str(e.value) == f"{want} (cache 'kv')"
    assert isinstance(e.value, ValueError) and isinstance(e.value, hixl.kv.KVError)
    assert e.value.status_code == "103900" and e.value.code == 103900
    task = hixl.kv.pull_blocks(0, local, [16], [0], hixl.kv.CacheTransferConfig(async_enable=True))
    with pytest.raises(hixl.ParamInvalid) as e:
        task.wait(10_000)
    assert str(e.value) == f"{want} (cache 'kv')" and e.value.result.status_code == "103900"
    with pytest.raises(ValueError, match=r"^PARAM_INVALID \(103900\): [^\d]*2 remote block ids"):
        hixl.kv.push_blocks(0, local, [0], [1, 2])
    # An engine error other than PARAM_INVALID stays a KVError, its code once.
    err = hixl.kv.KVError.from_engine(hixl.Timeout("connect timed out"), "link to 10.0.0.5:1")
    assert str(err) == "TIMEOUT (103901): link to 10.0.0.5:1: connect timed out"
    assert not isinstance(err, ValueError) and err.status_code == "103901"
    assert str(hixl.kv.KVError(hixl.kv.LLM_CACHE_NOT_FOUND, "no cache")) == "LLM_002001: no cache"
