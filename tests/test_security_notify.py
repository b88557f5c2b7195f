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
import pytest
from _lldd_sync import pattern
from test_kv import NOTIFY_PEER, SHAPE, Rank, filled, send_from_own_engine

import hixl
import hixl.llm_datadist as ld


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
        t.initialize("127.0.0.1:0", {"hixl.transport": "tcp"})
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
        t.initialize("127.0.0.1:0", {"hixl.transport": "tcp"})
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
        t.initialize("127.0.0.1:0", {"hixl.transport": "tcp"})
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
