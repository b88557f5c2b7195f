"""The NIXL layer's listen thread against senders it does not know (security review issue 46,
item 4): what an ``S`` request from anyone may make it hold, and the cluster-secret
challenge-response. The victim is a real process (tests/_sec_nixl_victim.py) whose memory is
read from /proc; the attacker is a raw socket client; good peers are hixl.nixl agents here."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _lineproc import LineProc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_security_low import until

from hixl.nixl import _meta, nixl_agent, nixl_agent_config
from hixl.nixl._bindings import nixlInvalidParamError

HERE = Path(__file__).parent
SECRET = "5be0c8d7a41f96e2038b7d6c9e15fa42d8b370c61e9a5f24b7d03c8e16f94a5b"
SIZE = 1 << 20
MIB = 1 << 20


@pytest.fixture
def procs() -> Iterator[Callable[..., LineProc]]:
    started: list[LineProc] = []

    def start(*args: object) -> LineProc:
        p = LineProc(list(args))
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.close(10)


@pytest.fixture
def agents() -> Iterator[Callable[..., nixl_agent]]:
    made: list[nixl_agent] = []

    def make(name: str, **kw: object) -> nixl_agent:
        a = nixl_agent(name, nixl_agent_config(True, False, 0, **kw))  # type: ignore[arg-type]
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def raw_request(port: int, kind: bytes, payload: bytes) -> None:
    """What an attacker sends: one frame, no handshake; returns once the listener closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(struct.pack("<4scI", b"HXNM", kind, len(payload)) + payload)
            s.recv(1)
        except OSError:
            pass  # refused from its header: the rest of the payload hits a closed socket


def metadata(name: str, rows: int, base: int = 0x7F0000000000) -> bytes:
    """Agent `name`'s metadata naming `rows` regions, at an engine nobody listens on."""
    regions = [[base + i * 8192, 4096, 0] for i in range(rows)]
    return _meta.encode(name, "127.0.0.1:9", regions)


def write_and_compare(good: nixl_agent, victim: LineProc, victim_md: bytes, seed: int) -> None:
    """`good` WRITEs 1 MiB into the victim's registered buffer; the victim's bytes must match."""
    addr = _meta.decode(victim_md)["regions"][0][0]
    data = np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)
    good.register_memory(data)
    local = good.get_xfer_descs([(data.ctypes.data, SIZE, 0)], "DRAM")
    remote = good.get_xfer_descs([(addr, SIZE, 0)], "DRAM")
    h = good.initialize_xfer("WRITE", local, remote, "A")
    good.transfer(h)
    until(lambda: good.check_xfer_state(h) != "PROC", "the WRITE")
    assert good.check_xfer_state(h) == "DONE", h.error
    good.release_xfer_handle(h)
    assert victim.cmd("dump") == hashlib.sha256(data.tobytes()).hexdigest()


def test_nixl_listener_wire_metadata_is_capped(procs, agents):
    """Six raw ``S`` requests of 13 MiB naming new agents, then 20 at the region cap, to a
    listener capped at 8 agents: the big ones are refused from their header, at most 8 agents
    are loaded with at most 4096 regions each, the victim's resident memory stays within a few
    MiB of where it was (before the fix: +166 MiB held), and a good peer still fetches the
    victim's metadata and WRITEs to it, bytes compared."""
    victim = procs(HERE / "_sec_nixl_victim.py", "A", SIZE, "hixl_listen_thread_max_agents=8")
    port, victim_md = int(victim.words[1]), bytes.fromhex(victim.words[2])
    rss0, hwm0 = map(int, victim.cmd("rss").split())
    big = metadata("big-0", 13 * MIB // 25)
    assert len(big) > 13 * MIB
    for i in range(6):
        raw_request(port, b"S", big.replace(b'"big-0"', f'"big-{i}"'.encode()))
    for i in range(20):
        raw_request(port, b"S", metadata(f"cap-{i}", 4096))
    raw_request(port, b"S", metadata("over", 4097))  # one region over the cap
    rss1, hwm1 = map(int, victim.cmd("rss").split())
    n, regions, most = map(int, victim.cmd("agents").split())
    shown = (
        f"victim RSS {rss0 // 1024} MiB before, {rss1 // 1024} MiB after (+{(rss1 - rss0) // 1024}"
        f" MiB held), peak {hwm1 // 1024} MiB (was {hwm0 // 1024}, +{(hwm1 - rss0) // 1024} MiB "
        f"over the start); {n} agents loaded, {regions} regions, at most {most} in one"
    )
    print(f"nixl listener flood: {shown}")
    assert n <= 8 and most <= 4096, shown
    assert rss1 - rss0 < 32 * 1024, shown
    assert hwm1 - rss0 < 64 * 1024, shown

    good = agents("G")
    good.fetch_remote_metadata("A", "127.0.0.1", port)
    until(lambda: good.check_remote_metadata("A"), "a good peer's fetch")
    write_and_compare(good, victim, victim_md, 46)


def test_nixl_listener_with_a_secret_reads_nothing_unauthenticated(procs, agents):
    """With a cluster secret, raw clients without it are closed before their request is read:
    one that sent only the header of an ``S`` is closed long before the listener's timeout
    (30 s) without sending its payload; a whole ``S`` and one after a made-up proof add no
    agent. A peer without the secret cannot fetch; one with it sends and fetches metadata and
    WRITEs, bytes compared. The challenge never carries the secret."""
    victim = procs(
        HERE / "_sec_nixl_victim.py", "A", SIZE, f"secret={SECRET}",
        "hixl_listen_thread_timeout_s=30.0",
    )  # fmt: skip
    port, victim_md = int(victim.words[1]), bytes.fromhex(victim.words[2])

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(struct.pack("<4scI", b"HXNM", b"S", 1 << 20))  # the header alone
        t0 = time.monotonic()
        s.settimeout(10)
        try:
            got = s.recv(1)
        except TimeoutError:
            pytest.fail("the listener waited for the request of a client without the secret")
        except ConnectionResetError:
            got = b""
        assert got == b"", f"the listener answered {got!r}"
        print(f"nixl listener: header-only client closed after {time.monotonic() - t0:.3f} s")

    raw_request(port, b"S", metadata("intruder", 4))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(struct.pack("<4scI", b"HXNM", b"H", 32) + bytes(32))
        head = s.recv(9, socket.MSG_WAITALL)
        assert head[:5] == b"HXNMC", head
        challenge = s.recv(64, socket.MSG_WAITALL)
        assert SECRET.encode() not in challenge and bytes.fromhex(SECRET) not in challenge
        body = metadata("intruder2", 4)
        try:
            s.sendall(struct.pack("<4scI", b"HXNM", b"P", 32) + bytes(32))
            s.sendall(struct.pack("<4scI", b"HXNM", b"S", len(body)) + body)
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    assert victim.cmd("agents").split()[0] == "0", "an unauthenticated S was loaded"

    stranger = agents("N")
    stranger.fetch_remote_metadata("A", "127.0.0.1", port)
    until(lambda: "A" in stranger._fetch_errors, "the stranger's fetch to fail")
    assert not stranger.check_remote_metadata("A")

    good = agents("G", hixl_options={"hixl.secret": SECRET})
    good.send_local_metadata("127.0.0.1", port)
    until(lambda: victim.cmd("agents").split()[0] == "1", "the good agent's S to load")
    good.fetch_remote_metadata("A", "127.0.0.1", port)
    until(lambda: good.check_remote_metadata("A"), "the good agent's fetch")
    write_and_compare(good, victim, victim_md, 47)


def test_nixl_listener_caps_are_checked_and_named(agents):
    """Bad cap values are refused naming the keyword; a fetched reply over the fetcher's region
    cap is refused from its header, the error naming hixl_listen_thread_max_regions."""
    for kw in ("hixl_listen_thread_max_agents", "hixl_listen_thread_max_regions"):
        for bad in (0, -1, True, 2.5, 1 << 40):
            with pytest.raises(nixlInvalidParamError, match=kw):
                agents("X", **{kw: bad})
    big = nixl_agent("B", nixl_agent_config(True, True, 0))
    try:
        bufs = [np.zeros(4096, np.uint8) for _ in range(1000)]
        for b in bufs:
            big.register_memory(b)
        small = agents("S", hixl_listen_thread_max_regions=2)
        small.fetch_remote_metadata("B", "127.0.0.1", big.listen_port)
        until(lambda: "B" in small._fetch_errors, "the over-cap fetch to fail")
        assert "hixl_listen_thread_max_regions=2" in small._fetch_errors["B"]
    finally:
        big.close()


# --- the metadata parser ----------------------------------------------------------------------

REAL_NIXL = (HERE / "nixl-1.5.1-agent-metadata.bin").read_bytes()
GOOD = _meta.encode("agent", "127.0.0.1:5000", [[4096, 8192, 0], [1 << 40, 1 << 20, 1]])


def _mutate(seed: bytes, data: st.DataObject) -> bytes:
    b = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "splice"]))
        i = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "flip" and b:
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del b[i : i + data.draw(st.integers(1, 64))]
        elif op == "insert":
            b[i:i] = data.draw(st.binary(max_size=32))
        else:
            other = data.draw(st.sampled_from([REAL_NIXL, GOOD, b'1e999,NaN,-Infinity,[[[[["']))
            b[i:i] = other[data.draw(st.integers(0, len(other))) :]
    return bytes(b)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
DOCS = st.fixed_dictionaries(
    {"name": JSON | st.text(), "regions": st.lists(st.lists(JSON, max_size=4), max_size=4)},
    optional={"engine": JSON, "partial": JSON},
)


def _check(md: bytes) -> None:
    try:
        doc = _meta.decode(md, 16)
    except nixlInvalidParamError:
        return
    assert isinstance(doc["name"], str) and doc["name"]
    assert isinstance(doc.get("partial", False), bool) and len(doc["regions"]) <= 16
    for a, n, d in doc["regions"]:
        assert 0 <= a and 0 <= n and a + n < 1 << 64 and 0 <= d < 1 << 64


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_nixl_metadata_parser_returns_or_refuses(data):
    """Mutations of a real NIXL 1.5.1 metadata blob and of hixl.nixl metadata, and arbitrary
    JSON documents behind the prefix: the parser returns well-typed metadata within its bounds
    or raises nixlInvalidParamError, never anything else."""
    seed = data.draw(st.sampled_from([REAL_NIXL, GOOD, _meta.MAGIC + REAL_NIXL]))
    _check(_mutate(seed, data))
    doc = data.draw(DOCS)
    _check(_meta.MAGIC + json.dumps(doc).encode())
    assert _meta.decode(GOOD)["regions"] == [[4096, 8192, 0], [1 << 40, 1 << 20, 1]]
