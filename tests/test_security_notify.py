"""Notifications' sender (docs/RELIABILITY.md): a notification's text can name any rank or
cluster; only the connection it arrived on says who sent it. Each test performs the attack
against real processes (tests/_sec_notify_peer.py, tests/_kv_worker.py) over real sockets and
compares bytes byte for byte."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _wire as w
import numpy as np
import pytest
from _lldd_sync import fill, pattern
from test_kv import NOTIFY_PEER, SHAPE, Rank, filled, send_from_own_engine

import hixl
import hixl.llm_datadist as ld
from hixl.kv._context import context


@pytest.fixture
def ranks() -> Iterator:
    made: list[Rank] = []

    def make(cluster_id: int, role: str, peers: dict[int, str] | None = None) -> Rank:
        r = Rank(cluster_id, role, peers)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def kv() -> Iterator:
    yield hixl.kv.init
    hixl.kv.finalize()


def test_notifications_name_the_engine_they_came_from() -> None:
    """get_notifies and wait_notifies give each notification the engine id of the connection
    it came on: two engines in two processes, each sending the other's text."""
    with hixl.Hixl() as t:
        t.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        first = send_from_own_engine(t.local_engine, "who", "I am the second")
        got = t.wait_notifies(10_000, name="who")
        second = send_from_own_engine(t.local_engine, "who", "I am the first")
        assert first != second
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += t.get_notifies()
            time.sleep(0.01)
        assert [(n.msg, n.peer) for n in got] == [
            ("I am the second", first),
            ("I am the first", second),
        ]
        # Built here: no sender; equality and hash stay name and msg.
        mine = hixl.NotifyDesc("who", "I am the second")
        assert mine.peer == "" and mine == got[0] and hash(mine) == hash(got[0])


def test_hello_naming_another_host_is_unverified() -> None:
    """A Hello whose engine id names a host the connection does not come from is served, but
    its notifications name the claim marked unverified (`?`), equal to no engine's address; an
    id on every address (0.0.0.0) takes the source address; text that is no engine id is
    marked too."""
    with hixl.Hixl() as t:
        t.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        host, port = t.local_engine.rsplit(":", 1)
        addr = (host, int(port))
        cases = [
            ("192.0.2.1:5000", "?192.0.2.1:5000"),  # TEST-NET-1: never this host
            ("0.0.0.0:4321", "127.0.0.1:4321"),
            ("rank0", "?rank0"),
        ]
        for claim, reported in cases:
            st, _ = w.connect(addr, engine=claim)
            with st:
                st.send(w.NOTIFY, w.text("n") + w.text(claim), tag=1)
                assert st.answer(w.ACK)[0] == 0
            (n,) = t.wait_notifies(10_000)
            assert (n.msg, n.peer) == (claim, reported)


def test_engine_ids_with_control_characters_are_refused_at_the_handshake() -> None:
    """A raw client whose Hello names an engine id (or host) holding a newline or an escape
    sequence is refused before it is served: it gets no Welcome, and no notification of its
    ever reaches the application under that id (which the Python layers would log). A clean
    client on the same target still gets through."""
    with hixl.Hixl() as t:
        t.initialize("127.0.0.1:0", {"hixl.backends": "tcp"})
        host, port = t.local_engine.rsplit(":", 1)
        addr = (host, int(port))
        forged = "x\nWARNING hixl: forged line\x1b[2J"
        for kw in ({"engine": forged}, {"host": forged}):
            with pytest.raises((w.Refused, OSError, EOFError, AssertionError)) as exc:
                st, _ = w.connect(addr, **kw)
                with st:
                    st.send(w.NOTIFY, w.text("n") + w.text("forged"), tag=1)
                    st.answer(w.ACK)
            print(f"{sorted(kw)[0]} with control characters: {exc.value!r}")
        with pytest.raises(hixl.Timeout):
            t.wait_notifies(300)
        st, _ = w.connect(addr, engine="clean-client")
        with st:
            st.send(w.NOTIFY, w.text("n") + w.text("clean"), tag=1)
            assert st.answer(w.ACK)[0] == 0
        (n,) = t.wait_notifies(10_000)
        assert (n.msg, n.peer) == ("clean", "?clean-client")


def test_forged_layer_notifications_do_not_count(ranks, kv) -> None:
    """A decoder waits for rank 0's layers; another engine sends a layer notification naming
    rank 0 for every layer. None counts (the cache would be zeros); when rank 0 then pushes,
    every layer arrives once and the bytes are rank 0's."""
    me = kv(cluster_id=0, role="prompt")
    decoder = ranks(1, "decoder", peers={0: me.address})
    decoder.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=None)
    decoder.ok("receive", rank=0, name="kv", timeout_ms=60_000)
    forged = [x for k in range(SHAPE[0]) for x in ("hixl.kv.layer", f"0:kv:{k}")]
    attacker = send_from_own_engine(decoder.address, *forged)
    assert attacker != me.address
    # The decoder takes notifications every 0.2 ms: a forged layer would count at once.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        progress = decoder.ok("progress")
        if progress["layers"] or progress["done"]:
            break
        time.sleep(0.05)
    assert (progress["layers"], progress["done"]) == (0, False), progress

    hixl.kv.link([hixl.kv.PeerRank.from_dict({"cluster_id": 1, "address": decoder.address})])
    want = filled(SHAPE, 31)
    cache = hixl.kv.allocate_cache(want.copy(), name="kv", layer_axis=0, block_axis=2)
    syncer = hixl.kv.LayerTracker(SHAPE[0])
    task = hixl.kv.transfer_cache_async(1, cache, syncer, mode="push")
    for k in range(SHAPE[0]):
        syncer.layer_ready(k)
    assert task.wait(60_000).bytes == cache.nbytes
    got = decoder.ok("received")
    assert got["bytes"] == cache.nbytes
    assert decoder.array("kv", SHAPE).tobytes() == want.tobytes()


@pytest.fixture
def decoder() -> Iterator[ld.LLMDataDist]:
    d = ld.LLMDataDist(ld.LLMRole.DECODER, 1)
    cfg = ld.LLMConfig()
    cfg.listen_ip_info = "127.0.0.1:0"
    cfg.enable_cache_manager = True
    d.init(cfg.generate_options())
    yield d
    d.finalize()


def _route(d: ld.LLMDataDist, cluster: int) -> str | None:
    node: Any = d._live()  # noqa: SLF001 - the route a hello made, before anything uses it
    with node.lock:
        return node.routes.get(cluster)


class Prompt:
    """LLM-DataDist cluster 0 in a process of its own, linked to the decoder."""

    def __init__(self, decoder: ld.LLMDataDist) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, NOTIFY_PEER, "lldd-prompt", decoder.local_address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent,
        )
        assert self.proc.stdout is not None
        tag, self.address = self.proc.stdout.readline().split()
        assert tag == "READY"
        # Its hello is applied on the decoder's own thread.
        deadline = time.monotonic() + 15
        while _route(decoder, 0) != self.address and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _route(decoder, 0) == self.address

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def pull_and_compare(decoder: ld.LLMDataDist) -> None:
    """Pulls cluster 0's CacheKey(0, req_id=7) and compares batch entry 0 of each tensor."""
    cm = decoder.cache_manager
    local = cm.allocate_cache(ld.CacheDesc(2, [4, 64], ld.DataType.DT_FLOAT16, ld.Placement.HOST))
    cm.pull_cache(ld.CacheKey(0, req_id=7), local)
    for i, t in enumerate(cm.get_cache_tensors(local)):
        want = pattern(t.nbytes, 50 + i)[: t[0].nbytes]
        assert t[0].tobytes() == want.tobytes(), f"tensor {i}"


@pytest.mark.parametrize("attack", ["hello", "bye", "release"])
def test_forged_lldd_notifications_change_nothing(decoder: ld.LLMDataDist, attack: str) -> None:
    """Cluster 0 links to the decoder (cluster 1), whose hello gives the decoder its way back.
    Another engine then sends the decoder a hello claiming cluster 0, or a bye for cluster 0,
    or sends cluster 0 a release of its CacheKey. The decoder's pull by that key still goes
    to the real cluster 0 and gets its bytes."""
    prompt = Prompt(decoder)
    try:
        if attack == "hello":
            doc = json.dumps({"cluster": 0, "address": "{self}"})
            send_from_own_engine(decoder.local_address, "hixl.lldd.hello", doc)
        elif attack == "bye":
            send_from_own_engine(decoder.local_address, "hixl.lldd.bye", '{"cluster": 0}')
        else:
            key = ld.CacheKey(0, req_id=7).ident()
            send_from_own_engine(prompt.address, "hixl.lldd.release", json.dumps(key))
        # The receiver applies notifications every 200 ms at most.
        deadline = time.monotonic() + 2
        while _route(decoder, 0) == prompt.address and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _route(decoder, 0) == prompt.address, f"the {attack} changed the route"
        pull_and_compare(decoder)
    finally:
        prompt.close()


def test_a_cluster_back_on_another_address_gets_its_way_back(decoder: ld.LLMDataDist) -> None:
    """Not a forgery: cluster 0 dies without a bye and comes back on another address. Its new
    hello replaces the route of the engine that no longer answers."""
    first = Prompt(decoder)
    first.proc.kill()
    first.proc.wait(10)
    second = Prompt(decoder)
    try:
        assert second.address != first.address
        pull_and_compare(decoder)
    finally:
        second.close()


def test_nixl_notifications_are_filed_under_the_sending_agent() -> None:
    """An engine in another process sends a notification named as loaded agent "b" and one
    as "mallory", never loaded. get_new_notifs files b's under b only when b's engine sent it
    (the forged one is dropped); mallory's is known only by its name, as in NIXL."""
    from hixl.nixl import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(backends=["UCX"])
    near, b, c = nixl_agent("near", conf), nixl_agent("b", conf), nixl_agent("c", conf)
    try:
        md = near.get_agent_metadata()
        near.add_remote_agent(b.get_agent_metadata())
        near.add_remote_agent(c.get_agent_metadata())
        b.add_remote_agent(md)
        near_engine = json.loads(md[len(b"HIXLNIXL1\n") :])["engine"]
        send_from_own_engine(near_engine, "nixl:b", "forged", "nixl:mallory", "hi")
        b.send_notif("near", b"real")
        # Loaded agent c's engine sends a plain hixl notification named as agent b: it is c's.
        with contextlib.suppress(hixl.AlreadyConnected):
            c._engine.connect(near_engine, timeout_ms=10_000)
        c._engine.send_notify(near_engine, hixl.NotifyDesc("b", "plain"), timeout_ms=10_000)
        got: dict[str, list[bytes]] = {}
        deadline = time.monotonic() + 20
        while not {"b", "c", "mallory"} <= set(got) and time.monotonic() < deadline:
            for k, v in near.get_new_notifs().items():
                got.setdefault(k, []).extend(v)
            time.sleep(0.01)
        assert got == {"b": [b"real"], "c": [b"plain"], "mallory": [b"hi"]}, got
    finally:
        near.close()
        b.close()
        c.close()


#: Texts no release, hello or bye may be: JSON's infinity and NaN, floats and booleans where
#: integers belong, ids out of range, other shapes, nesting past any recursion limit, digits
#: past int()'s limit, not JSON at all.
HOSTILE_TEXTS = [
    "[1e999,0,0,0]",
    "[-1e999,0,0,0]",
    "[NaN,0,0,0]",
    "[Infinity,0,0,0]",
    "[1.5,0,0,0]",
    "[true,0,0,0]",
    "[18446744073709551616,0,0,0]",
    "[1,2,3]",
    "9" * 5000,
    "[" * 100_000,
    '{"cluster": 1e999}',
    '{"cluster": -1}',
    '{"cluster": "0"}',
    '{"cluster": 1.0}',
    '"x"',
    "null",
    "",
    "\x1b[2J\nforged",
]


def _pulled(prompt: Prompt, req_id: int) -> list[bytes]:
    """Has the prompt pull the decoder's CacheKey(1, req_id) (a real release follows)."""
    assert prompt.proc.stdin is not None and prompt.proc.stdout is not None
    prompt.proc.stdin.write(f"pull {req_id}\n")
    prompt.proc.stdin.flush()
    tag, *tensors = prompt.proc.stdout.readline().split()
    assert tag == "PULLED"
    return [bytes.fromhex(t) for t in tensors]


def test_hostile_lldd_texts_do_not_end_the_notification_thread(decoder: ld.LLMDataDist) -> None:
    """Issue 46, item 1: an engine linked to nothing sends the decoder (cluster 1) releases,
    hellos and byes whose texts are `[1e999,0,0,0]` (int() of JSON's infinity raised
    OverflowError and ended the thread) and other hostile texts. Then cluster 0 links: its
    hello is still applied and the decoder pulls from it (bytes compared), and cluster 0 pulls
    the decoder's CacheKey: its real release is still applied (the key is gone)."""
    cm = decoder.cache_manager
    desc = ld.CacheDesc(2, [4, 64], ld.DataType.DT_FLOAT16, ld.Placement.HOST)
    mine = cm.allocate_cache(desc, [ld.CacheKey(1, req_id=9)])
    for i, t in enumerate(cm.get_cache_tensors(mine)):
        fill(t, 60 + i)
    node: Any = decoder._live()  # noqa: SLF001 - its published keys
    key = tuple(ld.CacheKey(1, req_id=9).ident())
    assert key in node.keys
    pairs = [
        x
        for text in HOSTILE_TEXTS
        for name in ("hixl.lldd.release", "hixl.lldd.hello", "hixl.lldd.bye")
        for x in (name, text)
    ]
    send_from_own_engine(decoder.local_address, *pairs)
    prompt = Prompt(decoder)  # waits for its hello, applied after every hostile text
    try:
        pull_and_compare(decoder)
        got = _pulled(prompt, 9)
        for i, t in enumerate(cm.get_cache_tensors(mine)):
            assert got[i] == t[0].tobytes(), f"tensor {i}"
        deadline = time.monotonic() + 10
        while key in node.keys and time.monotonic() < deadline:
            time.sleep(0.02)
        assert key not in node.keys, "cluster 0's release was not applied"
        assert node.thread.is_alive()
    finally:
        prompt.close()


#: The engine caps of the flood test: 8 MiB per connection, 16 MiB in all.
CAP_CONN, CAP_TOTAL = 8 << 20, 16 << 20
FLOOD_TEXT, FLOOD_COUNT = 1 << 20, 160


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:"))


def _held(notes: list[hixl.NotifyDesc]) -> dict[str, int]:
    """Bytes (name and message) of `notes` per sender."""
    out: dict[str, int] = {}
    for n in notes:
        out[n.peer] = out.get(n.peer, 0) + len(n.name.encode()) + len(n.msg.encode())
    return out


def test_a_flood_during_a_layerwise_receive_stays_within_the_engine_caps(ranks, kv) -> None:
    """Issue 46, item 2: while a layerwise receive runs (engine caps 8 MiB per connection,
    16 MiB in all), an engine in another process floods 160 texts of 1 MiB named
    hixl.kv.layer. The KV router used to move each out of the engine (freeing its budget)
    into a list capped only by count: 160 MiB held. Now what the router and the engine hold
    together stays within the caps, and rank 0's layerwise push to the receive that ran
    through the flood completes with its bytes."""
    from hixl._kvcore._notify import Router

    caps = {"hixl.max_notify_bytes": str(CAP_CONN), "hixl.max_notify_bytes_total": str(CAP_TOTAL)}
    me = kv(cluster_id=1, role="decoder", options=caps)
    good = ranks(0, "prompt", peers={1: me.address})
    good.ok("alloc", name="kv", shape=SHAPE, dtype="float16", seed=31)
    hixl.kv.link([hixl.kv.PeerRank.from_dict({"cluster_id": 0, "address": good.address})])
    cache = hixl.kv.allocate_cache(
        np.zeros(SHAPE, np.float16), name="kv", layer_axis=0, block_axis=2
    )
    syncer = hixl.kv.LayerTracker(SHAPE[0])
    cfg = hixl.kv.CacheTransferConfig(timeout_ms=120_000)
    task = hixl.kv.receive_cache_async(0, cache, syncer, cfg)
    box: Router = context().mailbox
    rss_before = _rss()
    most: dict[str, int] = {}
    flood = subprocess.Popen(
        [sys.executable, NOTIFY_PEER, "flood", me.address, "hixl.kv.layer"]
        + [str(FLOOD_TEXT), str(FLOOD_COUNT), "30"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
    )
    try:
        assert flood.stdout is not None
        tag, attacker = flood.stdout.readline().split()
        assert tag == "STARTED"
        while flood.poll() is None:
            for peer, n in _held(list(box.pending)).items():
                most[peer] = max(most.get(peer, 0), n)
            time.sleep(0.02)
        result = flood.stdout.read().split()
    finally:
        if flood.poll() is None:
            flood.kill()
        flood.wait(10)
    pushed = good.call("push_layers", rank=1, name="kv")  # the receive ran all along
    assert result[0] == "FLOOD", result
    assert task.wait(60_000).bytes == cache.nbytes
    assert pushed["ok"] and pushed["bytes"] == cache.nbytes, pushed
    assert cache.array.tobytes() == good.array("kv", SHAPE).tobytes()
    rss_after = _rss()
    engine = _held(context().engine.get_notifies())  # the application's call: what it held
    router = _held(list(box.pending))
    mib = 1 / 2**20
    report = (
        f"flood sent {result[1]} x 1 MiB ({result[2]} refused); router held at most "
        f"{most.get(attacker, 0) * mib:.1f} MiB of the attacker's "
        f"({sum(most.values()) * mib:.1f} MiB in all), now {router.get(attacker, 0) * mib:.1f}"
        f" MiB; engine holds {engine.get(attacker, 0) * mib:.1f} MiB of it; "
        f"RSS {rss_before * mib:.1f} -> {rss_after * mib:.1f} MiB"
    )
    print(report)
    worst = most.get(attacker, 0) + engine.get(attacker, 0)
    assert worst <= CAP_CONN, report
    assert sum(most.values()) + sum(engine.values()) <= CAP_TOTAL, report
    assert rss_after - rss_before < 4 * CAP_TOTAL, report
