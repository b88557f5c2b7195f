"""A request's handoff between a prefill and a decode pool (hixl.kv): only the request's
blocks move, remapped, layer by layer, with the request id on each layer's notification;
several requests land in one decode pool at once, each receive ending on its own; pools may
be one array or a list of per-layer arrays (vLLM's); bad block lists are refused before
anything moves. The decode (or prefill) side is a real second process, tests/_kv_pool.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _kv_pool import pattern
from _lineproc import LineProc
from hypothesis import given
from hypothesis import strategies as st

import hixl

L, T, H, D = 4, 4, 2, 16  # layers, block tokens, kv heads, head size
PREFILL_BLOCKS, DECODE_BLOCKS = 12, 24
REQ_A = ([3, 4, 5, 9], [0, 1, 2, 7])
REQ_B = ([10, 11], [20, 3])


class Pool(LineProc):
    """A tests/_kv_pool.py rank: `ask` sends a command and its JSON, returns the answer."""

    def __init__(self, rank: int, role: str) -> None:
        super().__init__(["_kv_pool.py", rank, role])
        self.address = self.words[1]

    def ask(self, word: str, timeout: float = 60, **kw: Any) -> dict[str, Any]:
        out = json.loads(self.cmd(word, json.dumps(kw), timeout=timeout))
        assert out["ok"], out
        return dict(out)

    def pool(self, name: str) -> bytes:
        return bytes.fromhex(self.ask("bytes", name=name)["hex"])


@pytest.fixture
def pools() -> Iterator:
    made: list[Pool] = []

    def make(rank: int, role: str) -> Pool:
        made.append(Pool(rank, role))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.fixture
def kv() -> Iterator:
    yield hixl.kv.init
    hixl.kv.finalize()


def array_pool(blocks: int, seed: int) -> np.ndarray:
    """One array (layers, K/V, blocks, tokens, heads, head): layer axis 0, block axis 2."""
    return pattern([L, 2, blocks, T, H, D], seed)


def list_pool(shape: list[int], seed: int) -> list[np.ndarray]:
    """vLLM's layout: one array a layer, layer k filled with pattern(shape, seed + k)."""
    return [pattern(shape, seed + k) for k in range(L)]


def moved(dst: list[np.ndarray], src: list[np.ndarray], ax: int, pairs: list) -> None:
    """What a handoff does to `dst` (per-layer views, block axis `ax`): each (src ids, dst
    ids) request copies src's blocks into dst's, every layer, K and V."""
    for s_ids, d_ids in pairs:
        for d, s in zip(dst, src, strict=True):
            for si, di in zip(s_ids, d_ids, strict=True):
                np.moveaxis(d, ax, 0)[di] = np.moveaxis(s, ax, 0)[si]


def same_blocks(got: bytes, want: list[np.ndarray], ax: int) -> None:
    """`got` (a pool's bytes, layer after layer) equals `want`, compared per layer and block
    so that a failure names both."""
    off = 0
    for k, w in enumerate(want):
        g = np.frombuffer(got[off : off + w.nbytes], w.dtype).reshape(w.shape)
        off += w.nbytes
        for b in range(w.shape[ax]):
            gb, wb = np.take(g, b, axis=ax), np.take(w, b, axis=ax)
            assert gb.tobytes() == wb.tobytes(), f"layer {k}, block {b} differs"
    assert off == len(got)


def wait_done(pool: Pool, rid: str | None, deadline_s: float = 30) -> dict[str, Any]:
    """Polls the receive of `rid` until it has ended (fails after `deadline_s`)."""
    end = time.monotonic() + deadline_s
    while True:
        got = pool.ask("done", request_id=rid)
        if got["done"] or time.monotonic() > end:
            assert got["done"], f"the receive of {rid!r} has not ended: {got}"
            return got
        time.sleep(0.01)


def test_two_requests_land_in_one_decode_pool_each_on_its_own(pools, kv) -> None:
    """Request A's and B's blocks, remapped, pushed layer by layer with their request ids
    into one decode pool of another size: A's receive ends while B still lacks layers, and
    afterwards the pool holds exactly both requests' blocks, every other block untouched."""
    dec = pools(1, "decoder")
    dec.ask(
        "alloc", name="kv", shape=[L, 2, DECODE_BLOCKS, T, H, D], layer_axis=0, block_axis=2, seed=7
    )
    me = kv(cluster_id=0, role="prompt", peers={1: dec.address})
    dec.ask("link", rank=0, address=me.address)
    for rid in ("req-A", "req-B"):
        dec.ask("receive", rank=0, name="kv", layers=L, request_id=rid, timeout_ms=30_000)
    src = array_pool(PREFILL_BLOCKS, 1)
    cache = hixl.kv.allocate_cache(src, name="kv", layer_axis=0, block_axis=2)
    sa, sb = hixl.kv.LayerTracker(L), hixl.kv.LayerTracker(L)
    ta = hixl.kv.transfer_cache_async(
        1, cache, sa, "push", src_blocks=REQ_A[0], dst_blocks=REQ_A[1], request_id="req-A"
    )
    tb = hixl.kv.transfer_cache_async(
        1, cache, sb, "push", src_blocks=REQ_B[0], dst_blocks=REQ_B[1], request_id="req-B"
    )
    for k in range(L):  # the layers of both requests, interleaved; B stops at layer 1
        sa.layer_ready(k)
        if k < 2:
            sb.layer_ready(k)
    ra = ta.wait(30_000)
    wait_done(dec, "req-A")
    assert dec.ask("received", request_id="req-A")["bytes"] == ra.bytes
    got_b = dec.ask("done", request_id="req-B")
    assert not got_b["done"] and got_b["layers"] <= 2  # B's layers 2, 3 were never sent
    for k in (2, 3):
        sb.layer_ready(k)
    rb = tb.wait(30_000)
    assert dec.ask("received", request_id="req-B")["bytes"] == rb.bytes
    block = 2 * T * H * D * 2  # K and V of one block in one layer
    assert (ra.bytes, rb.bytes) == (4 * L * block, 2 * L * block)
    want = [pattern([L, 2, DECODE_BLOCKS, T, H, D], 7)[k] for k in range(L)]
    moved(want, list(src), 1, [REQ_A, REQ_B])
    same_blocks(dec.pool("kv"), want, 1)


def test_pull_moves_only_the_listed_blocks_into_a_list_of_layers(pools, kv) -> None:
    """Pull mode with block lists, in layer order, from a prefill's one-array pool into a
    decode pool of per-layer arrays (vLLM's [2, blocks, tokens, heads, head]) of another
    size; every other block of the decode pool is untouched."""
    pre = pools(0, "prompt")
    pre.ask(
        "alloc",
        name="kv",
        shape=[L, 2, PREFILL_BLOCKS, T, H, D],
        layer_axis=0,
        block_axis=2,
        seed=1,
    )
    kv(cluster_id=1, role="decoder", peers={0: pre.address})
    dst = list_pool([2, DECODE_BLOCKS, T, H, D], 50)
    cache = hixl.kv.allocate_cache(dst, name="kv", block_axis=1)
    assert cache.shape == (L, 2, DECODE_BLOCKS, T, H, D) and len(cache.handles) == L
    syncer = hixl.kv.LayerTracker(L)
    task = hixl.kv.transfer_cache_async(
        0, cache, syncer, "pull", src_blocks=REQ_A[0], dst_blocks=REQ_A[1]
    )
    assert syncer.wait_sync(30_000) >= 1
    res = task.wait(30_000)
    assert syncer.get_layer_count() == L and res.bytes == 4 * L * 2 * T * H * D * 2
    want = list_pool([2, DECODE_BLOCKS, T, H, D], 50)
    moved(want, list(array_pool(PREFILL_BLOCKS, 1)), 1, [REQ_A])
    same_blocks(b"".join(a.tobytes() for a in dst), want, 1)


@pytest.mark.parametrize(
    ("shape", "ax"),
    [
        (lambda n: [2, n, T, H, D], 1),  # K/V first: a block is 2 strided pieces a layer
        (lambda n: [n, 2, T, H, D], 0),  # blocks first: a block is one piece a layer
    ],
    ids=["kv-first", "blocks-first"],
)
def test_lists_of_layer_arrays_on_both_sides(pools, kv, shape, ax) -> None:
    """vLLM's per-layer tensors on both sides (each layer its own region), two requests
    pushed with request ids: exactly their blocks' bytes move."""
    dec = pools(1, "decoder")
    dec.ask("alloc", name="kv", shape=shape(DECODE_BLOCKS), layers=L, block_axis=ax, seed=70)
    me = kv(cluster_id=0, role="prompt", peers={1: dec.address})
    dec.ask("link", rank=0, address=me.address)
    for rid in ("a", "b"):
        dec.ask("receive", rank=0, name="kv", layers=L, request_id=rid, timeout_ms=30_000)
    src = list_pool(shape(PREFILL_BLOCKS), 10)
    cache = hixl.kv.allocate_cache(src, name="kv", block_axis=ax)
    tasks = []
    for rid, (s, d) in (("a", REQ_A), ("b", REQ_B)):
        syncer = hixl.kv.LayerTracker(L)
        tasks.append(
            hixl.kv.transfer_cache_async(
                1, cache, syncer, "push", src_blocks=s, dst_blocks=d, request_id=rid
            )
        )
        for k in range(L):
            syncer.layer_ready(k)
    for rid, t in zip(("a", "b"), tasks, strict=True):
        assert dec.ask("received", request_id=rid)["bytes"] == t.wait(30_000).bytes > 0
    want = list_pool(shape(DECODE_BLOCKS), 70)
    moved(want, src, ax, [REQ_A, REQ_B])
    same_blocks(dec.pool("kv"), want, ax)


BAD = [
    ({"src_blocks": [3, 12], "dst_blocks": [0, 1]}, r"src block id 12 is out of range 0\.\.11"),
    ({"src_blocks": [-1], "dst_blocks": [0]}, r"src block id -1 is out of range"),
    ({"src_blocks": [3], "dst_blocks": [24]}, r"dst block id 24 is out of range 0\.\.23"),
    ({"src_blocks": [True, 4], "dst_blocks": [0, 1]}, r"src block ids\[0\]=True is not a block id"),
    ({"src_blocks": [3], "dst_blocks": [1.0]}, r"dst block ids\[0\]=1\.0 is not a block id"),
    ({"src_blocks": ["3"], "dst_blocks": [1]}, r"src block ids\[0\]='3' is not a block id"),
    ({"src_blocks": np.array([3.0]), "dst_blocks": [1]}, r"src block ids has dtype float64"),
    ({"src_blocks": [3, 4], "dst_blocks": [0]}, r"1 dst block ids but 2 src ones"),
    ({"src_blocks": [3]}, r"src_blocks was given without dst_blocks"),
    ({"src_blocks": [], "dst_blocks": []}, r"empty"),
    ({"src_blocks": [3], "dst_blocks": [0], "request_id": "a\nb"}, r"control characters"),
    ({"src_blocks": [3], "dst_blocks": [0], "request_id": "r" * 257}, r"257 characters"),
    ({"src_blocks": [3], "dst_blocks": [0], "request_id": ""}, r"request id is empty"),
    ({"src_blocks": [3], "dst_blocks": [0], "request_id": 7}, r"request id must be a string"),
]


def test_bad_block_lists_are_refused_before_anything_moves(pools, kv) -> None:
    """Every bad argument is a KVError (PARAM_INVALID) naming the value, at once or when the
    task runs, and the decode pool holds its pre-fill pattern afterwards."""
    dec = pools(1, "decoder")
    dec.ask(
        "alloc", name="kv", shape=[L, 2, DECODE_BLOCKS, T, H, D], layer_axis=0, block_axis=2, seed=7
    )
    kv(cluster_id=0, role="prompt", peers={1: dec.address})
    cache = hixl.kv.allocate_cache(
        array_pool(PREFILL_BLOCKS, 1), name="kv", layer_axis=0, block_axis=2
    )
    for kw, msg in BAD:
        syncer = hixl.kv.LayerTracker(L)
        with pytest.raises(hixl.kv.KVError, match=msg) as e:
            task = hixl.kv.transfer_cache_async(1, cache, syncer, "push", **kw)
            for k in range(L):
                syncer.layer_ready(k)
            task.wait(30_000)
        assert e.value.status_code == "103900", kw
    with pytest.raises(hixl.kv.KVError, match="names the layer notifications of a push"):
        hixl.kv.transfer_cache_async(1, cache, hixl.kv.LayerTracker(L), "pull", request_id="x")
    with pytest.raises(hixl.kv.KVError, match="control characters"):
        hixl.kv.receive_cache_async(1, cache, hixl.kv.LayerTracker(L), request_id="\x1b[2J")
    assert dec.pool("kv") == pattern([L, 2, DECODE_BLOCKS, T, H, D], 7).tobytes()


def test_a_list_of_layers_is_refused_with_a_layer_axis_or_unlike_layers(kv) -> None:
    kv(cluster_id=0, role="prompt")
    layers = list_pool([2, 4, T, H, D], 0)
    with pytest.raises(hixl.ParamInvalid, match="block_axis= only"):
        hixl.kv.allocate_cache(layers, layer_axis=0, block_axis=1)
    with pytest.raises(hixl.ParamInvalid, match="needs block_axis="):
        hixl.kv.allocate_cache(layers)
    with pytest.raises(hixl.ParamInvalid, match="block_axis=5 is not an axis"):
        hixl.kv.allocate_cache(layers, block_axis=5)
    with pytest.raises(hixl.ParamInvalid, match="layer 1 of cache"):
        hixl.kv.allocate_cache([layers[0], layers[1][:, :2].copy()], block_axis=1)


def test_engine_is_the_kv_layers_own(kv) -> None:
    with pytest.raises(hixl.Failed, match=r"call hixl.kv.init\(\) first"):
        hixl.kv.engine()
    me = kv(cluster_id=0, role="prompt")
    eng = hixl.kv.engine()
    assert isinstance(eng, hixl.Hixl) and eng.local_engine == me.address
    hixl.kv.finalize()
    with pytest.raises(hixl.Failed, match="not initialized"):
        hixl.kv.engine()


MAX_REQUEST_ID = 256  # hixl.kv._notes.MAX_REQUEST_ID, checked below
REQUEST_IDS = st.text(
    st.characters(blacklist_categories=("Cc",)), min_size=1, max_size=MAX_REQUEST_ID
)


@given(
    st.integers(0, 2**63 - 1),
    st.text(max_size=50),
    st.integers(0, 2**63 - 1),
    REQUEST_IDS,
    st.integers(0, 2**40),
)
def test_request_notes_a_producer_sends_are_read_back(rank, name, layer, rid, n) -> None:
    from hixl.kv._notes import MAX_REQUEST_ID as most
    from hixl.kv._notes import note_text, parse_note

    assert most == MAX_REQUEST_ID
    note = parse_note(note_text(rank, name, layer, rid, n))
    assert (note.rank, note.cache, note.layer, note.request, note.nbytes) == (
        rank,
        name,
        layer,
        rid,
        n,
    )
    old = parse_note(note_text(rank, name, layer, None, n))
    assert (old.rank, old.cache, old.layer, old.request) == (rank, name, layer, None)


@given(
    st.one_of(
        st.text(),
        st.dictionaries(
            st.sampled_from(["rank", "cache", "layer", "request", "bytes", "x"]),
            st.one_of(st.integers(), st.text(), st.booleans(), st.none()),
        ).map(json.dumps),
    )
)
def test_layer_notes_give_a_note_or_a_refusal(text: str) -> None:
    from hixl.kv._notes import parse_note

    try:
        note = parse_note(text)
    except ValueError as exc:
        assert str(exc)
        return
    if note.request is not None:
        assert 0 < len(note.request) <= MAX_REQUEST_ID
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in note.request)
        assert json.loads(text)["request"] == note.request


@pytest.mark.parametrize(
    "doc",
    [
        {"rank": 0, "cache": "kv", "layer": 1, "request": "r", "bytes": 1, "extra": 0},
        {"rank": True, "cache": "kv", "layer": 1, "request": "r", "bytes": 1},
        {"rank": 0, "cache": "kv", "layer": -1, "request": "r", "bytes": 1},
        {"rank": 0, "cache": 5, "layer": 1, "request": "r", "bytes": 1},
        {"rank": 0, "cache": "kv", "layer": 1, "request": "r" * (MAX_REQUEST_ID + 1), "bytes": 1},
        {"rank": 0, "cache": "kv", "layer": 1, "request": "a\u0085b", "bytes": 1},
        {"rank": 0, "cache": "kv", "layer": 1, "request": "r", "bytes": 1.5},
    ],
)
def test_malformed_request_notes_are_refused(doc) -> None:
    from hixl._peertext import Malformed
    from hixl.kv._notes import parse_note

    with pytest.raises(Malformed):
        parse_note(json.dumps(doc))
    with pytest.raises(Malformed, match="over the 8192"):
        parse_note('{"rank": 0, "cache": "' + "k" * 9000 + '"}')
