"""hixl.mooncake in one process: Mooncake 0.3.13's return codes (observed against the real
package), the protocol hint and HIXL_MOONCAKE_STRICT, metadata servers, notifications,
managed buffers, the GIL, and a session that survives a failure and a peer's restart."""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time

import pytest

import hixl
from hixl import mooncake as mc
from hixl.mooncake import TransferEngine, TransferNotify, TransferOpcode

N = 1 << 20


def _buf(n: int = N, fill: bytes = b"") -> tuple[ctypes.Array[ctypes.c_char], int]:
    b = ctypes.create_string_buffer(fill * (n // len(fill)) if fill else b"", n)
    return b, ctypes.addressof(b)


@pytest.fixture
def pair():
    """Two engines (tcp) with 1 MiB registered each; yields (a, b, a_addr, b_addr, session)."""
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    ba, pa = _buf(fill=b"A")
    bb, pb = _buf()
    assert a.register_memory(pa, N) == 0 and b.register_memory(pb, N) == 0
    yield a, b, pa, pb, f"127.0.0.1:{b.get_rpc_port()}"
    a.close()
    b.close()
    del ba, bb


def test_return_codes_as_mooncake(pair):
    a, b, pa, pb, s = pair
    assert b.register_memory(pb, N) == mc.ERR_ADDRESS_OVERLAPPED == -7
    assert b.register_memory(pb + 10, 10) == -7
    assert b.register_memory(pb + N, 0) == -1
    assert a.transfer_sync_write(s, pa, pb, 4096) == 0
    assert ctypes.string_at(pb, 4) == b"AAAA"
    assert a.transfer_sync_write(s, pa, pb, 0) == 0
    assert a.batch_transfer_sync_write(s, [], [], []) == 0
    assert a.batch_transfer_sync_write(s, [pa], [pb, pb], [16]) == -1
    assert a.transfer_sync_write("127.0.0.1:bad", pa, pb, 16) == -1
    assert a.get_batch_transfer_status([]) == 0
    assert a.get_batch_transfer_status([12345]) == -1
    assert a.transfer_check_status(12345) == mc.CHECK_FAILED
    assert b.unregister_memory(pb + 1) == mc.ERR_ADDRESS_NOT_REGISTERED == -3
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1
    assert mc.Read is TransferOpcode.Read and mc.Write is TransferOpcode.Write
    assert a.transfer_sync_write(s, pa, pb, -1) == -1  # logged, naming length=-1
    with pytest.raises(TypeError, match="str"):
        a.transfer_sync_write(s, pa, pb, "16")
    with pytest.raises(TypeError, match="opcode"):
        a.batch_transfer_sync(s, [pa], [pb], [16], 7)


def test_out_of_bounds_then_the_session_still_works(pair):
    a, b, pa, pb, s = pair
    assert a.transfer_sync_write(s, pa, pb + N - 10, 4096) == -1
    assert a.transfer_sync_read(s, pa, pb + N, 1) == -1
    bid = a.batch_transfer_async_write(s, [pa], [pb + N - 1], [4096])
    assert bid > 0 and a.get_batch_transfer_status([bid]) == -1
    assert a.transfer_sync_write(s, pa, pb, 4096) == 0
    assert a.batch_transfer_sync_read(s, [pa + 8192], [pb], [16]) == 0


def test_async_ids_and_status_values(pair):
    a, b, pa, pb, s = pair
    ids = [
        a.batch_transfer_async_write(s, [pa + i * 4096], [pb + i * 4096], [4096]) for i in range(4)
    ]
    assert len(set(ids)) == 4 and all(i > 0 for i in ids)
    assert a.get_batch_transfer_status(ids) == 0
    assert a.get_batch_transfer_status(ids[:1]) == -1  # forgotten once waited for
    rid = a.batch_transfer_async(s, [pa], [pb], [16], TransferOpcode.Read)
    assert a.get_batch_transfer_status([rid]) == 0
    empty = a.batch_transfer_async_write(s, [], [], [])
    assert empty > 0 and a.transfer_check_status(empty) == mc.CHECK_COMPLETED
    assert a.batch_transfer_async_write(s, [pa], [pb, pb], [1]) == 0  # as Mooncake: no batch
    sid = a.transfer_submit_write(s, pa, pb, N)
    seen, deadline = [], time.monotonic() + 10
    while (state := a.transfer_check_status(sid)) == mc.CHECK_PENDING:
        seen.append(state)
        assert time.monotonic() < deadline
    assert state == mc.CHECK_COMPLETED == 1
    assert a.transfer_check_status(sid) == -1  # forgotten once it ended


def test_unreachable_session(monkeypatch, pair):
    monkeypatch.setenv("HIXL_MOONCAKE_CONNECT_TIMEOUT_S", "0.3")
    a, _b, pa, _pb, _s = pair
    t0 = time.monotonic()
    assert a.send_probe("127.0.0.1:1") == mc.ERR_PROBE_FAILED == -102
    assert time.monotonic() - t0 < 5
    assert a.batch_transfer_async_write("127.0.0.1:1", [pa], [pa], [16]) == 0
    assert a.transfer_submit_write("127.0.0.1:1", pa, pa, 16) == 0
    assert a.get_first_buffer_address("127.0.0.1:1") == 0
    assert a.transfer_sync_read("127.0.0.1:1", pa, pa, 0) == -1


def test_notifications_probe_and_first_buffer(pair):
    a, b, pa, pb, s = pair
    assert a.send_probe(s) == 0
    assert a.get_first_buffer_address(s) == pb and b.get_first_buffer_address(s) == pb
    assert b.get_notifies() == []
    assert a.transfer_sync(s, pa, pb, 16, TransferOpcode.Write, TransferNotify("nm", "hello")) == 0
    assert (
        a.batch_transfer_sync(s, [pa], [pb], [16], TransferOpcode.Read, TransferNotify("x", "y"))
        == 0
    )
    deadline, got = time.monotonic() + 5, []
    while len(got) < 2 and time.monotonic() < deadline:
        got += b.get_notifies()
        time.sleep(0.01)
    assert [(n.name, n.msg) for n in got] == [("nm", "hello"), ("x", "y")]
    assert got[0].peer == a.engine.local_engine  # hixl's addition: the authenticated sender
    assert b.get_notifies() == []


def test_managed_buffers_and_bytes(pair):
    a, b, pa, pb, s = pair
    m = a.allocate_managed_buffer(4096)
    assert m > 0
    assert a.write_bytes_to_buffer(m, b"hello", 5) == 0
    assert a.read_bytes_from_buffer(m, 5) == b"hello"
    assert a.transfer_sync_write(s, m, pb, 5) == 0 and ctypes.string_at(pb, 5) == b"hello"
    assert a.write_bytes_to_buffer(m + 4090, b"toolong", 7) == -1
    with pytest.raises(ValueError, match="not registered"):
        a.read_bytes_from_buffer(12345, 4)
    assert a.free_managed_buffer(m, 4000) == -1  # not its length
    assert a.free_managed_buffer(m, 4096) == 0
    assert a.free_managed_buffer(m, 4096) == -1


def test_batch_register_and_unregister():
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf, p = _buf(4 * 4096)
    assert te.batch_register_memory([p, p + 8192], [4096, 4096]) == 0
    assert te.batch_register_memory([p + 4096, p + 8192], [4096, 4096]) == -7
    assert te.register_memory(p + 4096, 4096) == 0  # the failed batch left nothing behind
    assert te.batch_unregister_memory([p, p + 4096, p + 8192]) == 0
    assert te.batch_register_memory([p], [1, 2]) == -1
    te.close()
    del buf


def test_topology_and_uninitialized_calls():
    te = TransferEngine()
    assert te.get_rpc_port() == 0
    assert te.register_memory(1 << 20, 4096) == -1
    assert te.transfer_sync_write("127.0.0.1:1", 1, 1, 1) == -1
    assert te.get_notifies() == []
    topo = json.loads(te.get_local_topology())
    assert list(topo) == ["cpu:0"] and len(topo["cpu:0"]) == 2


def test_protocol_hint_warns_once_and_strict_fails(monkeypatch, caplog):
    monkeypatch.delenv("HIXL_MOONCAKE_STRICT", raising=False)
    monkeypatch.delenv("HIXL_MOONCAKE_BACKENDS", raising=False)
    from hixl.mooncake import _protocol

    rdma = _protocol._rdma_usable()
    with caplog.at_level(logging.WARNING, logger="hixl.mooncake"):
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    if not rdma:
        assert len(warnings) == 1 and "'rdma'" in warnings[0].getMessage()
        assert "auto" in warnings[0].getMessage()
    te.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hixl.mooncake"):
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    te.close()
    monkeypatch.setenv("HIXL_MOONCAKE_STRICT", "1")
    if not rdma:
        assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -6
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "bogus", "") == -6
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    te.close()
    # hixl's own backend names are protocols too, in strict mode as well (from the table).
    for b in hixl.backends():
        if b["name"] != "rdma":  # Mooncake's "rdma" stays a hint that needs a device
            assert _protocol.backends_for(b["name"].upper()) == (b["name"], ""), b
    monkeypatch.setenv("HIXL_MOONCAKE_BACKENDS", "shm")
    monkeypatch.delenv("HIXL_MOONCAKE_STRICT")
    assert _protocol.backends_for("rdma") == ("shm", "")


def test_metadata_server_etcd_means_direct_addresses():
    from test_llm_datadist import free_ports

    port = free_ports(1)[0]
    b = TransferEngine()
    assert b.initialize(f"127.0.0.1:{port}", "etcd://127.0.0.1:2379", "tcp", "") == 0
    assert b.get_rpc_port() == port
    buf, pb = _buf(4096)
    assert b.register_memory(pb, 4096) == 0
    a = TransferEngine()
    assert a.initialize_ext("127.0.0.1", "http://127.0.0.1:8080/metadata", "tcp", "", "http") == 0
    src, pa = _buf(4096, b"Z")
    assert a.register_memory(pa, 4096) == 0
    assert a.transfer_sync_write(f"127.0.0.1:{port}", pa, pb, 4096) == 0
    assert ctypes.string_at(pb, 4) == b"ZZZZ"
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0  # again: ignored
    assert TransferEngine().initialize("no:such:host:x", "P2PHANDSHAKE", "tcp", "") == -1
    a.close()
    b.close()
    del buf, src


def test_peer_restart_the_session_reconnects():
    from test_llm_datadist import free_ports

    port = free_ports(1)[0]
    s = f"127.0.0.1:{port}"
    a = TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src, pa = _buf(4096, b"Q")
    assert a.register_memory(pa, 4096) == 0
    for _ in range(2):
        b = TransferEngine()
        assert b.initialize(s, "etcd://unused", "tcp", "") == 0
        dst, pb = _buf(4096)
        assert b.register_memory(pb, 4096) == 0
        deadline = time.monotonic() + 10
        while a.transfer_sync_write(s, pa, pb, 4096) != 0:
            assert time.monotonic() < deadline, "the session did not come back"
            time.sleep(0.05)
        assert ctypes.string_at(pb, 4) == b"QQQQ"
        b.close()
        del dst
    a.close()


def test_blocking_calls_release_the_gil(pair):
    a, b, pa, pb, s = pair
    big = 256 << 20
    buf, p = _buf(big)
    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=count, daemon=True)
    t.start()
    try:
        for call in (
            lambda: b.register_memory(p, big),
            lambda: a.batch_transfer_sync_write(s, [pa] * 64, [pb] * 64, [N] * 64),
            lambda: b.unregister_memory(p),
        ):
            before = ticks[0]
            t0 = time.perf_counter()
            assert call() == 0
            took = time.perf_counter() - t0
            if took > 0.05:  # long enough for the counting thread to be scheduled
                assert ticks[0] > before, "the call kept the GIL"
    finally:
        stop.set()
        t.join(5)
    del buf


def test_register_location(caplog):
    import hixl
    from hixl.mooncake._location import mem_type

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf, p = _buf(4096)
    assert mem_type(p, "cpu:0") == hixl.MemType.HOST
    assert mem_type(p, "cuda:0") == hixl.MemType.DEVICE
    assert mem_type(p, "*") == hixl.MemType.HOST  # host memory, whether CUDA is found or not
    if not hixl.cuda_info()["available"]:
        with caplog.at_level(logging.ERROR, logger="hixl.mooncake"):
            assert te.register_memory(p, 4096, "cuda:0") == -1
        assert "CUDA" in caplog.text
    assert te.register_memory(p, 4096, "cpu:0") == 0
    te.close()
    del buf
