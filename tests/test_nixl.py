"""hixl.nixl, NIXL's Python agent API on hixl: two-process programs written the way NIXL's users
write them (tests/_nixl_target.py, tests/_nixl_initiator.py, tests/_nixl_peer.py), vLLM's
NixlConnector call sequence, NIXL-style errors, descriptor lists, and the `import nixl` shim in
subprocesses. Real sockets everywhere, ports chosen by the OS, bytes compared."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import proc_state

import hixl
from hixl import nixl
from hixl.nixl import nixl_agent, nixl_agent_config

HERE = Path(__file__).parent


def until(cond: Callable[[], Any], what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.001)


class Proc:
    """A helper program; `line()` reads one stdout line within a timeout."""

    def __init__(self, *args: object, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, *map(str, args)],
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self.sel = selectors.DefaultSelector()
        assert self.p.stdout is not None
        self.sel.register(self.p.stdout, selectors.EVENT_READ)

    def line(self, timeout_s: float = 30.0) -> str:
        assert self.p.stdout is not None
        if not self.sel.select(timeout_s):
            raise AssertionError(f"no output within {timeout_s} s")
        out = self.p.stdout.readline()
        if not out:
            err = self.p.stderr.read() if self.p.stderr else ""
            raise AssertionError(f"exited with {self.p.wait(10)}: {err}")
        return out.strip()

    def cmd(self, *words: object) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(" ".join(map(str, words)) + "\n")
        self.p.stdin.flush()
        return self.line()

    def finish(self, timeout_s: float = 60.0) -> tuple[int, str, str]:
        try:
            out, err = self.p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, err = self.p.communicate()
            raise AssertionError(f"did not exit within {timeout_s} s: {out}\n{err}") from None
        return self.p.returncode, out, err

    def close(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.communicate()


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: object, **kw: Any) -> Proc:
        p = Proc(*args, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def agents() -> Iterator[Callable[..., nixl_agent]]:
    made: list[nixl_agent] = []

    def make(name: str | None = None, conf: nixl_agent_config | None = None) -> nixl_agent:
        a = nixl_agent(name or str(uuid.uuid4()), conf)
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def seeded(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def wait_done(agent: nixl_agent, h: nixl.nixl_xfer_handle) -> str:
    return str(until(lambda: (s := agent.check_xfer_state(h)) != "PROC" and s, "transfer end"))


# --- two processes, as NIXL's users write them ---------------------------------------------------


@pytest.mark.parametrize("mode", ["md", "listen"])
def test_two_processes_read_write_notify(procs, tmp_path, mode):
    """Target and initiator in separate processes. md: metadata through get_agent_metadata /
    add_remote_agent (files); listen: through the listen thread (fetch_remote_metadata,
    send_local_metadata, invalidate_local_metadata). READ of a tensor as row descriptors and
    byte comparison, WRITE with prepped lists and index selection checked by the target,
    notifications with transfers and alone, serialized descriptors, released handles."""
    target = procs(HERE / "_nixl_target.py", mode, tmp_path)
    tag, port = target.line().split()
    assert tag == "READY"
    init = procs(HERE / "_nixl_initiator.py", mode, tmp_path, port)
    rc_i, out_i, err_i = init.finish()
    rc_t, out_t, err_t = target.finish()
    assert rc_i == 0, out_i + err_i
    assert rc_t == 0, out_t + err_t
    assert out_i.split("\n")[:-1] == [
        f"OK {s}" for s in ("metadata", "read", "write", "notif", "done")
    ], out_i
    steps = ["metadata", "read notified", "write verified", "ping"]
    steps += ["invalidated"] if mode == "listen" else []
    assert out_t.split("\n")[:-1] == [f"OK {s}" for s in [*steps, "done"]], out_t


def test_remove_agent_while_transfer_in_flight(procs, agents):
    """A WRITE to a frozen peer is in flight when its agent is removed: the transfer ends (ERR)
    instead of hanging, the name is unknown afterwards, and adding the agent again works."""
    size = 64 << 20
    peer = procs(HERE / "_nixl_peer.py", "frozen", size, "HIXL_TCP")
    tag, md_hex = peer.line().split()
    assert tag == "READY"
    md = bytes.fromhex(md_hex)
    me = agents("mover", nixl_agent_config(backends=["HIXL_TCP"]))
    src = seeded((size,), 5)
    me.register_memory(src)
    name = me.add_remote_agent(md)
    assert name == b"frozen"
    remote_addr = json.loads(md[len(b"HIXLNIXL1\n") :])["regions"][0][0]
    remote = me.get_xfer_descs([(remote_addr, size, 0)], "DRAM")
    me.make_connection(name)
    os.kill(peer.p.pid, signal.SIGSTOP)
    try:
        stop_deadline = time.monotonic() + 5  # SIGSTOP lands asynchronously
        while proc_state(peer.p.pid) != "T":
            assert time.monotonic() < stop_deadline, "the peer did not stop"
            time.sleep(0.001)
        h = me.initialize_xfer("WRITE", me.get_xfer_descs(src), remote, name, b"w")
        assert me.transfer(h) == "PROC"
        time.sleep(0.2)
        assert me.check_xfer_state(h) == "PROC"
        with pytest.raises(nixl.nixlRepostActiveError, match="still in progress"):
            me.transfer(h)
        t0 = time.monotonic()
        me.remove_remote_agent("frozen")
        assert time.monotonic() - t0 < 15
        assert wait_done(me, h) == "ERR"
        assert h.error
        with pytest.raises(nixl.nixlNotFoundError, match="NIXL_ERR_NOT_FOUND.*frozen"):
            me.prep_xfer_dlist("frozen", remote)
        with pytest.raises(nixl.nixlNotFoundError):
            me.transfer(h)
        me.release_xfer_handle(h)
    finally:
        os.kill(peer.p.pid, signal.SIGCONT)
    assert me.add_remote_agent(md) == b"frozen"
    h2 = me.initialize_xfer("WRITE", me.get_xfer_descs(src), remote, "frozen", b"again")
    me.transfer(h2)
    assert wait_done(me, h2) == "DONE"
    assert peer.cmd("sha") == hashlib.sha256(src.tobytes()).hexdigest()
    me.release_xfer_handle(h2)
    with pytest.raises(nixl.nixlInvalidParamError, match="released"):
        me.check_xfer_state(h2)


def test_notifications_to_and_from_another_process(procs, agents):
    """Notifications alone and with transfers reach the other process as bytes, keyed by the
    sender's agent name, in order, and a READ of the peer's bytes matches them."""
    peer = procs(HERE / "_nixl_peer.py", "far", 1 << 20, "UCX")
    md = bytes.fromhex(peer.line().split()[1])
    assert peer.cmd("fill", 9) == "OK"
    me = agents("near")
    name = me.add_remote_agent(md)
    buf = np.zeros(1 << 20, np.uint8)
    me.register_memory(buf)
    remote_addr = json.loads(md[len(b"HIXLNIXL1\n") :])["regions"][0][0]
    # 256 descriptors of 4 KiB, read in reverse order.
    n = 256
    local = [(buf.ctypes.data + i * 4096, 4096, 0) for i in range(n)]
    remote = [(remote_addr + (n - 1 - i) * 4096, 4096, 0) for i in range(n)]
    h = me.initialize_xfer("READ", me.get_xfer_descs(local, "DRAM"), remote, name, "read-tag")
    me.transfer(h)
    assert wait_done(me, h) == "DONE"
    want = seeded((1 << 20,), 9).reshape(n, 4096)[::-1].reshape(-1)
    assert np.array_equal(buf, want)
    for m in (b"one", b"\x00\xff two", b""):
        me.send_notif(name, m)
    msgs: list[bytes] = []

    def four() -> bool:
        msgs.extend(bytes.fromhex(x) for x in json.loads(peer.cmd("notifs")).get("near", []))
        return len(msgs) >= 4

    until(four, "four notifications at the peer")
    # Standalone notifications keep their order; the transfer's may come before or among them.
    assert sorted(msgs) == sorted([b"read-tag", b"one", b"\x00\xff two", b""])
    assert [m for m in msgs if m != b"read-tag"] == [b"one", b"\x00\xff two", b""]


# --- vLLM's NixlConnector call sequence, and NIXL's examples -------------------------------------


def test_vllm_nixl_connector_sequence(agents):
    """The calls vLLM's NixlConnector makes, in its order: agent without config, register the
    KV caches as (addr, len, dev, meta) tuples, exchange metadata, prep local and remote block
    lists, make_prepped_xfer with numpy index arrays and a notification, poll, telemetry,
    release, notify the producer, and tear down."""
    nblocks, block = 32, 2048
    prefill = agents(str(uuid.uuid4()), None)
    decode = agents(str(uuid.uuid4()), None)
    kv_p = seeded((2, nblocks, block), 3)  # (K/V, blocks, block bytes)
    kv_d = np.zeros_like(kv_p)
    for agent, kv in ((prefill, kv_p), (decode, kv_d)):
        caches = [(kv[i].ctypes.data, kv[i].nbytes, 0, "") for i in range(2)]
        descs = agent.get_reg_descs(caches, "DRAM")
        agent.register_memory(descs)
    remote_name = decode.add_remote_agent(prefill.get_agent_metadata())

    def blocks(kv: np.ndarray) -> list[tuple[int, int, int]]:
        return [(kv[i].ctypes.data + b * block, block, 0) for i in range(2) for b in range(nblocks)]

    src_h = decode.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(kv_d), "DRAM")
    dst_h = decode.prep_xfer_dlist(remote_name, blocks(kv_p), "DRAM")
    remote_ids = np.array([3, 4, 5, 17, nblocks + 3, nblocks + 4], np.int32)
    local_ids = np.array([0, 1, 2, 9, nblocks + 0, nblocks + 1], np.int32)
    handle = decode.make_prepped_xfer(
        "READ", src_h, local_ids, dst_h, remote_ids, notif_msg=b"req-1"
    )
    assert decode.transfer(handle) in ("PROC", "DONE")
    assert wait_done(decode, handle) == "DONE"
    res = decode.get_xfer_telemetry(handle)
    assert res.totalBytes == 6 * block and res.descCount == 6 and res.xferDuration >= 0
    decode.release_xfer_handle(handle)
    flat_p, flat_d = kv_p.reshape(-1, block), kv_d.reshape(-1, block)
    for li, ri in zip(local_ids, remote_ids, strict=True):
        assert np.array_equal(flat_d[li], flat_p[ri])
    untouched = np.setdiff1d(np.arange(2 * nblocks), local_ids)
    assert not flat_d[untouched].any()
    # The consumer tells the producer it may free the blocks.
    prefill.add_remote_agent(decode.get_agent_metadata())
    decode.send_notif(remote_name, notif_msg=b"req-1:done")
    got: list[bytes] = []

    def both() -> bool:
        new = prefill.get_new_notifs()
        assert set(new) <= {decode.name}, new
        got.extend(new.get(decode.name, []))
        return len(got) >= 2

    until(both, "the transfer's and the done notification")
    assert sorted(got) == [b"req-1", b"req-1:done"]
    decode.remove_remote_agent(remote_name)
    decode.release_dlist_handle(src_h)
    decode.release_dlist_handle(dst_h)


def test_nixl_example_call_sequence(agents):
    """The calls of NIXL's published nixl_api_example.py: malloc'd buffers described by tuples
    (with the older is_sorted arguments), descriptor lists from tuples and from an N x 3 array,
    READ posted twice on one handle, serialized descriptors in a notification, a prepped
    WRITE with swapped indices, completion seen on both sides, and teardown."""
    from hixl.nixl import _utils

    size = 256
    target = agents("target", nixl_agent_config(backends=["UCX"]))
    init = agents("initiator", None)
    a1, a3 = _utils.malloc_passthru(2 * size), _utils.malloc_passthru(2 * size)
    try:
        t_bytes = np.frombuffer(_utils.ba_buf(a1, 2 * size), np.uint8)
        i_bytes = np.frombuffer(_utils.ba_buf(a3, 2 * size), np.uint8)
        t_bytes[:] = seeded((2 * size,), 21)
        i_bytes[:] = 0
        t_tuples = [(a1, size, 0), (a1 + size, size, 0)]
        t_reg = target.get_reg_descs([(a1, size, 0, "a"), (a1 + size, size, 0, "b")], "DRAM", True)
        t_xfer = target.get_xfer_descs(t_tuples, "DRAM", is_sorted=True)
        assert t_xfer == target.get_xfer_descs(np.array(t_tuples), "DRAM")
        assert target.register_memory(t_reg) is not None
        i_reg = init.get_reg_descs([(a3, size, 0, "a"), (a3 + size, size, 0, "b")], "DRAM")
        i_xfer = init.get_xfer_descs([(a3, size, 0), (a3 + size, size, 0)], "DRAM")
        assert init.register_memory(i_reg, is_sorted=True) is not None
        name = init.add_remote_agent(target.get_agent_metadata())
        assert name == b"target"
        serdes = target.get_serialized_descs(t_reg)
        assert init.deserialize_descs(serdes) == t_reg
        h1 = init.initialize_xfer("READ", i_xfer, t_xfer, name, b"UUID1")
        assert h1
        for _ in range(2):  # one handle, posted twice
            i_bytes[:] = 0
            assert init.transfer(h1) != "ERR"
            assert wait_done(init, h1) == "DONE"
            until(lambda: target.check_remote_xfer_done("initiator", b"UUID1"), "UUID1")
            assert np.array_equal(i_bytes, t_bytes)
        lp = init.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(a3, size, 0), (a3 + size, size, 0)], "DRAM", True
        )
        rp = init.prep_xfer_dlist(name, t_xfer, "DRAM")
        empty = init.prep_xfer_dlist("NIXL_INIT_AGENT", [], "DRAM")
        assert lp and rp and empty and lp != 0
        note = b"DESCS: " + serdes
        init.send_notif(name, note)
        until(lambda: note in target.get_new_notifs().get("initiator", []), "the DESCS notif")
        i_bytes[:] = seeded((2 * size,), 22)
        h2 = init.make_prepped_xfer("WRITE", lp, [0, 1], rp, [1, 0], b"UUID2")
        assert init.transfer(h2) != "ERR"
        assert wait_done(init, h2) == "DONE"
        until(lambda: target.check_remote_xfer_done("initiator", b"UUID2"), "UUID2")
        assert np.array_equal(t_bytes[:size], i_bytes[size:])
        assert np.array_equal(t_bytes[size:], i_bytes[:size])
        for h in (h1, h2):
            init.release_xfer_handle(h)
        for d in (lp, rp, empty):
            init.release_dlist_handle(d)
        init.remove_remote_agent("target")
        target.deregister_memory(t_reg)
        init.deregister_memory(i_reg)
    finally:
        _utils.free_passthru(a1)
        _utils.free_passthru(a3)


def test_8192_prepped_descriptors_with_index_selection(agents):
    """8192-entry prepped lists, a random selection of half of them, WRITE; bytes compared."""
    n, size = 8192, 512
    a, b = agents("a"), agents("b")
    src = seeded((n, size), 11)
    dst = np.zeros_like(src)
    a.register_memory(src)
    b.register_memory(dst)
    name = a.add_remote_agent(b.get_agent_metadata())
    lh = a.prep_xfer_dlist("", a.get_xfer_descs(_rows(src), "DRAM"))
    rh = a.prep_xfer_dlist(name, np.array(_rows(dst), np.uint64), "DRAM")
    rng = np.random.default_rng(1)
    li = rng.permutation(n)[: n // 2]
    ri = rng.permutation(n)[: n // 2]
    h = a.make_prepped_xfer("WRITE", lh, li.tolist(), rh, ri.astype(np.int32))
    assert a.query_xfer_backend(h) == "UCX"
    dur, margin, method = a.estimate_xfer_cost(h)
    assert dur > 0 and margin > 0 and method == "ANALYTICAL_BACKEND"
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    tel = a.get_xfer_telemetry(h)
    assert tel.totalBytes == (n // 2) * size and tel.descCount == n // 2
    assert tel["xferDuration"] == tel.xferDuration >= tel.postDuration >= 0
    assert np.array_equal(dst[ri], src[li])
    rest = np.setdiff1d(np.arange(n), ri)
    assert not dst[rest].any()


def _rows(arr: np.ndarray) -> list[tuple[int, int, int]]:
    n = arr.shape[1] * arr.itemsize
    return [(arr.ctypes.data + i * n, n, 0) for i in range(arr.shape[0])]


def test_a_plain_hixl_engine_reaches_an_agent(agents):
    """An agent's engine is an ordinary hixl engine: a plain hixl.Hixl that knows its address
    (it is in the metadata) writes the agent's registered memory and notifies it; the
    notification appears under its hixl name."""
    a = agents("plain-target")
    buf = np.zeros(4096, np.uint8)
    a.register_memory(buf)
    engine_addr = json.loads(a.get_agent_metadata()[len(b"HIXLNIXL1\n") :])["engine"]
    assert engine_addr == a.engine.local_engine
    src = seeded((4096,), 30)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")
        e.register(src)
        e.connect(engine_addr, timeout_ms=10000)
        e.transfer_sync(
            engine_addr, hixl.TransferOp.WRITE, [(src.ctypes.data, buf.ctypes.data, 4096)]
        )
        e.send_notify(engine_addr, hixl.NotifyDesc("plain", "héllo"), timeout_ms=10000)
        got = until(lambda: a.get_new_notifs(), "the plain engine's notification")
    assert got == {"plain": ["héllo".encode()]}
    assert np.array_equal(buf, src)


class _Device:
    def __init__(self, kind: str) -> None:
        self.type = kind

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:0"


class FakeTensor:
    """Stands in for a torch tensor (torch is not a test dependency): the attributes hixl.nixl
    and hixl's engine read, over a numpy array."""

    __module__ = "torch"

    def __init__(self, arr: np.ndarray, device: str = "cpu") -> None:
        self.arr, self.device = arr, _Device(device)

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def untyped_storage(self) -> np.ndarray:
        return self.arr

    def numel(self) -> int:
        return int(self.arr.size)

    def element_size(self) -> int:
        return int(self.arr.itemsize)

    def is_contiguous(self) -> bool:
        return bool(self.arr.flags.c_contiguous)

    def get_device(self) -> int:
        return -1 if self.device.type == "cpu" else 0


def test_tensors_register_and_transfer(agents):
    """Lists of (CPU) tensors register and describe themselves; CUDA tensors are refused."""
    a, b = agents("ta"), agents("tb")
    src = [FakeTensor(seeded((256,), 40 + i).view(np.float32)) for i in range(2)]
    dst = [FakeTensor(np.zeros(64, np.float32)) for _ in range(2)]
    a.register_memory(src)
    b.register_memory(b.get_reg_descs(dst))
    name = a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(src), a.get_xfer_descs(dst), name)
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    for s_, d in zip(src, dst, strict=True):
        assert s_.arr.tobytes() == d.arr.tobytes()
    gpu = FakeTensor(np.zeros(16, np.float32), "cuda")
    assert a.get_xfer_descs(gpu).getType() == nixl._bindings.VRAM_SEG
    with pytest.raises(nixl.nixlNotSupportedError, match="VRAM"):
        a.register_memory([gpu])
    with pytest.raises(nixl.nixlInvalidParamError, match="one kind of device"):
        a.get_reg_descs([src[0], gpu])


def test_loopback_and_nixl_utils(agents):
    """NIXL's loopback mode (the remote side prepared with the agent's own name), on memory
    from nixl._utils' malloc_passthru."""
    from hixl.nixl import _utils

    a = agents("self")
    addr = _utils.malloc_passthru(8192)
    try:
        src = np.frombuffer(_utils.ba_buf(addr, 8192), np.uint8)
        src[:] = seeded((8192,), 4)
        reg = a.register_memory([(addr, 8192, 0, "loop")], "DRAM")
        assert reg[0] == (addr, 8192, 0, b"loop")
        lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, 4096, 0)], "DRAM")
        rh = a.prep_xfer_dlist("self", [(addr + 4096, 4096, 0)], "DRAM")
        h = a.make_prepped_xfer("READ", lh, [0], rh, [0], b"looped")
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        assert np.array_equal(src[:4096], src[4096:])
        assert until(lambda: a.check_remote_xfer_done("self", b"loop"), "loopback notification")
        a.deregister_memory(reg)
    finally:
        _utils.free_passthru(addr)


# --- errors, as NIXL raises them -----------------------------------------------------------------


def test_bad_agent_names_and_unregistered_memory(agents):
    a, b = agents("alpha"), agents("beta")
    mine, theirs = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
    a.register_memory(mine)
    b.register_memory(theirs)
    name = a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(mine.ctypes.data, 4096, 0)], "DRAM")
    remote = a.get_xfer_descs([(theirs.ctypes.data, 4096, 0)], "DRAM")
    for call in (
        lambda: a.prep_xfer_dlist("nobody", remote),
        lambda: a.initialize_xfer("READ", local, remote, "nobody"),
        lambda: a.send_notif("nobody", b"x"),
        lambda: a.remove_remote_agent("nobody"),
        lambda: a.make_connection("nobody"),
    ):
        with pytest.raises(nixl.nixlNotFoundError, match=r"NIXL_ERR_NOT_FOUND.*'nobody'") as e:
            call()
        assert e.value.hixl_code == hixl.Status.PARAM_INVALID
        assert "[hixl PARAM_INVALID 103900]" in str(e.value)
    assert not a.check_remote_metadata("nobody")
    stray = np.zeros(4096, np.uint8)  # never registered
    outside = a.get_xfer_descs([(stray.ctypes.data, 4096, 0)], "DRAM")
    with pytest.raises(nixl.nixlNotFoundError, match="this agent's registered memory"):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", outside)
    with pytest.raises(nixl.nixlNotFoundError, match="this agent's registered memory"):
        a.initialize_xfer("WRITE", outside, remote, name)
    with pytest.raises(nixl.nixlNotFoundError, match="memory agent 'beta' registered"):
        a.initialize_xfer("WRITE", local, outside, name)
    past_end = a.get_xfer_descs([(theirs.ctypes.data + 8000, 4096, 0)], "DRAM")
    with pytest.raises(nixl.nixlNotFoundError, match="descriptor 0"):
        a.prep_xfer_dlist(name, past_end)
    assert not a.check_remote_metadata(name, past_end)
    assert a.check_remote_metadata(name, remote)
    with pytest.raises(nixl.nixlNotFoundError, match="not registered"):
        a.deregister_memory(a.get_reg_descs([(stray.ctypes.data, 4096, 0, "")], "DRAM"))
    # Lengths and counts that do not pair up, unknown operations, bad indices.
    short = a.get_xfer_descs([(theirs.ctypes.data, 1024, 0)], "DRAM")
    with pytest.raises(nixl.nixlInvalidParamError, match="length 4096 != remote length 1024"):
        a.initialize_xfer("WRITE", local, short, name)
    with pytest.raises(nixl.nixlInvalidParamError, match="counts differ"):
        a.initialize_xfer("WRITE", local, a.get_xfer_descs([], "DRAM"), name)
    with pytest.raises(KeyError):
        a.initialize_xfer("RD", local, remote, name)
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", local)
    rh = a.prep_xfer_dlist(name, remote)
    with pytest.raises(KeyError):
        a.make_prepped_xfer("WR", lh, [0], rh, [0])
    with pytest.raises(nixl.nixlInvalidParamError, match="index out of range"):
        a.make_prepped_xfer("WRITE", lh, [1], rh, [0])
    with pytest.raises(nixl.nixlInvalidParamError, match="NIXL_INIT_AGENT"):
        a.make_prepped_xfer("WRITE", rh, [0], rh, [0])
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    with pytest.raises(nixl.nixlNotPostedError):
        a.check_xfer_state(h)
    with pytest.raises(nixl.nixlNoTelemetryError):
        a.get_xfer_telemetry(h)
    a.release_dlist_handle(lh)
    with pytest.raises(nixl.nixlInvalidParamError, match="released"):
        a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    with pytest.raises(KeyError):
        a.prep_xfer_dlist(name, remote, "DRAM", ["GDS"])


def test_memory_types_and_backends(agents):
    a = agents("mem", nixl_agent_config(True, False, 0, ["UCX", "GDS", "NOPE"]))
    assert any("GDS" in w for w in a.ignored) and any("NOPE" in w for w in a.ignored)
    assert list(a.backends) == ["UCX"]
    assert "UCX" in a.get_plugin_list() and "GDS" not in a.get_plugin_list()
    assert a.get_plugin_mem_types("UCX") == ["DRAM_SEG"]
    assert a.get_plugin_mem_types("GDS") == []
    assert a.get_backend_params("UCX")["hixl.backends"] == "auto"
    assert a.get_backend_mem_types("UCX") == ["DRAM_SEG"]
    with pytest.raises(nixl.nixlNotFoundError, match="GPUDirect Storage"):
        a.create_backend("GDS")
    with pytest.raises(nixl.nixlNotFoundError, match="no plugin named 'UVX'"):
        a.create_backend("UVX")
    a.create_backend("LIBFABRIC", {"num_threads": "4"})
    assert any("num_threads" in w for w in a.ignored)
    if not hixl.cuda_info()["available"]:  # with CUDA, VRAM goes to the engine's cuda:N
        with pytest.raises(nixl.nixlNotSupportedError, match="VRAM.*needs CUDA"):
            a.register_memory([(0x1000, 4096, 0, "")], "VRAM")
        with pytest.raises(nixl.nixlNotSupportedError, match="VRAM"):
            a.prep_xfer_dlist("NIXL_INIT_AGENT", [(0x1000, 4096, 0)], "cuda")
    with pytest.raises(nixl.nixlNotSupportedError, match="storage"):
        a.register_memory([(0x1000, 4096, 0, "")], "FILE")
    with pytest.raises(nixl.nixlInvalidParamError, match="memory type is needed"):
        a.get_xfer_descs([(0x1000, 4096, 0)])
    with pytest.raises(nixl.nixlInvalidParamError, match="3-tuples"):
        a.get_xfer_descs([(0x1000, 4096, 0, "")], "DRAM")
    with pytest.raises(nixl.nixlNotSupportedError, match="etcd"):
        a.fetch_remote_metadata("x")
    assert a.query_memory([(0x1000, 4096, 0, "")], "UCX", "DRAM") == [None]
    rd = a.get_remote_descs([(0x1000, 4096, 0, "peer")], "VRAM")
    assert rd[0] == (0x1000, 4096, 0, "peer")
    with pytest.raises(nixl.nixlNotSupportedError, match="memory views"):
        a.prep_mem_view(rd)
    none = agents("nobackend", nixl_agent_config(backends=[]))
    with pytest.raises(nixl.nixlNotFoundError, match="no backend"):
        none.prep_xfer_dlist("NIXL_INIT_AGENT", [], "DRAM")


def test_each_backend_has_a_plugin_name_of_its_own(agents):
    """hixl's own plugin names come from the backend table: HIXL_<NAME> for every backend of
    this build forces it (a same-host one with self ahead of it), so a new backend needs no
    line in hixl.nixl."""
    a = agents("own", nixl_agent_config(backends=["HIXL_SHM"]))
    plugins = a.get_plugin_list()
    for b in hixl.backends():
        plugin = f"HIXL_{b['name'].upper()}"
        assert plugin in plugins, (plugin, plugins)
        want = f"self,{b['name']}" if b["reach"] == "host" else b["name"]
        assert a.get_plugin_params(plugin)["hixl.backends"] == want
    reach = {b["name"]: b["reach"] for b in hixl.backends()}
    assert (reach["self"], reach["shm"], reach["tcp"]) == ("process", "host", "network")
    assert nixl.NETWORK_BACKENDS["HIXL_SHM"] == "self,shm"  # as before the table made it
    assert nixl.NETWORK_BACKENDS["HIXL_TCP"] == "tcp"


def test_metadata_from_real_nixl_or_garbage_is_refused(agents):
    a = agents("reader")
    # What NIXL's own serializer writes begins with this tag.
    with pytest.raises(nixl.nixlInvalidParamError, match="real NIXL agent"):
        a.add_remote_agent(b"nixlSerDes|\x05\x00\x00\x00agentsome-binary-ucx-address")
    for junk in (b"", b"\x00" * 64, os.urandom(300), b"HIXLNIXL1\n{not json", b"HIXLNIXL1\n{}"):
        with pytest.raises(nixl.nixlInvalidParamError, match="metadata"):
            a.add_remote_agent(junk)
    with pytest.raises(nixl.nixlInvalidParamError, match="must be bytes"):
        a.add_remote_agent(12345)  # type: ignore[arg-type]
    # Metadata a real NIXL 1.5.1 agent (UCX backend, one DRAM region) wrote, kept verbatim.
    real = (HERE / "nixl-1.5.1-agent-metadata.bin").read_bytes()
    with pytest.raises(nixl.nixlInvalidParamError, match="real NIXL agent") as e:
        a.add_remote_agent(real)
    assert "[hixl PARAM_INVALID 103900]" in str(e.value)
    assert not a.check_remote_metadata("real-nixl-agent")


@pytest.mark.skipif(
    not os.environ.get("HIXL_TEST_NIXL_PYTHON"),
    reason="set HIXL_TEST_NIXL_PYTHON to an interpreter with the real NIXL installed",
)
def test_metadata_from_a_live_real_nixl_agent_is_refused(agents):
    prog = (
        "import sys\n"
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "a = nixl_agent('live-nixl', nixl_agent_config(backends=['UCX']))\n"
        "sys.stdout.write('MD ' + a.get_agent_metadata().hex() + '\\n')\n"
    )
    r = subprocess.run(
        [os.environ["HIXL_TEST_NIXL_PYTHON"], "-c", prog],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    md = bytes.fromhex(next(x for x in r.stdout.splitlines() if x.startswith("MD "))[3:])
    with pytest.raises(nixl.nixlInvalidParamError, match="real NIXL agent"):
        agents("reader").add_remote_agent(md)


def test_partial_metadata_and_refresh(agents):
    """Partial metadata without connection info is refused for an unknown agent and adds
    regions to a known one; a region registered after the metadata was taken is found through
    the live link."""
    a, b = agents("pa"), agents("pb")
    x, y = np.zeros(4096, np.uint8), seeded((4096,), 8)
    bx = b.register_memory(x)
    with pytest.raises(nixl.nixlNotFoundError, match="no connection info"):
        a.add_remote_agent(b.get_partial_agent_metadata(bx, False))
    assert a.add_remote_agent(b.get_partial_agent_metadata(bx, True)) == b"pb"
    b.register_memory(y)
    ydesc = a.get_xfer_descs([(y.ctypes.data, 4096, 0)], "DRAM")
    assert not a.check_remote_metadata("pb", ydesc)
    a.make_connection("pb")
    mine = np.zeros(4096, np.uint8)
    a.register_memory(mine)
    h = a.initialize_xfer("READ", a.get_xfer_descs(mine), ydesc, "pb")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert np.array_equal(mine, y)


# --- descriptor lists ----------------------------------------------------------------------------


def test_descriptor_lists_serialize_and_registration_counts(agents):
    a = agents("lists")
    arr = np.zeros((4, 1024), np.uint8)
    x = a.get_xfer_descs(_rows(arr), "DRAM")
    assert x.descCount() == 4 and x[1] == (arr.ctypes.data + 1024, 1024, 0)
    assert x == a.get_xfer_descs(np.array(_rows(arr), np.uint64), "DRAM")
    assert a.deserialize_descs(a.get_serialized_descs(x)) == x
    assert pickle.loads(pickle.dumps(x)) == x
    r = a.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, b"meta")], "DRAM")
    assert a.deserialize_descs(a.get_serialized_descs(r)) == r
    assert pickle.loads(pickle.dumps(r))[0][3] == b"meta"
    for junk in (b"", b"garbage", pickle.dumps(x), a.get_serialized_descs(x)[:-1]):
        with pytest.raises(nixl.nixlInvalidParamError, match="serialized (descriptors|by hixl)"):
            a.deserialize_descs(junk)
    with pytest.raises(nixl.nixlInvalidParamError, match="XferDList given"):
        a.register_memory(x)
    # An array is its own buffer; registering it again, or a part of it, is counted.
    one = a.get_reg_descs(arr)
    assert one[0][:2] == (arr.ctypes.data, arr.nbytes)
    a.register_memory(arr)
    a.register_memory(arr)
    part = a.register_memory([(arr.ctypes.data + 1024, 1024, 0, "")], "DRAM")
    a.deregister_memory(one)
    a.deregister_memory(part)
    a.prep_xfer_dlist("NIXL_INIT_AGENT", x)  # still registered once
    a.deregister_memory(one)
    with pytest.raises(nixl.nixlNotFoundError):
        a.prep_xfer_dlist("NIXL_INIT_AGENT", x)
    with pytest.raises(nixl.nixlNotFoundError):
        a.deregister_memory(one)


def test_check_remote_xfer_done_semantics(agents):
    a, b = agents("ca"), agents("cb")
    b.add_remote_agent(a.get_agent_metadata())
    for m in (b"abc-1", b"xyz-abc", b"abc-2"):
        b.send_notif("ca", m)
    until(lambda: len(a.update_notifs().get("cb", [])) == 3, "three notifications")
    assert not a.check_remote_xfer_done("cb", b"zzz")
    assert a.check_remote_xfer_done("cb", b"abc")  # prefix: the first match only
    assert a.notifs["cb"] == [b"xyz-abc", b"abc-2"]
    assert a.check_remote_xfer_done(b"cb", b"z-ab", tag_is_prefix=False)
    assert a.check_remote_xfer_done("cb", b"")
    assert a.notifs["cb"] == []
    assert not a.check_remote_xfer_done("nobody", b"")
    b.send_notif("ca", "text works too")
    assert until(lambda: a.get_new_notifs(), "a new notification") == {"cb": [b"text works too"]}
    assert a.notifs["cb"] == []  # get_new_notifs does not keep what it returns


# --- the `import nixl` shim ----------------------------------------------------------------------

SHIM_PROG = """
import sys, time
import numpy as np
import nixl
from nixl._api import nixl_agent, nixl_agent_config
from nixl._bindings import nixlNotFoundError
print("HIXL" if getattr(nixl, "__hixl__", False) else "OTHER", flush=True)
a = nixl_agent("s1", nixl_agent_config(backends=["UCX"]))
b = nixl_agent("s2", nixl_agent_config(backends=["UCX"]))
x = np.arange(4096, dtype=np.uint8); y = np.zeros(4096, np.uint8)
a.register_memory(x); b.register_memory(y)
n = b.add_remote_agent(a.get_agent_metadata())
h = b.initialize_xfer("READ", b.get_xfer_descs(y), a.get_xfer_descs(x), n, b"hi")
b.transfer(h)
t = time.monotonic() + 20
while b.check_xfer_state(h) == "PROC" and time.monotonic() < t:
    time.sleep(0.001)
assert b.check_xfer_state(h) == "DONE" and (x == y).all()
try:
    b.prep_xfer_dlist("nobody", [], "DRAM")
except nixlNotFoundError as e:
    print("ERR", type(e).__module__, flush=True)
print("BYTES OK", flush=True)
"""


def _shim_run(
    tmp_path: Path, extra_path: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    shim = subprocess.run(
        [sys.executable, "-m", "hixl.nixl.shim"], capture_output=True, text=True, timeout=60
    )
    assert shim.returncode == 0, shim.stderr
    path = os.pathsep.join([shim.stdout.strip(), *extra_path])
    prog = tmp_path / "prog.py"
    prog.write_text(SHIM_PROG)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HIXL_NIXL_SHIM")}
    return subprocess.run(
        [sys.executable, str(prog)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": path, **env},
    )


def _fake_real_nixl(tmp_path: Path) -> str:
    """A stand-in for an installed NIXL: a `nixl` package that says who it is."""
    root = tmp_path / "site"
    (root / "nixl").mkdir(parents=True)
    (root / "nixl" / "__init__.py").write_text("REAL = True\nprint('REAL NIXL', flush=True)\n")
    (root / "nixl" / "_api.py").write_text("raise SystemExit(7)\n")
    return str(root)


def test_shim_runs_unchanged_nixl_programs(tmp_path):
    r = _shim_run(tmp_path, [], {})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split("\n")[:3] == ["HIXL", "ERR hixl.nixl._bindings", "BYTES OK"]


def test_shim_steps_aside_for_the_real_nixl(tmp_path):
    real = _fake_real_nixl(tmp_path)
    r = _shim_run(tmp_path, [real], {})
    assert r.returncode == 7 and r.stdout.startswith("REAL NIXL"), r.stdout + r.stderr
    forced = _shim_run(tmp_path, [real], {"HIXL_NIXL_SHIM": "1"})
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert forced.stdout.startswith("HIXL\n")
    off = _shim_run(tmp_path, [], {"HIXL_NIXL_SHIM": "0"})
    assert off.returncode != 0 and "No module named 'nixl'" in off.stderr
    off_real = _shim_run(tmp_path, [real], {"HIXL_NIXL_SHIM": "0"})
    assert off_real.returncode == 7 and off_real.stdout.startswith("REAL NIXL")


def test_without_the_shim_import_nixl_is_not_hixl(tmp_path):
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [sys.executable, "-c", "import nixl; print(getattr(nixl, '__hixl__', False))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**clean, "HIXL_NIXL_SHIM": "1"},
    )
    assert "True" not in r.stdout, "hixl's nixl took effect without the shim on the path"


def test_a_dead_remote_agent_is_reported_within_a_second(procs, agents):
    """An agent whose process died is reported dead (nixlRemoteDisconnectError, or the
    transfer ends ERR) within a second, not after _CONNECT_WAIT_S (10 s), as NIXL does."""
    size = 1 << 20
    peer = procs(HERE / "_nixl_peer.py", "victim", size, "HIXL_TCP")
    tag, md_hex = peer.line().split()
    md = bytes.fromhex(md_hex)
    me = agents("survivor", nixl_agent_config(backends=["HIXL_TCP"]))
    src = seeded((size,), 6)
    me.register_memory(src)
    name = me.add_remote_agent(md)
    remote_addr = json.loads(md[len(b"HIXLNIXL1\n") :])["regions"][0][0]
    remote = me.get_xfer_descs([(remote_addr, size, 0)], "DRAM")
    h = me.initialize_xfer("WRITE", me.get_xfer_descs(src), remote, name, b"w")
    me.transfer(h)
    assert wait_done(me, h) == "DONE"
    peer.p.kill()
    peer.p.wait()
    took = []
    for _ in range(3):
        t0 = time.monotonic()
        try:
            h = me.initialize_xfer("WRITE", me.get_xfer_descs(src), remote, name, b"x")
            state = me.transfer(h)
            if state != "ERR":
                state = wait_done(me, h)
            assert state == "ERR", state
        except nixl.nixlRemoteDisconnectError:
            pass
        took.append(time.monotonic() - t0)
    print(f"nixl: dead remote agent reported after {', '.join(f'{t:.3f}' for t in took)} s")
    assert max(took) < 1.0, took
