"""What a newcomer meets first: a blocking wait for notifications, option values of any plain
type, and clear words when the peer is not a hixl engine."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import hixl


def test_wait_notifies_blocks_until_the_named_one_arrives(make_peer) -> None:
    t = hixl.Hixl()
    t.initialize("127.0.0.1:0")
    e = hixl.Hixl()
    e.initialize("127.0.0.1")
    try:
        e.connect(t.local_engine, timeout_ms=5000)
        e.send_notify(t.local_engine, hixl.NotifyDesc("layer", "0"), timeout_ms=5000)

        def later() -> None:
            time.sleep(0.2)
            e.send_notify(t.local_engine, hixl.NotifyDesc("done", "all layers"), timeout_ms=5000)

        threading.Thread(target=later).start()
        t0 = time.monotonic()
        got = t.wait_notifies(10_000, name="done")
        waited = time.monotonic() - t0
        assert [(n.name, n.msg) for n in got] == [("done", "all layers")]
        assert waited < 9, "it returned when the notification came, not at its timeout"
        # The other one stayed for get_notifies; nothing named "done" is left.
        assert [(n.name, n.msg) for n in t.get_notifies()] == [("layer", "0")]
        with pytest.raises(hixl.Timeout, match='"done"'):
            t.wait_notifies(100, name="done")
        e.send_notify(t.local_engine, hixl.NotifyDesc("any", "x"), timeout_ms=5000)
        assert [n.name for n in t.wait_notifies(5000)] == ["any"]
    finally:
        e.finalize()
        t.finalize()


def test_option_values_may_be_int_or_bool() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.tcp.streams": 4, "hixl.strict_alignment": False})
    e.finalize()
    e = hixl.Hixl()
    with pytest.raises(hixl.ParamInvalid, match=r"hixl.tcp.streams=2\.5 has type float"):
        e.initialize("127.0.0.1", {"hixl.tcp.streams": 2.5})
    with pytest.raises(hixl.ParamInvalid, match='hixl.tcp.streams="0"'):
        e.initialize("127.0.0.1", {"hixl.tcp.streams": 0})


def test_a_peer_that_is_not_a_hixl_engine_is_named_so() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def http() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(4096)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            time.sleep(0.5)

    threading.Thread(target=http, daemon=True).start()
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        with pytest.raises(hixl.HixlError, match="not a hixl engine") as err:
            e.connect(f"127.0.0.1:{port}", timeout_ms=3000)
        assert '"HT"' in str(err.value), err.value
    finally:
        e.finalize()
        srv.close()
