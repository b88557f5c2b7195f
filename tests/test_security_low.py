"""The Low items of the security review round 3 (issue 34), each performed against real
processes and real sockets: the NIXL layer's listen thread, the metrics endpoint, patterned
secrets, resized tensors. docs/RELIABILITY.md cites them by name."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _lineproc import LineProc

import hixl
import hixl.metrics
from hixl.nixl import nixl_agent, nixl_agent_config

HERE = Path(__file__).parent


class Proc(LineProc):
    """A helper process driven by lines on stdin/stdout; its first line starts with READY."""

    def close(self, wait_s: float = 10) -> None:
        super().close(wait_s)


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: object) -> Proc:
        p = Proc(list(args))
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.close()


@pytest.fixture
def listening_agent() -> Iterator[Callable[..., nixl_agent]]:
    made: list[nixl_agent] = []

    def make(name: str, **kw: object) -> nixl_agent:
        a = nixl_agent(name, nixl_agent_config(True, True, 0, **kw))  # type: ignore[arg-type]
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def until(cond: Callable[[], object], what: str, timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)
    return got


# --- the NIXL layer's listen thread -------------------------------------------------------------

# Both peers map their buffer here, so the attacker's region has the real agent's addresses.
FIXED_ADDR = 0x5A0000000000
SIZE = 1 << 20


def test_nixl_listener_cannot_repoint_a_loaded_agent(procs, listening_agent, caplog):
    """A second process sends the victim's listen thread ``I`` (forget "B") and then ``S``
    (agent "B" is at my engine), as the attacker that made a WRITE to "B" land at its own
    engine. The victim keeps the real B, refuses both (logged), and its WRITE to "B" lands at
    the real B: the attacker's buffer stays zero."""
    caplog.set_level(logging.WARNING, logger="hixl.nixl")
    victim = listening_agent("A")
    real = procs(HERE / "_sec_nixl_peer.py", "B", hex(FIXED_ADDR), SIZE)
    assert victim.add_remote_agent(bytes.fromhex(real.words[1])) == b"B"
    attacker = procs(HERE / "_sec_nixl_peer.py", "B", hex(FIXED_ADDR), SIZE, victim.listen_port)
    assert attacker.line(60) == "SENT"
    # The invalidation is judged within the listen thread's timeout (5 s): wait past it.
    time.sleep(6.5)
    assert victim.check_remote_metadata("B")

    data = np.random.default_rng(34).integers(0, 256, SIZE, dtype=np.uint8)
    victim.register_memory(data)
    local = victim.get_xfer_descs([(data.ctypes.data, SIZE, 0)], "DRAM")
    remote = victim.get_xfer_descs([(FIXED_ADDR, SIZE, 0)], "DRAM")
    h = victim.initialize_xfer("WRITE", local, remote, "B")
    victim.transfer(h)
    until(lambda: victim.check_xfer_state(h) != "PROC", "the WRITE")
    assert victim.check_xfer_state(h) == "DONE", h.error
    victim.release_xfer_handle(h)

    want = hashlib.sha256(data.tobytes()).hexdigest()
    zeros = hashlib.sha256(bytes(SIZE)).hexdigest()
    assert attacker.cmd("dump") == zeros, "the WRITE to 'B' landed at the attacker's engine"
    assert real.cmd("dump") == want, "the real B did not get the WRITE"
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "refused" in logged and "127.0.0.1" in logged, logged


def test_nixl_listener_idle_flood_is_capped(listening_agent):
    """200 idle connections and 8 that trickle one byte a second: the listen thread serves at
    most hixl_listen_thread_max_conns (16) of them at once, a good peer's fetch still succeeds
    meanwhile, and the tricklers are cut at the whole-request timeout (5 s), not kept forever
    by their bytes."""
    victim = listening_agent("A")
    peer = listening_agent("P")
    before = threading.active_count()
    port = victim.listen_port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    trickle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    try:
        t0 = time.monotonic()
        for s in trickle:  # a valid header announcing 1000 bytes, then one byte a second
            s.sendall(struct.pack("<4scI", b"HXNM", b"S", 1000))
        time.sleep(1.0)
        grew = threading.active_count() - before
        assert grew <= 16 + 4, f"{grew} threads for 208 idle connections"
        peer.fetch_remote_metadata("A", "127.0.0.1", port)
        until(lambda: peer.check_remote_metadata("A"), "a good peer's fetch", 15)
        # Keep trickling: each byte resets a per-read timeout, never a whole-request one.
        alive = list(trickle)
        while alive and time.monotonic() - t0 < 12:
            for s in list(alive):
                try:
                    s.sendall(b"X")
                except OSError:
                    alive.remove(s)
            time.sleep(1.0)
        assert not alive, f"{len(alive)} trickling connections still open after 12 s"
    finally:
        for s in idle + trickle:
            s.close()


def _listen_addrs(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port`, as the kernel lists them."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                host, p = local.split(":")
                if state == "0A" and int(p, 16) == port:
                    out.add(host)
    return out


def test_nixl_listener_binds_the_engine_address(listening_agent):
    """By default the listen thread binds where the engine listens (127.0.0.1 here), not every
    interface; hixl_listen_thread_ip="0.0.0.0" binds every interface, as NIXL's does."""
    a = listening_agent("A")
    assert a.engine.local_engine.startswith("127.0.0.1:")
    assert _listen_addrs(a.listen_port) == {"0100007F"}, "not bound to 127.0.0.1 alone"
    b = listening_agent("B", hixl_listen_thread_ip="0.0.0.0")
    assert _listen_addrs(b.listen_port) == {"00000000"}


# --- hixl.metrics.serve ---------------------------------------------------------------------


def test_metrics_idle_connections_capped_and_closed(engine):
    """150 idle connections and 4 that trickle a request one byte a second, against a real
    endpoint: a urllib scrape still succeeds at once, the server holds at most max_connections
    (16) threads plus a few, and every one of them is closed by the handler timeout (5 s)."""
    srv = hixl.metrics.serve(engine)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(150)]
        trickle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
        t0 = time.monotonic()
        for s in trickle:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        time.sleep(1.0)
        grew = threading.active_count() - before
        assert grew <= 16 + 4, f"{grew} threads for 154 idle connections"
        start = time.monotonic()
        with urllib.request.urlopen(srv.url, timeout=5) as r:
            assert r.status == 200 and b"hixl_peers" in r.read()
        assert time.monotonic() - start < 5
        alive = list(trickle)
        while alive and time.monotonic() - t0 < 12:
            for s in list(alive):
                try:
                    s.sendall(b"X")
                except OSError:
                    alive.remove(s)
            time.sleep(1.0)
        assert not alive, f"{len(alive)} trickling connections still open after 12 s"
        # The idle ones are closed too: each reads EOF (or a reset), none is left waiting.
        for s in idle:
            s.settimeout(2)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        until(lambda: threading.active_count() - before <= 1, "the server's threads to end", 10)
    finally:
        srv.close()
        for s in idle + trickle:
            s.close()


# --- a registered torch tensor later resize_()d -------------------------------------------------


class _Storage:
    """torch's UntypedStorage as hixl reads it: data_ptr() and nbytes() of the memory now."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def nbytes(self) -> int:
        return int(self.arr.nbytes)


class _Tensor:
    """A stand-in for a torch CPU tensor (torch is not a test dependency) whose resize_() does
    what torch's does when it grows: new memory for the same storage, the old one freed."""

    __module__ = "torch"

    class _Cpu:
        type = "cpu"

    device = _Cpu()

    def __init__(self, n: int) -> None:
        self.storage = _Storage(np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8))

    def resize_(self, n: int) -> None:
        self.storage.arr = np.zeros(n, np.uint8)  # the registered array is freed here

    def data_ptr(self) -> int:
        return self.storage.data_ptr()

    def untyped_storage(self) -> _Storage:
        return self.storage

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self.storage.nbytes()

    def element_size(self) -> int:
        return 1


def _resized_tensor_is_caught(engine: hixl.Hixl, peer, t, grow: Callable[[], None]) -> None:
    h = engine.register(t)
    engine.put(peer.engine, h.addr, peer.addr, 4096)
    other = np.full(4096, 7, np.uint8)  # before the resize: not in the memory it frees
    engine.register(other)
    grow()
    for attempt in (
        lambda: engine.put(peer.engine, h.addr, peer.addr, 4096),
        lambda: engine.transfer_async(peer.engine, hixl.TransferOp.READ, [(h.addr, peer.addr, 64)]),
    ):
        with pytest.raises(hixl.Failed, match="registered torch tensor was resized"):
            attempt()
    # A transfer from memory the resized tensor does not hold is not refused for it.
    engine.put(peer.engine, other.ctypes.data, peer.addr, 4096)
    assert peer.read().tobytes() == other.tobytes()
    with pytest.raises(hixl.Failed, match="deregistered, but a registered torch tensor"):
        engine.deregister_mem(h)
    # Deregistered: the engine no longer refuses transfers for it.
    keep = np.ones(4096, np.uint8)
    k = engine.register(keep)
    engine.put(peer.engine, k.addr, peer.addr, 4096)
    assert peer.read().tobytes() == keep.tobytes()


def test_resized_tensor_is_refused_not_used(engine, make_peer):
    """A registered tensor whose storage is reallocated by resize_(): the engine holds the
    storage, sees that it moved, and refuses every transfer from or into it (and says so at
    deregistration) instead of reading or writing the freed memory."""
    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    t = _Tensor(4096)
    _resized_tensor_is_caught(engine, peer, t, lambda: t.resize_(1 << 20))


def test_resized_real_torch_tensor_is_refused(engine, make_peer):
    """The same with a real torch CPU tensor (runs where torch is installed)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (not a dependency)")
    peer = make_peer(4096)
    engine.connect(peer.engine, timeout_ms=5000)
    t = torch.zeros(4096, dtype=torch.uint8)
    _resized_tensor_is_caught(engine, peer, t, lambda: t.resize_(1 << 20))
