"""hixl.nixl's links across remove_remote_agent / add_remote_agent (what Ray's NIXL transport does
for every object once the sender freed one), a dead agent after that, and VRAM without CUDA.
The peer agents are other processes (tests/_nixl_peer.py); bytes compared."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from test_nixl import HERE, seeded, until, wait_done
from test_nixl import agents as agents  # noqa: F401 (fixture)
from test_nixl import procs as procs  # noqa: F401 (fixture)

import hixl
from hixl import nixl
from hixl.nixl import nixl_agent, nixl_agent_config

SIZE = 4096


def peer(procs: Any, name: str) -> tuple[Any, bytes, int]:
    """A peer agent process over TCP with SIZE bytes registered: (proc, metadata, address)."""
    p = procs(HERE / "_nixl_peer.py", name, SIZE, "HIXL_TCP")
    tag, md_hex = p.line().split()
    assert tag == "READY"
    md = bytes.fromhex(md_hex)
    import json

    addr = json.loads(md[len(b"HIXLNIXL1\n") :])["regions"][0][0]
    return p, md, int(addr)


def engine_of(md: bytes) -> str:
    import json

    return str(json.loads(md[len(b"HIXLNIXL1\n") :])["engine"])


def read_once(me: nixl_agent, p: Any, md: bytes, addr: int, seed: int, dst: np.ndarray) -> None:
    """add_remote_agent, one READ of the peer's buffer (bytes compared), remove_remote_agent."""
    assert p.cmd("fill", seed) == "OK"
    name = me.add_remote_agent(md)
    h = me.initialize_xfer(
        "READ", me.get_xfer_descs(dst), me.get_xfer_descs([(addr, SIZE, 0)], "DRAM"), name
    )
    me.transfer(h)
    assert wait_done(me, h) == "DONE", h.error
    me.release_xfer_handle(h)
    assert hashlib.sha256(dst.tobytes()).hexdigest() == p.cmd("sha")
    assert np.array_equal(dst, seeded((SIZE,), seed))
    me.remove_remote_agent(name)


def link(me: nixl_agent, engine: str) -> dict[str, Any] | None:
    s = me.engine.stats().get(engine)
    return s if s is not None and s["alive"] else None


def test_removed_agent_keeps_its_link_for_the_next_add(procs, agents):
    """Ten rounds of add, READ, remove: one link carries all ten READs (the counters of a new
    link would start from zero), and it is still up after the last remove."""
    p, md, addr = peer(procs, "sender")
    me = agents("receiver", nixl_agent_config(backends=["HIXL_TCP"]))
    dst = np.zeros(SIZE, np.uint8)
    me.register_memory(dst)
    for i in range(10):
        read_once(me, p, md, addr, 100 + i, dst)
    s = link(me, engine_of(md))
    assert s is not None, me.engine.stats()
    assert s["ops_read"] == 10, s


def test_kept_link_closes_after_hixl_link_idle_s(procs, agents):
    """With hixl_link_idle_s=0.3 the link kept after remove_remote_agent goes once unused that
    long; adding the agent again then opens a new one, and READs still work."""
    p, md, addr = peer(procs, "sender")
    me = agents("receiver", nixl_agent_config(backends=["HIXL_TCP"], hixl_link_idle_s=0.3))
    dst = np.zeros(SIZE, np.uint8)
    me.register_memory(dst)
    read_once(me, p, md, addr, 1, dst)
    engine = engine_of(md)
    until(lambda: link(me, engine) is None, "the idle link closed", 10)
    read_once(me, p, md, addr, 2, dst)


def test_link_closes_at_once_when_the_agent_moves(procs, agents):
    """An agent removed and added again with another engine (it restarted elsewhere): the link
    kept for its old engine is closed then, not after the idle time."""
    p1, md1, addr1 = peer(procs, "mover")
    p2, md2, addr2 = peer(procs, "mover")
    me = agents("receiver", nixl_agent_config(backends=["HIXL_TCP"]))
    dst = np.zeros(SIZE, np.uint8)
    me.register_memory(dst)
    read_once(me, p1, md1, addr1, 3, dst)
    assert link(me, engine_of(md1)) is not None  # kept for 60 s
    read_once(me, p2, md2, addr2, 4, dst)
    until(lambda: link(me, engine_of(md1)) is None, "the old engine's link closed", 5)
    assert link(me, engine_of(md2)) is not None


@pytest.mark.parametrize("bad", [-1, float("nan"), "60", True, 1e9])
def test_hixl_link_idle_s_is_checked(bad):
    with pytest.raises(nixl.nixlInvalidParamError, match="hixl_link_idle_s"):
        nixl_agent("x", nixl_agent_config(hixl_link_idle_s=bad))


def test_dead_agent_after_remove_and_add_is_reported_within_a_second(procs, agents):
    """The agent's process dies between two objects: adding it again and connecting reports it
    dead within a second (one short probe), as NIXL does, not after the first-connect wait."""
    p, md, addr = peer(procs, "sender")
    me = agents("receiver", nixl_agent_config(backends=["HIXL_TCP"]))
    dst = np.zeros(SIZE, np.uint8)
    me.register_memory(dst)
    read_once(me, p, md, addr, 5, dst)
    os.kill(p.p.pid, signal.SIGKILL)
    p.p.wait(10)
    until(lambda: link(me, engine_of(md)) is None, "the link saw the peer die", 10)
    name = me.add_remote_agent(md)
    t0 = time.monotonic()
    with pytest.raises(nixl.nixlRemoteDisconnectError):
        me.make_connection(name)
    assert time.monotonic() - t0 < 1.0


def test_agent_gone_before_the_first_connect_is_reported_within_a_second(procs, agents):
    """An agent whose metadata arrived but whose process died before any link: its port
    refuses connects, so it is reported dead within a second (NIXL reports it at once), not
    after the 10 s a first connect gives an agent that is slow to answer."""
    p, md, _ = peer(procs, "sender")
    os.kill(p.p.pid, signal.SIGKILL)
    p.p.wait(10)
    me = agents("receiver", nixl_agent_config(backends=["HIXL_TCP"]))
    name = me.add_remote_agent(md)
    t0 = time.monotonic()
    with pytest.raises(nixl.nixlRemoteDisconnectError, match="refused"):
        me.make_connection(name)
    assert time.monotonic() - t0 < 1.0


def test_vram_without_cuda_is_refused_naming_why(agents):
    """Registering VRAM where CUDA is missing raises NIXL's not-supported error with the reason
    the CUDA driver could not be used (hixl.cuda_info())."""
    info = hixl.cuda_info()
    if info["available"]:
        pytest.skip("CUDA is present here: VRAM registers into the engine's cuda:N domain")
    a = agents("gpu-less")
    with pytest.raises(nixl.nixlNotSupportedError, match="VRAM.*needs CUDA") as e:
        a.register_memory([(0x10000, 4096, 0, "")], "VRAM")
    assert info["reason"] in str(e.value)
