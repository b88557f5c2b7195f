"""Named regions, memory domains and region-table deltas, between real engines over real sockets."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from conftest import random_bytes

import hixl

W = hixl.TransferOp.WRITE


class CountingRelay:
    """Forwards every connection to a target, byte for byte, and counts the bytes that flow
    from the target to the initiators (region tables, deltas, answers)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.down = 0
        self.lock = threading.Lock()
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            t = socket.create_connection(self.target)
            for s in (a, t):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(a, t, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(t, a, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while b := src.recv(1 << 16):
                if count:
                    with self.lock:
                        self.down += len(b)
                dst.sendall(b)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def count(self) -> int:
        with self.lock:
            return self.down

    def close(self) -> None:
        self.lsock.close()


def wait_until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_table_update_bytes_stay_constant() -> None:
    """Four peers are connected while the target registers 10,000 regions one by one: the
    region-table updates are deltas, so the bytes each registration costs on the wire do not
    grow with the number of regions already registered (whole tables would cost ~9,000
    entries each by the end). Counted by relays between the engines, outside hixl."""
    n, window = 10_000, 1000
    quiet = {"hixl.heartbeat_ms": "0"}
    t = hixl.Hixl()
    t.initialize("127.0.0.1:0", quiet)
    relays = [CountingRelay(t.local_engine) for _ in range(4)]
    peers = []
    try:
        for r in relays:
            e = hixl.Hixl()
            e.initialize("127.0.0.1", {**quiet, "hixl.backends": "tcp"})
            e.connect(r.addr, timeout_ms=5000)
            peers.append((e, r))
        block = hixl.aligned_empty(n * 64)
        handles = []

        def register(upto: int) -> None:
            while len(handles) < upto:
                i = len(handles)
                handles.append(t.register(block[i * 64 : (i + 1) * 64], name=f"r{i}"))
            last = f"r{upto - 1}"
            for e, r in peers:  # every peer has the table, so the window's bytes are all through
                wait_until(lambda e=e, r=r: len(e.remote_mems(r.addr)) == upto, f"{upto} regions")
            assert all(e.remote_regions(r.addr)[-1].name == last for e, r in peers)

        before = [r.count() for r in relays]
        register(window)
        early = [r.count() - b for r, b in zip(relays, before, strict=True)]
        register(n - window)
        before = [r.count() for r in relays]
        register(n)
        late = [r.count() - b for r, b in zip(relays, before, strict=True)]
        per_early = [b / window for b in early]
        per_late = [b / window for b in late]
        print(f"bytes per registration per peer, regions 1-{window}: {per_early}")
        print(f"bytes per registration per peer, regions {n - window + 1}-{n}: {per_late}")
        for pe, pl in zip(per_early, per_late, strict=True):
            # Deltas may carry one registration or several (the publisher sends what changed
            # since the last one it sent): between ~30 and ~90 bytes a registration either way.
            assert pl <= 2 * pe + 32, (pe, pl)
            assert pl < 200, f"{pl} bytes per registration: whole tables, not deltas"
        # The peers' tables are right, not just the right size: names and addresses.
        e, r = peers[0]
        got = {x.name: x.addr for x in e.remote_regions(r.addr)}
        assert got == {f"r{i}": h.addr for i, h in enumerate(handles)}
    finally:
        for e, _ in peers:
            e.finalize()
        t.finalize()
        for r in relays:
            r.close()


def test_named_regions_are_seen_and_found_by_name(engine, make_peer) -> None:
    """The target names a region; the initiator finds it by name, also one registered after
    the connect (asked of the peer on a miss), and writes through it byte for byte."""
    t = hixl.Hixl()
    t.initialize("127.0.0.1:0")
    try:
        kv = np.zeros(1 << 16, np.uint8)
        t.register(kv, name="kv")
        engine.connect(t.local_engine, timeout_ms=5000)
        regions = engine.remote_regions(t.local_engine)
        assert [(x.name, x.addr, x.len, x.writable) for x in regions] == [
            ("kv", kv.ctypes.data, kv.nbytes, True)
        ]
        assert regions[0].mem_type == hixl.MemType.HOST
        src = random_bytes(1 << 16, 7)
        engine.register(src)
        found = engine.remote_region(t.local_engine, "kv")
        engine.transfer_sync(
            t.local_engine, W, [hixl.TransferOpDesc(src.ctypes.data, found.addr, src.nbytes)]
        )
        assert bytes(kv) == bytes(src)
        # Registered a moment ago, read-only: found at once all the same.
        late = np.arange(4096, dtype=np.uint8) % 251
        h = t.register(late, access="r", name="weights/0")
        assert h.name == "weights/0"
        got = engine.remote_region(t.local_engine, "weights/0")
        assert (got.addr, got.len, got.writable) == (late.ctypes.data, late.nbytes, False)
        dst = np.zeros(4096, np.uint8)
        engine.register(dst)
        engine.get(t.local_engine, dst.ctypes.data, got.addr, 4096)
        assert bytes(dst) == bytes(late)
        with pytest.raises(hixl.ParamInvalid, match="name=.nope."):
            engine.remote_region(t.local_engine, "nope")
        # A deregistered name is gone from the peer's view.
        t.deregister_mem(h)
        wait_until(lambda: len(engine.remote_regions(t.local_engine)) == 1, "the deregistration")
        with pytest.raises(hixl.ParamInvalid, match="weights/0"):
            engine.remote_region(t.local_engine, "weights/0")
    finally:
        t.finalize()


def test_region_names_are_unique(engine) -> None:
    a, b = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    h = engine.register(a, name="kv")
    with pytest.raises(hixl.ParamInvalid, match='name="kv" is already registered'):
        engine.register(b, name="kv")
    assert engine.register(a, name="kv").id == h.id, "the same range and name again"
    with pytest.raises(hixl.ParamInvalid, match="already registered as name"):
        engine.register(a, name="other")
    with pytest.raises(hixl.ParamInvalid, match="255 bytes"):
        engine.register(b, name="x" * 256)
    engine.deregister_mem(h)
    assert engine.register(b, name="kv").name == "kv", "a deregistered name is free again"
    shm = engine.alloc(4096, name="shared")
    assert shm.nbytes >= 4096


def test_device_domain_is_unsupported(engine) -> None:
    with pytest.raises(hixl.Unsupported, match="device") as e:
        engine.register_mem(hixl.MemDesc(1 << 40, 4096), hixl.MemType.DEVICE)
    assert "self, shm, tcp" in str(e.value), e.value


def test_target_backends_limit_the_offer(make_peer) -> None:
    """A target that offers only tcp gets tcp from a same-host initiator that would rather
    use shm (its default order is self, shm, tcp); the stats say why shm was not chosen."""
    peer = make_peer(1 << 16, {"hixl.backends": "tcp"})
    engine = hixl.Hixl()
    engine.initialize("127.0.0.1")
    engine.connect(peer.engine, timeout_ms=5000)
    st = engine.stats()[peer.engine]
    assert st["backend"] == "tcp", st
    assert "shm: the peer does not offer it" in st["not_chosen"], st
    src = random_bytes(1 << 16, 3)
    engine.register(src)
    engine.put(peer.engine, src.ctypes.data, peer.addr, src.nbytes, timeout_ms=5000)
    assert bytes(peer.read(0, src.nbytes)) == bytes(src)
    engine.finalize()
