"""Named regions, region-table deltas, memory domains and backend capabilities (wire v4),
between real processes over real sockets: target engines (tests/_peer.py), a hostile target
that speaks the wire protocol itself (tests/_sec_hostile.py, mode regions) and counting
relays (tests/_count_relay.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import _wire as w
import numpy as np
import pytest
from conftest import Peer, random_bytes
from test_security import Hostile, Proc

import hixl

HERE = Path(__file__).parent
W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
DATA_FRAMES = {w.WRITE, w.READ, w.WRITE_STRIDED, w.READ_STRIDED}


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: object, ready: str = "READY") -> Proc:
        p = Proc(list(args), ready)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.close()


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.0005)


def saved(peer: Peer, name: str, tmp: Path) -> np.ndarray:
    """The bytes of the peer's region `name`, fetched out of band (not through hixl)."""
    path = tmp / f"{name}.bin"
    assert peer.cmd("save_named", name, path) == "OK"
    return np.fromfile(path, np.uint8)


def regions_of(e: hixl.Hixl, remote: str) -> list[tuple[str, int, int, bool, hixl.MemType]]:
    rs = e.remote_regions(remote)
    return sorted((r.name, r.addr, r.len, r.writable, r.mem_type) for r in rs)


def test_named_regions_are_seen_and_found_by_name(engine, make_peer, tmp_path):
    H = hixl.MemType.HOST
    peer = make_peer(4096)
    alpha = int(peer.cmd("register_named", "alpha", 8192))
    beta = int(peer.cmd("register_named", "beta", 3000))
    engine.connect(peer.engine, timeout_ms=5000)
    assert regions_of(engine, peer.engine) == sorted(
        [
            ("", peer.addr, 4096, True, H),
            ("alpha", alpha, 8192, True, H),
            ("beta", beta, 3000, True, H),
        ]
    )
    assert sorted((m.addr, m.len) for m in engine.remote_mems(peer.engine)) == sorted(
        [(peer.addr, 4096), (alpha, 8192), (beta, 3000)]
    )

    # Found by name, written through the address found, read back out of band.
    r = engine.remote_region(peer.engine, "alpha")
    assert (r.name, r.addr, r.len, r.length, r.writable) == ("alpha", alpha, 8192, 8192, True)
    src = random_bytes(8000, 1)
    engine.register(src)
    engine.transfer_sync(peer.engine, W, [(src.ctypes.data, r.addr + 100, src.nbytes)], 5000)
    got = saved(peer, "alpha", tmp_path)
    assert np.array_equal(got[100:8100], src)
    assert not got[:100].any() and not got[8100:].any(), "bytes outside the write changed"
    assert not saved(peer, "beta", tmp_path).any() and not peer.read().any()

    # Registered by the peer after the connect: found at once (asked of the peer on a miss).
    gamma = int(peer.cmd("register_named", "gamma", 5000))
    g = engine.remote_region(peer.engine, "gamma")
    assert (g.name, g.addr, g.len) == ("gamma", gamma, 5000)
    src2 = random_bytes(5000, 2)
    engine.register(src2)
    engine.put(peer.engine, src2.ctypes.data, g.addr, 5000, timeout_ms=5000)
    assert np.array_equal(saved(peer, "gamma", tmp_path), src2)
    back = np.zeros(5000, np.uint8)
    engine.register(back)
    engine.get(peer.engine, back.ctypes.data, g.addr, 5000, timeout_ms=5000)
    assert np.array_equal(back, src2)

    with pytest.raises(hixl.ParamInvalid) as e:
        engine.remote_region(peer.engine, "no-such-region")
    assert "no-such-region" in str(e.value), e.value

    # A name the peer deregistered leaves the peer's table here, and is free there again.
    assert peer.cmd("deregister_named", "beta") == "OK"
    wait_for(
        lambda: "beta" not in {x.name for x in engine.remote_regions(peer.engine)}, "beta gone"
    )
    with pytest.raises(hixl.ParamInvalid, match="beta"):
        engine.remote_region(peer.engine, "beta")
    beta2 = int(peer.cmd("register_named", "beta", 2000))
    assert engine.remote_region(peer.engine, "beta").addr == beta2


def test_remote_region_asks_the_peer_once_on_a_miss(engine, procs):
    """Deterministically: the hostile target adds a region to its table without telling
    anyone (no delta), so only the question that remote_region asks on a miss can find it.
    Exactly one RegionsQuery per miss, none for a name already known."""
    h = Hostile(procs, "regions")
    engine.connect(h.engine, timeout_ms=5000)

    def queries() -> int:
        return json.loads(h.proc.cmd("frames")).count(w.REGIONS_QUERY)

    assert [r.name for r in engine.remote_regions(h.engine)] == ["host", "dev", "gpu"]
    assert engine.remote_region(h.engine, "host").addr == h.buf
    assert queries() == 0, "a name in the local copy needs no question"
    assert h.proc.cmd("add_region", "late") == "OK"
    assert "late" not in {r.name for r in engine.remote_regions(h.engine)}
    late = engine.remote_region(h.engine, "late")
    assert (late.addr, late.len, late.mem_type) == (
        h.buf + h.len // 2,
        h.len // 4,
        hixl.MemType.HOST,
    )
    assert queries() == 1
    assert "late" in {r.name for r in engine.remote_regions(h.engine)}, "the answer is kept"
    with pytest.raises(hixl.ParamInvalid, match="missing"):
        engine.remote_region(h.engine, "missing")
    assert queries() == 2, "one question per miss"


def test_region_names_are_unique():
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")
        a, b, c = (np.zeros(4096, np.uint8) for _ in range(3))
        h = e.register(a, name="kv")
        assert (h.name, h.addr, h.len) == ("kv", a.ctypes.data, 4096)
        assert e.register(c).name == "", "unnamed"
        for taken in [
            lambda: e.register(b, name="kv"),
            lambda: e.register_mem(hixl.MemDesc(b.ctypes.data, b.nbytes), name="kv"),
            lambda: e.alloc(4096, name="kv"),
        ]:
            with pytest.raises(hixl.ParamInvalid, match='"kv"'):
                taken()
        # The same range again with the same name: the same handle.
        again = e.register(a, name="kv")
        assert (again.id, again.addr, again.len, again.name) == (h.id, h.addr, h.len, "kv")
        with pytest.raises(hixl.ParamInvalid, match='"kv"'):
            e.register(a, name="other")  # the same range under another name
        # Free again once deregistered.
        e.deregister_mem(h)
        hb = e.register(b, name="kv")
        assert (hb.name, hb.addr) == ("kv", b.ctypes.data) and hb.id != h.id
        # At most 255 bytes (bytes, not characters).
        assert e.register(np.zeros(8, np.uint8), name="x" * 255).name == "x" * 255
        for long in ["y" * 256, "é" * 128]:
            with pytest.raises(hixl.ParamInvalid, match="256 bytes"):
                e.register(np.zeros(8, np.uint8), name=long)
        m = e.alloc(4096, name="shared")
        assert e.register(m, name="shared").name == "shared", "alloc's handle, by its name"


def frames_between(before: dict, after: dict) -> dict[int, int]:
    """Frames per kind a relay carried to its initiator between two of its counts."""
    out = {}
    for k, (frames, _) in after["kinds"].items():
        d = frames - before["kinds"].get(k, [0, 0])[0]
        if d:
            out[int(k)] = d
    return out


def test_table_update_bytes_stay_constant(procs):
    """Four initiators, each through its own counting relay, while the target registers
    10,000 regions one by one: each registration costs every peer the same few bytes (a
    RegionsDelta), whether 0 or 9,000 regions are registered already. The windows 1-1000 and
    9001-10000 wait for each registration to reach all four initiators, so each sends one
    delta per peer; 1001-9000 go as fast as the target can register (deltas may merge)."""
    n, window = 10_000, 1000
    quiet = {"hixl.heartbeat_ms": "0"}
    t = hixl.Hixl()
    t.initialize("127.0.0.1:0", quiet)
    initiators: list[hixl.Hixl] = []
    try:
        relay = procs(HERE / "_count_relay.py", t.local_engine, 5)
        addrs = relay.words[1:]
        for a in addrs[:4]:
            e = hixl.Hixl()
            initiators.append(e)
            e.initialize("127.0.0.1", quiet)
            e.connect(a, timeout_ms=5000)
            assert e.stats()[a]["backend"] == "tcp", "the relay defeats the same-host proof"
        links = list(zip(initiators, addrs, strict=False))

        def counts() -> list[dict]:
            return json.loads(relay.cmd("counts"))

        block = hixl.aligned_empty(n * 4096)
        handles: list[hixl.MemHandle] = []

        def everyone_has(k: int) -> bool:
            return all(len(e.remote_mems(a)) == k for e, a in links)

        def register(upto: int, wait_each: bool) -> None:
            while len(handles) < upto:
                i = len(handles)
                handles.append(t.register(block[i * 4096 : (i + 1) * 4096], name=f"r{i:05d}"))
                if wait_each:
                    wait_for(lambda i=i: everyone_has(i + 1), f"region {i + 1} everywhere")
            wait_for(lambda: everyone_has(upto), f"{upto} regions everywhere")

        per_reg = []  # per window: bytes per registration, per relay
        for upto, wait_each in [(window, True), (n - window, False), (n, True)]:
            first = len(handles)
            before = counts()
            register(upto, wait_each)
            after = counts()
            regs = upto - first
            per_reg.append(
                [(b["bytes"] - a["bytes"]) / regs for a, b in zip(before, after, strict=True)][:4]
            )
            sent = [frames_between(a, b) for a, b in zip(before[:4], after[:4], strict=True)]
            print(f"frames to each peer (kind: count), registrations {first + 1}-{upto}: {sent}")
            if wait_each:  # exactly one delta per registration per peer, nothing else
                assert all(s == {w.REGIONS_DELTA: regs} for s in sent), sent
            else:  # as fast as it goes: deltas, or a whole table for a peer far behind
                assert all(set(s) <= {w.REGIONS_DELTA, w.REGIONS_UPDATE} for s in sent), sent

        # A fifth initiator connects now: its Welcome carries the whole table.
        with hixl.Hixl() as late:
            late.initialize("127.0.0.1", quiet)
            late.connect(addrs[4], timeout_ms=10_000)
            frames, nbytes = counts()[4]["kinds"][str(w.WELCOME)]
            full = nbytes / frames
            assert len(late.remote_mems(addrs[4])) == n

        early, middle, last = per_reg
        print(f"bytes per registration per peer, registrations 1-{window}: {early}")
        print(f"bytes per registration per peer, registrations {window + 1}-{n - window}: {middle}")
        print(f"bytes per registration per peer, registrations {n - window + 1}-{n}: {last}")
        print(f"a whole table of {n} regions (one Welcome): {full:.0f} bytes")
        for first_k, last_k in zip(early, last, strict=True):
            assert last_k <= 1.5 * first_k, f"{last_k} bytes per registration late, {first_k} early"
            assert max(first_k, last_k) < 200, (first_k, last_k)
            assert full > 100 * last_k, "the bytes test could not tell a delta from a table"
        # The tables are right, not just the right size.
        want = sorted((f"r{i:05d}", h.addr, h.len) for i, h in enumerate(handles))
        for e, a in links:
            assert sorted((r.name, r.addr, r.len) for r in e.remote_regions(a)) == want
    finally:
        for e in initiators:
            e.finalize()
        t.finalize()


def test_device_domain_is_unsupported(engine, procs, tmp_path):
    buf = np.zeros(4096, np.uint8)
    for register in [
        lambda: engine.register(buf, mem_type=hixl.MemType.DEVICE),
        lambda: engine.register_mem(hixl.MemDesc(buf.ctypes.data, 4096), hixl.MemType.DEVICE),
    ]:
        # Host memory is not device memory: without CUDA the driver cannot even be asked.
        cuda = hixl._hixl.cuda_info()["available"]
        with pytest.raises(hixl.ParamInvalid if cuda else hixl.Unsupported) as e:
            register()
        assert ("not memory CUDA knows" if cuda else "CUDA was not found") in str(e.value), e.value
    assert engine.register(buf).mem_type == hixl.MemType.HOST, "nothing was left registered"

    # A target that advertises a region in the device domain: seen, never written or read.
    h = Hostile(procs, "regions")
    engine.connect(h.engine, timeout_ms=5000)
    dev = engine.remote_region(h.engine, "dev")
    assert (dev.addr, dev.mem_type, dev.writable) == (h.buf + h.len // 4, hixl.MemType.DEVICE, True)
    assert engine.remote_region(h.engine, "host").mem_type == hixl.MemType.HOST
    assert (dev.domain, engine.remote_region(h.engine, "host").domain) == ("device", "host")
    # cuda:3 travels in the table as domain byte 0x83. (Host memory to a peer's cuda:N region
    # is served over tcp: the target stages it; test_cuda_staging.py and the Rust test
    # engine::stage_tests cover that, so nothing is sent to this fake target's.)
    gpu = engine.remote_region(h.engine, "gpu")
    assert (gpu.mem_type, gpu.domain) == (hixl.MemType.DEVICE, "cuda:3")
    src = hixl.aligned_empty(4096)  # 64-byte aligned, as strided descriptors require
    src[:] = random_bytes(4096, 5)
    engine.register(src)
    dev64 = (dev.addr + 63) & ~63  # strided bases are 64-byte aligned
    attempts = {
        "write": lambda: engine.transfer_sync(h.engine, W, [(src.ctypes.data, dev.addr, 4096)]),
        "read": lambda: engine.transfer_sync(h.engine, R, [(buf.ctypes.data, dev.addr, 4096)]),
        "put": lambda: engine.put(h.engine, src.ctypes.data, dev.addr + 64, 64),
        "strided": lambda: engine.put_strided(
            h.engine, src.ctypes.data, dev64, hixl.StridedDesc(4, 64, 128)
        ),
        "async": lambda: engine.transfer_async(
            h.engine, W, [(src.ctypes.data, dev.addr, 4096)]
        ).wait(5000),
    }
    for what, attempt in attempts.items():
        with pytest.raises(hixl.Unsupported) as e:
            attempt()
        msg = str(e.value)
        assert "host" in msg and "device" in msg, f"{what}: {msg}"
    frames = json.loads(h.proc.cmd("frames"))
    assert not DATA_FRAMES & set(frames), f"data frames reached the target: {frames}"
    assert not any(h.dump(tmp_path)), "the target's memory changed"
    assert not buf.any(), "the read changed local memory"

    # The same link writes to the host-domain region (so the check above can see a Write).
    host = engine.remote_region(h.engine, "host")
    engine.put(h.engine, src.ctypes.data, host.addr, 4096, timeout_ms=5000)
    assert json.loads(h.proc.cmd("frames")).count(w.WRITE) == 1
    mem = h.dump(tmp_path)
    assert mem[:4096] == src.tobytes() and not any(mem[4096:])


def test_target_backends_limit_the_offer(make_peer):
    """The target lists its backends in Welcome; one with hixl.backends=tcp offers only tcp,
    so a same-host initiator that would take self or shm first ends up on tcp. (A default
    target and initiator on one host pick shm: test_same_host.py's
    test_auto_picks_shm_on_this_host.)"""
    size = 1 << 20
    tcp_only = make_peer(size, {"hixl.backends": "tcp"})
    default = make_peer(4096)
    offered = {}
    for p in (tcp_only, default):
        host, port = p.engine.rsplit(":", 1)
        st, welcome = w.connect((host, int(port)))
        st.close()
        offered[p.engine] = [c.backend for c in welcome["capabilities"]]
    assert offered[tcp_only.engine] == ["tcp"]
    # cuda_ipc is offered only where CUDA is found.
    cuda = ["cuda_ipc"] if hixl._hixl.cuda_info()["available"] else []
    assert offered[default.engine] == ["self", *cuda, "shm", "tcp"]

    with hixl.Hixl() as e:
        e.initialize("127.0.0.1")  # hixl.backends defaults to self,cuda_ipc,shm,rdma,tcp
        e.connect(tcp_only.engine, timeout_ms=5000)
        assert e.stats()[tcp_only.engine]["backend"] == "tcp"
        src = random_bytes(size, 9)
        e.register(src)
        e.transfer_sync(tcp_only.engine, W, [(src.ctypes.data, tcp_only.addr, size)], 10_000)
        assert np.array_equal(tcp_only.read(), src)
        back = np.zeros(size, np.uint8)
        e.register(back)
        e.transfer_sync(tcp_only.engine, R, [(back.ctypes.data, tcp_only.addr, size)], 10_000)
        assert np.array_equal(back, src)
        assert e.stats()[tcp_only.engine]["bytes_write"] == size


def test_remote_regions_refresh_sees_a_region_registered_a_moment_ago(make_peer) -> None:
    """The peer's update may not have arrived yet; refresh=True asks it for its table, so a
    region registered before the call is always in the answer (20 times in a row)."""
    peer = make_peer(4096)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        e.connect(peer.engine, timeout_ms=5000)
        for i in range(20):
            addr = int(peer.cmd("register_named", f"r{i}", 4096))
            fresh = {r.addr for r in e.remote_regions(peer.engine, refresh=True)}
            assert addr in fresh, i
    finally:
        e.finalize()
