"""The KV-cache layer across real processes: each rank is its own process, bytes compared
byte for byte against what the source rank was filled with."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hixl
from hixl.kv._context import context

WORKER = str(Path(__file__).with_name("_kv_worker.py"))
SHAPE = (8, 2, 16, 4, 2, 64)  # layers, K/V, blocks, block_tokens, kv_heads, head_dim
DT = np.float16


def filled(shape: tuple[int, ...], seed: int | None, dtype: Any = DT) -> np.ndarray:
    """What a worker's alloc with this seed holds (zeros without a seed)."""
    dt = np.dtype(dtype)
    if seed is None:
        return np.zeros(shape, dt)
    n = int(np.prod(shape)) * dt.itemsize
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8).view(dt).reshape(shape)


class Rank:
    """A worker process configured only through the environment."""

    def __init__(
        self,
        cluster_id: int,
        role: str,
        peers: dict[int, str] | None = None,
        options: dict[str, str] | None = None,
        defer: bool = False,
    ) -> None:
        env = {
            **os.environ,
            "HIXL_CLUSTER_ID": str(cluster_id),
            "HIXL_ROLE": role,
            "HIXL_LISTEN": "127.0.0.1:0",
            "HIXL_PEERS": ",".join(f"{r}={a}" for r, a in (peers or {}).items()),
            "HIXL_KV_DEFER_INIT": "1" if defer else "0",
        }
        self.proc = subprocess.Popen(
            [sys.executable, WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        tag, self.address = self.proc.stdout.readline().split()
        assert tag == "READY"
        self.rank, self.role = cluster_id, role

    def send(self, cmd: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        return dict(json.loads(self.proc.stdout.readline()))

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        return self.answer()

    def ok(self, cmd: str, **kw: Any) -> dict[str, Any]:
        out = self.call(cmd, **kw)
        assert out["ok"], out
        return out

    def array(self, name: str, shape: tuple[int, ...], dtype: Any = DT) -> np.ndarray:
        raw = bytes.fromhex(self.ok("bytes", name=name)["hex"])
        return np.frombuffer(raw, dtype).reshape(shape)

    def close(self) -> None:
        try:
            self.call("exit")
            self.proc.wait(10)
        except (OSError, ValueError, subprocess.TimeoutExpired, json.JSONDecodeError):
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def ranks() -> Iterator:
    made: list[Rank] = []

    def make(
        cluster_id: int, role: str, peers: dict[int, str] | None = None, defer: bool = False
    ) -> Rank:
        r = Rank(cluster_id, role, peers, defer=defer)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def kv() -> Iterator:
    """hixl.kv.init for this (test) process; finalized afterwards whatever happens."""
    yield hixl.kv.init
    hixl.kv.finalize()


def test_pull_cache(ranks, kv) -> None:
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=1)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    local = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    assert (local.name, local.shape, local.num_layers) == ("kv", SHAPE, 8)
    res = hixl.kv.pull_cache(0, local).wait()
    assert res.status_code == "LLM_SUCCESS" and res.bytes == local.nbytes > 0
    assert res.per_rank[0].bytes == local.nbytes and res.elapsed_s > 0
    assert local.array.tobytes() == filled(SHAPE, 1).tobytes()


def test_names_default_to_allocation_order_and_peers_see_new_caches(ranks, kv) -> None:
    prompt = ranks(0, "prompt")
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    a = hixl.kv.allocate_cache(np.zeros(64, np.uint8), layer_axis=0, block_axis=None)
    b = hixl.kv.allocate_cache(np.zeros(64, np.uint8), layer_axis=0, block_axis=None)
    assert (a.name, b.name) == ("0", "1")
    # A cache the peer allocates after the link is found on first use.
    prompt.ok("alloc", name="late", shape=[4, 256], dtype="uint8", seed=5)
    late = hixl.kv.allocate_cache(
        np.zeros((4, 256), np.uint8), name="late", layer_axis=0, block_axis=None
    )
    hixl.kv.pull_cache(0, late)
    assert late.array.tobytes() == filled((4, 256), 5, np.uint8).tobytes()


def test_push_cache_to_three_ranks_from_one_buffer(ranks, kv) -> None:
    decoders = [ranks(r, "decoder") for r in (1, 2, 3)]
    for d in decoders:
        d.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=None)
    kv(cluster_id=0, role="prompt", peers={d.rank: d.address for d in decoders})
    src = hixl.kv.allocate_cache(filled(SHAPE, 7).copy(), name="kv", layer_axis=0, block_axis=2)
    cfg = hixl.kv.CacheTransferConfig(max_concurrent=6, async_enable=True)
    task = hixl.kv.push_cache([1, 2, 3], src, cfg)
    res = task.wait(30_000)
    assert task.is_done() and res.bytes == 3 * src.nbytes
    assert {r: pr.bytes for r, pr in res.per_rank.items()} == {r: src.nbytes for r in (1, 2, 3)}
    for d in decoders:
        assert d.array("kv", SHAPE).tobytes() == src.array.tobytes()


def test_blocks_with_scattered_ids(ranks, kv) -> None:
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=3)
    prompt.ok("alloc", name="dst", shape=SHAPE, dtype="float16", seed=None)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    big = (8, 2, 24, 4, 2, 64)  # the decoder's pool has more blocks than the prompt's
    local = hixl.kv.allocate_cache(np.zeros(big, DT), name="kv", layer_axis=0, block_axis=2)
    src, dst = [3, 4, 5, 9, 0, 15], [10, 11, 12, 1, 23, 2]
    res = hixl.kv.pull_blocks(0, local, src, dst).wait()
    want = np.zeros(big, DT)
    want[:, :, dst] = filled(SHAPE, 3)[:, :, src]
    assert local.array.tobytes() == want.tobytes()
    assert res.bytes == len(src) * 8 * 2 * 4 * 2 * 64 * 2
    # push_blocks: local blocks 10..12 and 1 go back into the prompt's "dst" cache.
    hixl.kv.push_blocks(0, local, [10, 11, 12, 1], [0, 1, 2, 7], remote_name="dst")
    want_remote = np.zeros(SHAPE, DT)
    want_remote[:, :, [0, 1, 2, 7]] = filled(SHAPE, 3)[:, :, [3, 4, 5, 9]]
    assert prompt.array("dst", SHAPE).tobytes() == want_remote.tobytes()
    with pytest.raises(hixl.kv.KVError, match="block id 16 is out of range 0..15") as e:
        hixl.kv.pull_blocks(0, local, [16], [0])
    assert e.value.status_code == "103900"  # the engine's PARAM_INVALID code


def test_layerwise_pull_arrives_in_order(ranks, kv) -> None:
    shape = (32, 2, 16, 16, 8, 64)  # 32 layers of 512 KiB
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=shape, dtype="float16", seed=11)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    local = hixl.kv.allocate_cache(np.zeros(shape, DT), name="kv", layer_axis=0, block_axis=2)
    syncer = hixl.kv.LayerTracker(32, sync_interval=4)
    task = hixl.kv.transfer_cache_async(0, local, syncer, mode="pull")
    seen = []
    while not seen or seen[-1] < 32:
        seen.append(syncer.wait_sync(timeout_ms=30_000))
        n = seen[-1]
        # Every layer counted as present holds the final bytes already.
        assert local.array[:n].tobytes() == filled(shape, 11)[:n].tobytes()
    # Each wait_sync returned once at least 4 more layers (or all) were present.
    assert all(b - a >= 4 or b == 32 for a, b in zip([0, *seen], seen, strict=False))
    task.wait(30_000)
    arrived = [syncer.times["arrived"][k] for k in range(32)]
    assert arrived == sorted(arrived) and arrived[0] < arrived[-1]
    assert local.array.tobytes() == filled(shape, 11).tobytes()


def test_layerwise_push_overlaps_compute(ranks, kv) -> None:
    decoder = ranks(1, "decoder")
    decoder.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=None)
    decoder.ok("receive", rank=0, name="kv")
    kv(cluster_id=0, role="prompt", peers={1: decoder.address})
    want = filled(SHAPE, 21)
    cache = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    syncer = hixl.kv.LayerTracker(8)
    task = hixl.kv.transfer_cache_async(1, cache, syncer, mode="push")
    for k in range(8):
        time.sleep(0.02)  # "computing" layer k
        cache.array[k] = want[k]
        syncer.layer_ready(k)
    res = task.wait(30_000)
    got = decoder.ok("received")
    assert res.bytes == cache.nbytes and got["bytes"] == cache.nbytes
    # The consumer had layer 0 before the producer even started sending the last layer.
    assert got["arrived"][0] < task.layer_times["submitted"][7]
    assert decoder.array("kv", SHAPE).tobytes() == want.tobytes()


def test_missing_cache_and_too_large(ranks, kv) -> None:
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="small", shape=[2, 1024], dtype="uint8", seed=1)
    prompt.ok("alloc", name="big", shape=[2, 4096], dtype="uint8", seed=1)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    local = hixl.kv.allocate_cache(
        np.zeros((2, 2048), np.uint8), name="small", layer_axis=0, block_axis=None
    )
    cfg = hixl.kv.CacheTransferConfig(async_enable=True)
    task = hixl.kv.pull_cache(0, local, cfg, remote_name="nope")
    with pytest.raises(hixl.kv.KVError) as e:
        task.wait(10_000)
    assert e.value.status_code == "LLM_002001"
    assert "'nope'" in str(e.value) and "rank 0" in str(e.value)
    with pytest.raises(hixl.kv.KVError) as e:
        hixl.kv.pull_cache(0, local, remote_name="big")  # synchronous: raises from the call
    assert e.value.status_code == "LLM_002002"
    assert "8192" in str(e.value) and "4096" in str(e.value)
    assert local.array.sum() == 0  # nothing was moved
    # The link still works for a valid transfer.
    hixl.kv.pull_cache(0, local, remote_name="small")
    assert local.array.tobytes()[:2048] == filled((2, 1024), 1, np.uint8).tobytes()


def test_engine_errors_keep_their_codes(ranks, kv) -> None:
    decoder = ranks(1, "decoder")
    decoder.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=None)
    kv(cluster_id=0, role="prompt", peers={1: decoder.address})
    cache = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    decoder.proc.kill()
    decoder.proc.wait()
    with pytest.raises(hixl.kv.KVError) as e:
        hixl.kv.push_cache(1, cache, hixl.kv.CacheTransferConfig(timeout_ms=2000))
    assert e.value.status_code in {"103901", "103902", "503900"}
    assert isinstance(e.value.__cause__, hixl.HixlError)
    # A receive with nothing coming times out within its timeout.
    syncer = hixl.kv.LayerTracker(8)
    t0 = time.monotonic()
    task = hixl.kv.receive_cache_async(
        5, cache, syncer, hixl.kv.CacheTransferConfig(timeout_ms=300)
    )
    with pytest.raises(hixl.kv.KVError) as e:
        syncer.wait_sync()
    assert e.value.status_code == "103901" and time.monotonic() - t0 < 5
    with pytest.raises(hixl.kv.KVError):
        task.wait(5000)


@pytest.mark.parametrize("mine", ["prompt", "decoder"])
def test_same_roles_refuse_to_link(ranks, kv, mine: str) -> None:
    other = ranks(0, mine)
    kv(cluster_id=1, role=mine)
    with pytest.raises(hixl.kv.KVError) as e:
        hixl.kv.link([hixl.kv.PeerRank.from_dict({"cluster_id": 0, "address": other.address})])
    assert e.value.status_code == "LLM_002003" and "not interchangeable" in str(e.value)
    mix = ranks(2, "mix")
    mix.ok("alloc", name="m", shape=[64], dtype="uint8", seed=4)
    hixl.kv.link([{"cluster_id": 2, "address": mix.address}])  # mix links with both
    m = hixl.kv.allocate_cache(np.zeros(64, np.uint8), name="m", layer_axis=0, block_axis=None)
    hixl.kv.pull_cache(2, m)
    assert m.array.tobytes() == filled((64,), 4, np.uint8).tobytes()
    hixl.kv.unlink([2])
    with pytest.raises(hixl.kv.KVError, match="LLM_002004"):
        hixl.kv.pull_cache(2, m)
    with pytest.raises(hixl.kv.KVError, match="LLM_002004"):
        hixl.kv.pull_cache(
            0, hixl.kv.allocate_cache(np.zeros(64, np.uint8), layer_axis=0, block_axis=None)
        )


def test_init_from_environment_only(ranks, monkeypatch) -> None:
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=9)
    decoder = ranks(1, "decoder", peers={0: prompt.address})  # a bare hixl.kv.init() links
    decoder.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=None)
    decoder.ok("pull", rank=0, name="kv")
    assert (
        decoder.array("kv", (4, 512), np.uint8).tobytes() == filled((4, 512), 9, np.uint8).tobytes()
    )
    for var in ("HIXL_CLUSTER_ID", "HIXL_ROLE", "HIXL_PEERS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(hixl.ParamInvalid, match="HIXL_CLUSTER_ID"):
        hixl.kv.init()


def test_bad_arguments(kv) -> None:
    with pytest.raises(hixl.ParamInvalid, match="role='boss'"):
        hixl.kv.init(cluster_id=0, role="boss")
    kv(cluster_id=0, role="mix")
    with pytest.raises(hixl.Failed, match="already called"):
        hixl.kv.init(cluster_id=1)
    with pytest.raises(hixl.ParamInvalid, match="needs a CUDA array"):
        hixl.kv.allocate_cache(
            np.zeros(64, np.uint8), mem_type="device", layer_axis=0, block_axis=None
        )
    with pytest.raises(hixl.ParamInvalid, match="max_concurrent=0"):
        hixl.kv.CacheTransferConfig(max_concurrent=0)
    with pytest.raises(hixl.ParamInvalid, match="total_layers=0"):
        hixl.kv.LayerTracker(0)
    c = hixl.kv.allocate_cache(np.zeros((4, 64), np.uint8), name="x", layer_axis=0, block_axis=None)
    with pytest.raises(hixl.ParamInvalid, match="already exists"):
        hixl.kv.allocate_cache(np.zeros(64, np.uint8), name="x", layer_axis=0, block_axis=None)
    with pytest.raises(hixl.ParamInvalid, match="total_layers=8"):
        hixl.kv.transfer_cache_async(0, c, hixl.kv.LayerTracker(8))
    with pytest.raises(hixl.ParamInvalid, match="not C-contiguous"):
        hixl.kv.allocate_cache(np.zeros((8, 8), np.uint8)[:, ::2], layer_axis=0, block_axis=None)


def test_ranks_link_both_ways_push_then_pull(ranks) -> None:
    # Each rank reads the other's directory into its scratch buffer; neither may then take
    # the other's scratch (holding a copy of its own directory) for the other's directory.
    a, b = ranks(0, "prompt"), ranks(1, "decoder")
    a.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=3)
    b.ok("alloc", name="in", shape=[4, 512], dtype="uint8", seed=None)
    b.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=None)
    a.ok("link", ranks=[{"cluster_id": 1, "address": b.address}])
    b.ok("link", ranks=[{"cluster_id": 0, "address": a.address}])
    assert a.ok("linked")["linked"] == [1] and b.ok("linked")["linked"] == [0]
    want = filled((4, 512), 3, np.uint8).tobytes()
    a.ok("push", ranks=[1], name="kv", remote_name="in")  # prefill pushes to decode ...
    b.ok("pull", rank=0, name="kv")  # ... then decode pulls from prefill
    assert b.array("in", (4, 512), np.uint8).tobytes() == want
    assert b.array("kv", (4, 512), np.uint8).tobytes() == want


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that nothing listened on a moment ago."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sk in socks:
            sk.bind(("127.0.0.1", 0))
        return [int(sk.getsockname()[1]) for sk in socks]
    finally:
        for sk in socks:
            sk.close()


DEPLOY_SHAPE = (4, 2, 4, 4, 2, 64)  # 32 KiB of float16: rounds stay cheap


def deploy_round(workers: list[Rank], rnd: int) -> None:
    """One deployment-style start: every worker calls hixl.kv.init(cluster_id, role, listen,
    peers={every rank of the other role}) at the same instant; then each prompt rank pushes
    its cache to every decoder, each decoder pulls every prompt's cache, and every byte is
    checked; then all finalize."""
    prompts = [wk for wk in workers if wk.role == "prompt"]
    decoders = [wk for wk in workers if wk.role == "decoder"]
    addr = {
        wk.rank: f"127.0.0.1:{p}" for wk, p in zip(workers, free_ports(len(workers)), strict=True)
    }
    at = time.monotonic() + 0.15
    for wk in workers:
        others = decoders if wk.role == "prompt" else prompts
        peers = {o.rank: addr[o.rank] for o in others}
        wk.send("init", at=at, cluster_id=wk.rank, role=wk.role, listen=addr[wk.rank], peers=peers)
    got = {wk.rank: wk.answer() for wk in workers}
    assert all(g["ok"] for g in got.values()), f"round {rnd}: {got}"
    for wk in workers:
        others = decoders if wk.role == "prompt" else prompts
        assert got[wk.rank]["linked"] == sorted(o.rank for o in others), (rnd, got)
    want = {}
    for p in prompts:
        seed = 1000 * rnd + p.rank
        p.ok("alloc", name="kv", shape=DEPLOY_SHAPE, dtype="float16", seed=seed)
        want[p.rank] = hashlib.sha256(filled(DEPLOY_SHAPE, seed).tobytes()).hexdigest()
    for d in decoders:
        for p in prompts:
            for kind in ("push", "pull"):
                d.ok("alloc", name=f"{kind}{p.rank}", shape=DEPLOY_SHAPE, dtype="float16")
    for p in prompts:  # every prompt pushes to every decoder, all at once
        p.send("push", ranks=[d.rank for d in decoders], name="kv", remote_name=f"push{p.rank}")
    assert all(a["ok"] for a in [p.answer() for p in prompts]), rnd
    for d in decoders:  # then every decoder pulls from every prompt, all at once
        for p in prompts:
            d.send("pull", rank=p.rank, name=f"pull{p.rank}", remote_name="kv")
    for d in decoders:
        for _ in prompts:
            assert (a := d.answer())["ok"], (rnd, d.rank, a)
    for d in decoders:
        for p in prompts:
            for kind in ("push", "pull"):
                digest = d.ok("digest", name=f"{kind}{p.rank}")["sha256"]
                assert digest == want[p.rank], f"round {rnd}: {kind} {p.rank} -> {d.rank}"
    for wk in workers:
        wk.send("finalize")
    assert all(wk.answer()["ok"] for wk in workers)


@pytest.mark.parametrize("n_prompt,n_decoder", [(1, 4), (2, 3)])
def test_ranks_started_together_link_and_move_bytes(ranks, n_prompt, n_decoder) -> None:
    """Deployment style: all ranks start at the same instant, each listing every rank of the
    other role in peers=, so every pair links both ways at once; 20 rounds, each a fresh
    start on fresh ports, every link up and every pushed and pulled byte right."""
    roles = ["prompt"] * n_prompt + ["decoder"] * n_decoder
    workers = [ranks(r, role, defer=True) for r, role in enumerate(roles)]
    for rnd in range(20):
        deploy_round(workers, rnd)


def test_one_prompt_links_eight_decoders_at_once(ranks, kv, free_port) -> None:
    """hixl.kv.init(peers=8 decoders) links all 8 (in parallel: benches/kv_link.py measures how
    long it takes); a push then reaches every one of them."""
    decoders = [ranks(r, "decoder") for r in range(1, 9)]
    for d in decoders:
        d.ok("alloc", name="kv", shape=[2, 1024], dtype="uint8", seed=None)
    kv(cluster_id=0, role="prompt", peers={d.rank: d.address for d in decoders})
    assert sorted(context().peers) == list(range(1, 9))
    src = hixl.kv.allocate_cache(
        filled((2, 1024), 8, np.uint8).copy(), name="kv", layer_axis=0, block_axis=None
    )
    hixl.kv.push_cache(list(range(1, 9)), src, hixl.kv.CacheTransferConfig(max_concurrent=8))
    for d in decoders:
        assert d.array("kv", (2, 1024), np.uint8).tobytes() == src.array.tobytes()
    # Links that fail are reported (the first in the order given) once every link was tried;
    # the others are up.
    hixl.kv.unlink([1, 2])
    dead = f"127.0.0.1:{free_port}"
    with pytest.raises(hixl.kv.KVError, match=dead) as e:
        hixl.kv.link([1, {"cluster_id": 9, "address": dead}, 2], timeout_ms=300)
    assert e.value.status_code in {"103901", "103902"}
    assert sorted(context().peers) == list(range(1, 9))


def test_kv_tasks_and_layers_are_awaitable(ranks, kv) -> None:
    """asyncio: `await syncer.wait_sync_async()` follows a layerwise pull without blocking the
    loop, and `await task` returns the task's result (or raises its KVError)."""
    import asyncio

    shape = (16, 2, 16, 16, 8, 64)  # 16 layers of 512 KiB
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=shape, dtype="float16", seed=13)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    local = hixl.kv.allocate_cache(np.zeros(shape, DT), name="kv", layer_axis=0, block_axis=2)

    async def main() -> tuple[list[int], int]:
        syncer = hixl.kv.LayerTracker(16, sync_interval=4)
        task = hixl.kv.transfer_cache_async(0, local, syncer, mode="pull")
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        seen: list[int] = []
        while not seen or seen[-1] < 16:
            seen.append(await syncer.wait_sync_async(timeout_ms=30_000))
            n = seen[-1]
            assert local.array[:n].tobytes() == filled(shape, 13)[:n].tobytes()
        res = await task
        assert res.bytes == local.nbytes
        with pytest.raises(hixl.Timeout):
            await hixl.kv.LayerTracker(2).wait_layer_async(1, timeout_ms=50)
        t.cancel()
        return seen, ticks

    seen, ticks = asyncio.run(main())
    steps = zip([0, *seen], seen, strict=False)
    assert seen[-1] == 16 and all(b - a >= 4 or b == 16 for a, b in steps)
    assert ticks > len(seen), "the loop kept running while the layers arrived"
    assert local.array.tobytes() == filled(shape, 13).tobytes()


NOTIFY_PEER = str(Path(__file__).with_name("_sec_notify_peer.py"))


def send_from_own_engine(addr: str, *pairs: str) -> str:
    """Runs an engine in a process of its own that sends (name, msg) pairs to `addr`; returns
    its engine id."""
    out = subprocess.run(
        [sys.executable, NOTIFY_PEER, "notify", addr, *pairs],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr
    tag, engine = out.stdout.split()
    assert tag == "SENT"
    return engine


def collect(e: hixl.Hixl, n: int, timeout_s: float = 10) -> list[hixl.NotifyDesc]:
    """What the application's own wait_notifies returns until `n` came (or the time is up)."""
    got: list[hixl.NotifyDesc] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        with contextlib.suppress(hixl.Timeout):
            got += e.wait_notifies(200)
    return got


def test_a_receive_leaves_the_applications_notifications_to_it(kv) -> None:
    """A layerwise receive takes only its layer notifications from the engine: the
    application's own, sent by another engine among the layers while the receive runs, all
    reach the application's wait_notifies, in order, and the receive still completes."""
    kv(cluster_id=0, role="decoder")
    cache = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    syncer = hixl.kv.LayerTracker(SHAPE[0])
    task = hixl.kv.receive_cache_async(
        5, cache, syncer, hixl.kv.CacheTransferConfig(timeout_ms=30_000)
    )
    app = [(f"app.{i % 3}", f"msg {i}") for i in range(30)]
    pairs: list[str] = []
    for i, (name, msg) in enumerate(app):
        pairs += [name, msg]
        if i < SHAPE[0]:
            pairs += ["hixl.kv.layer", f"5:kv:{i}"]
    sender = send_from_own_engine(context().address, *pairs)
    task.wait(10_000)
    assert syncer.get_layer_count() == SHAPE[0]
    got = collect(context().engine, len(app))
    assert [(n.name, n.msg) for n in got] == app
    assert {n.peer for n in got} == {sender}
    assert context().engine.get_notifies() == []


def test_the_mailbox_counts_and_logs_what_it_drops_at_its_cap(kv, caplog) -> None:
    """Layer notifications no receive takes wait in the mailbox, within a budget of the
    engine's limits (per sender and in all); beyond it the newest are dropped (as the engine
    refuses them), and those no receive here could take (a cache not registered here, a
    malformed text) are dropped at once; all counted and logged. The application's own stay
    in the engine."""
    from hixl._kvcore._notify import Budget
    from hixl.kv._layerwise import _for_later

    kv(cluster_id=0, role="decoder")
    hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="other", layer_axis=0, block_axis=2)
    box = context().mailbox
    box.budget = Budget(3, 1 << 20, 100, 1 << 20)
    pairs = [p for i in range(5) for p in ("hixl.kv.layer", f"7:other:{i}")]
    pairs += ["hixl.kv.layer", "7:nowhere:0", "hixl.kv.layer", "7:other:1e999"]
    send_from_own_engine(context().address, *pairs, "app", "mine")
    with caplog.at_level(logging.WARNING, logger="hixl.kv"):
        assert box.take("hixl.kv.layer", lambda n: False, _for_later(context())) == []
    assert box.dropped == 4
    assert [n.msg for n in box.pending] == [f"7:other:{i}" for i in (0, 1, 2)]
    assert box.held_bytes == sum(len("hixl.kv.layer") + len(n.msg) for n in box.pending)
    assert "dropped 2 notifications named 'hixl.kv.layer' that no receive" in caplog.text
    assert "and 2 over the budget" in caplog.text
    assert [(n.name, n.msg) for n in context().engine.get_notifies()] == [("app", "mine")]


def test_mismatched_block_lists_are_reported_before_the_link(kv) -> None:
    """Issue 35, item 15: block lists of different lengths are a PARAM_INVALID naming the
    lengths even when the rank is not linked (the link error used to hide it)."""
    kv(cluster_id=1, role="decoder")  # rank 0 is not linked
    local = hixl.kv.allocate_cache(np.zeros(SHAPE, DT), name="kv", layer_axis=0, block_axis=2)
    for call in (hixl.kv.pull_blocks, hixl.kv.push_blocks):
        with pytest.raises(hixl.kv.KVError, match=r"[12] remote block ids but [12] local") as e:
            call(0, local, [0, 1], [2]).wait()
        assert e.value.status_code == "103900"
