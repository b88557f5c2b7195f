"""The KV core across real processes: each rank's directory (the read-only region named
hixl.kv.directory, found by that name, untrusted when read) and the one executor thread
that completes every asynchronous task's requests."""

from __future__ import annotations

import json
import threading
import time

import _wire as w
import numpy as np
import pytest
import test_kv

import hixl
from hixl.kv._context import context
from hixl.kv._directory import (
    DIR_BYTES,
    DIR_NAME,
    HEADER,
    MAGIC,
    VERSION,
    W_LEN,
    W_RANK,
    W_SEQ,
    W_VERSION,
    Directory,
)

DT, filled = test_kv.DT, test_kv.filled
ranks, kv = test_kv.ranks, test_kv.kv  # the fixtures: a worker process per rank, hixl.kv.init


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_directory_is_read_only_for_peers(ranks, transport: str) -> None:
    """Security finding 11: a peer rewrites a rank's directory to send other ranks to the
    wrong regions. Every peer may read it; none may write it, by engine or raw frame."""
    victim = ranks(0, "prompt")
    victim.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=9)
    with hixl.Hixl() as e:  # the attacker: a plain engine, no KV layer
        e.initialize("127.0.0.1", {"hixl.backends": transport})
        mine = hixl.aligned_empty(DIR_BYTES)
        mine[:] = 0
        e.register(mine)
        e.connect(victim.address, timeout_ms=5000)
        d = e.remote_region(victim.address, DIR_NAME)
        assert (d.len, d.writable) == (DIR_BYTES, False), d
        e.get(victim.address, mine.ctypes.data, d.addr, d.len, 5000)
        before = mine.copy()
        assert b'"rank":0' in before.tobytes() and b'"kv"' in before.tobytes()
        mine[:] = 0xEE
        for off, n in ((0, HEADER), (HEADER, 4096), (0, d.len)):
            with pytest.raises(hixl.ParamInvalid, match="read-only") as ei:
                e.put(victim.address, mine.ctypes.data, d.addr + off, n, 5000)
            assert ei.value.code == hixl.Status.PARAM_INVALID
        e.get(victim.address, mine.ctypes.data, d.addr, d.len, 5000)
        assert (mine == before).all(), "the directory changed"
    # A raw client skips the initiator's own check: the target must refuse the frame itself.
    host, port = victim.address.rsplit(":", 1)
    st, _ = w.connect((host, int(port)))
    with st:
        st.send(w.WRITE, w.segs([(d.addr, 64)]), tag=1, bulk=b"\xee" * 64)
        status, message, _ = st.answer(w.ACK)
        assert status == hixl.Status.PARAM_INVALID and "read-only" in message, message
    # The directory still sends other ranks to the right cache.
    decoder = ranks(1, "decoder")
    decoder.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=None)
    decoder.ok("link", ranks=[{"cluster_id": 0, "address": victim.address}])
    decoder.ok("pull", rank=0, name="kv")
    got = decoder.array("kv", (4, 512), np.uint8).tobytes()
    assert got == filled((4, 512), 9, np.uint8).tobytes()


def test_malformed_directory_is_a_kv_error(kv) -> None:
    """A malicious target publishes a directory of its own making under the directory's
    name: linking to it fails with a KVError naming it, whatever the bytes or the region,
    and never with a stray exception."""
    kv(cluster_id=1, role="decoder")
    good = {"name": "kv", "shape": [4, 8], "dtype": "uint8", "addr": 4096, "nbytes": 32}
    bodies = [
        b"\xee" * 64,  # not UTF-8
        b"[" * 100_000,  # nested past the parser's depth
        b"[1, 2]",
        b'{"rank": 0}',
        json.dumps({"rank": "zero", "role": "prompt", "caches": []}).encode(),
        json.dumps({"rank": 0, "role": "prompt", "caches": "kv"}).encode(),
        json.dumps({"rank": 0, "role": "prompt", "caches": [{"name": "kv"}]}).encode(),
        json.dumps(
            {"rank": 0, "role": "prompt", "caches": [{**good, "layer_axis": 5, "block_axis": 1}]}
        ).encode(),
        json.dumps(
            {
                "rank": 0,
                "role": "prompt",
                "caches": [{**good, "dtype": "nope", "layer_axis": 0, "block_axis": None}],
            }
        ).encode(),
    ]
    bodies.append(json.dumps({"rank": 3, "role": "prompt", "caches": []}).encode())  # header: 0

    def refused(fake: hixl.Hixl, why: str) -> None:
        with pytest.raises(hixl.kv.KVError, match="malformed KV-cache directory") as e:
            hixl.kv.link([{"cluster_id": 0, "address": fake.local_engine}])
        assert e.value.status_code == "LLM_002004", why
        assert fake.local_engine in str(e.value), str(e.value)  # it names the peer

    with hixl.Hixl() as fake:
        fake.initialize("127.0.0.1:0")
        buf, _ = fake_directory(fake, 0)
        words = buf[:HEADER].view(np.uint64)
        for body in bodies:
            buf[HEADER : HEADER + len(body)] = np.frombuffer(body, np.uint8)
            words[W_SEQ], words[W_LEN] = 2, len(body)
            refused(fake, repr(body[:40]))
        for n in (0, DIR_BYTES - HEADER + 1, 1 << 63):  # body lengths out of range
            words[W_SEQ], words[W_LEN] = 4, n
            refused(fake, f"body length {n}")
        words[W_LEN] = len(bodies[-2])
        for word, value in ((0, 0), (W_VERSION, VERSION + 1)):  # no magic, another layout
            old, words[word] = int(words[word]), value
            refused(fake, f"header word {word} = {value}")
            words[word] = old
    # A region of that name of another length, or one peers may write.
    for length, access in ((4096, "r"), (DIR_BYTES, "rw")):
        with hixl.Hixl() as fake:
            fake.initialize("127.0.0.1:0")
            fake_directory(fake, 0, access=access, length=length)
            refused(fake, f"{length} bytes, access {access!r}")


def fake_directory(
    e: hixl.Hixl, rank: int, access: str = "r", length: int = DIR_BYTES, name: str = DIR_NAME
) -> tuple[np.ndarray, hixl.MemHandle]:
    """A directory header for `rank` (empty body) in a new region of `e` named `name`."""
    buf = hixl.aligned_empty(length)
    buf[:] = 0
    words = buf[: min(length, HEADER)].view(np.uint64)
    words[0], words[W_SEQ], words[W_RANK], words[W_VERSION] = MAGIC, 1, rank, VERSION
    return buf, e.register(buf, access=access, name=name)


def test_link_waits_for_a_directory_published_after_listening(kv) -> None:
    """A rank started at the same moment listens a little before it registers its directory:
    a link that connects in between waits for the directory instead of failing."""
    kv(cluster_id=1, role="decoder")
    with hixl.Hixl() as late:
        late.initialize("127.0.0.1:0")
        timer = threading.Timer(0.2, lambda: Directory(late, 0, "prompt"))
        timer.start()
        try:
            hixl.kv.link([{"cluster_id": 0, "address": late.local_engine}], timeout_ms=5000)
        finally:
            timer.join()
        assert sorted(context().peers) == [0]
        hixl.kv.unlink([0])


def test_directory_is_the_region_named_so_naming_the_rank(ranks, kv) -> None:
    """Peers find a rank's directory by its region's name, and check the rank its header
    names. Copies of a directory under no name or another name are not taken for it; a
    directory naming another rank is a KVError; a forged header written into one of the
    rank's writable caches changes nothing: the named region is the directory."""
    real = ranks(0, "prompt")
    real.ok("alloc", name="kv", shape=[4, 512], dtype="uint8", seed=9)
    kv(cluster_id=1, role="decoder")
    body = json.dumps({"rank": 0, "role": "prompt", "caches": []}).encode()
    with hixl.Hixl() as fake:
        fake.initialize("127.0.0.1:0")
        # Byte-exact copies of rank 0's directory, unnamed and under another name.
        copy = hixl.aligned_empty(DIR_BYTES)
        fake.register(copy, access="r")
        fake.connect(real.address, timeout_ms=5000)
        d = fake.remote_region(real.address, DIR_NAME)
        fake.get(real.address, copy.ctypes.data, d.addr, DIR_BYTES, 5000)
        assert int(copy[:HEADER].view(np.uint64)[W_RANK]) == 0 and b'"kv"' in copy.tobytes()
        named, _ = fake_directory(fake, 0, name=DIR_NAME + ".copy")
        named[:] = copy
        t0 = time.monotonic()
        with pytest.raises(hixl.kv.KVError, match="publishes no hixl KV-cache directory") as e:
            hixl.kv.link([{"cluster_id": 0, "address": fake.local_engine}], timeout_ms=300)
        assert e.value.status_code == "LLM_002004" and time.monotonic() - t0 < 5
        assert fake.local_engine in str(e.value)
        # The directory under that name naming another rank: refused as that rank.
        other, _ = fake_directory(fake, 7)
        other[HEADER : HEADER + len(body)] = np.frombuffer(body.replace(b":0", b":7"), np.uint8)
        with pytest.raises(hixl.kv.KVError, match="is rank 7, not cluster_id=0") as e:
            hixl.kv.link([{"cluster_id": 0, "address": fake.local_engine}])
        assert fake.local_engine in str(e.value)
    # A forged directory written into a writable cache of the real rank 0 (by a peer with
    # the cluster secret) is not taken for rank 0's directory: the named region is.
    real.ok("alloc", name="big", shape=[DIR_BYTES], dtype="uint8", seed=None)
    hixl.kv.link([{"cluster_id": 0, "address": real.address}])
    peer, big = context().remote_cache(0, "big")
    assert peer.dir_addr == context().engine.remote_region(real.address, DIR_NAME).addr
    hixl.kv.unlink([0])
    with hixl.Hixl() as attacker:
        attacker.initialize("127.0.0.1")
        forged, _ = fake_directory(attacker, 0, access="rw", name="")
        forged[HEADER : HEADER + len(body)] = np.frombuffer(body, np.uint8)
        w_ = forged[:HEADER].view(np.uint64)
        w_[W_LEN], w_[W_SEQ] = len(body), 2
        attacker.connect(real.address, timeout_ms=5000)
        attacker.put(real.address, forged.ctypes.data, big.addr, DIR_BYTES, 5000)
    hixl.kv.link([{"cluster_id": 0, "address": real.address}])
    peer = context().peers[0]
    assert peer.dir_addr != big.addr and sorted(peer.caches) == ["big", "kv"], peer
    local = hixl.kv.allocate_cache(
        np.zeros((4, 512), np.uint8), name="kv", layer_axis=0, block_axis=None
    )
    hixl.kv.pull_cache(0, local).wait()
    assert local.array.tobytes() == filled((4, 512), 9, np.uint8).tobytes()


def test_async_tasks_share_one_completion_driven_thread(ranks, kv) -> None:
    """Asynchronous tasks start no thread of their own: the KV core's one executor thread
    completes the requests of all of them, from the process's completion queue, which an
    asyncio loop awaiting plain engine requests in the same process drains too (neither
    takes the other's completions)."""
    import asyncio

    shape = (8, 2, 16, 16, 8, 64)
    prompt = ranks(0, "prompt")
    prompt.ok("alloc", name="kv", shape=shape, dtype="float16", seed=21)
    kv(cluster_id=1, role="decoder", peers={0: prompt.address})
    want = filled(shape, 21).tobytes()
    locals_ = [
        hixl.kv.allocate_cache(np.zeros(shape, DT), name=f"c{i}", layer_axis=0, block_axis=2)
        for i in range(6)
    ]
    cfg = hixl.kv.CacheTransferConfig(max_concurrent=2, async_enable=True)
    before = {t.ident for t in threading.enumerate()}

    async def main() -> list[str]:
        tasks = [hixl.kv.pull_cache(0, c, cfg, remote_name="kv") for c in locals_]
        syncer = hixl.kv.LayerTracker(8)
        layerwise = hixl.kv.transfer_cache_async(0, locals_[0], syncer, remote_name="kv")
        names = [t.name for t in threading.enumerate() if t.ident not in before]
        with hixl.Hixl() as e:  # plain engine requests awaited on this loop meanwhile
            e.initialize("127.0.0.1:0")
            src = hixl.aligned_empty(1 << 16)
            src[:] = 7
            e.register(src)
            with hixl.Hixl() as f:
                f.initialize("127.0.0.1:0")
                dst = hixl.aligned_empty(1 << 16)
                f.register(dst)
                f.connect(e.local_engine, timeout_ms=5000)
                for _ in range(20):
                    await f.get_async(e.local_engine, dst.ctypes.data, src.ctypes.data, 1 << 16)
                assert (dst == 7).all()
        for t in [*tasks, layerwise]:
            await asyncio.wait_for(t, 30)
        return names

    names = asyncio.run(main())
    assert "hixl-kv-task" not in names and names.count("hixl-kv-executor") <= 1, names
    assert not [t for t in threading.enumerate() if t.name == "hixl-kv-task"]
    assert [t.name for t in threading.enumerate()].count("hixl-kv-executor") == 1
    for c in locals_:
        assert c.array.tobytes() == want


def test_an_idle_receive_sleeps_until_its_layers_are_announced(kv) -> None:
    """A layerwise receive waits on the engine's notification descriptor instead of polling
    for notifications: while nothing comes for a second the process spends almost no CPU
    time (polling every millisecond, as it did, spent about 0.04 s), and every layer still
    counts once its notification arrives."""
    kv(cluster_id=0, role="decoder")
    layers = test_kv.SHAPE[0]
    cache = hixl.kv.allocate_cache(
        np.zeros(test_kv.SHAPE, DT), name="kv", layer_axis=0, block_axis=2
    )
    syncer = hixl.kv.LayerTracker(layers)
    cfg = hixl.kv.CacheTransferConfig(timeout_ms=30_000)
    task = hixl.kv.receive_cache_async(5, cache, syncer, cfg)
    time.sleep(0.2)  # the executor thread is waiting by now
    cpu = time.process_time()
    time.sleep(1.0)
    used = time.process_time() - cpu
    assert used < 0.01, f"a receive with nothing coming used {used:.3f} s of CPU in 1 s"
    assert syncer.get_layer_count() == 0 and not task.is_done()
    pairs = [w for k in range(layers) for w in ("hixl.kv.layer", f"5:kv:{k}")]
    test_kv.send_from_own_engine(context().address, *pairs)
    task.wait(10_000)
    assert syncer.get_layer_count() == layers
