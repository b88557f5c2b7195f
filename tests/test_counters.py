"""Per-peer counters against a real peer process: `stats()` and a real HTTP scrape of
`/metrics` read one source and agree; requests in flight never go negative, and a timed-out
request is an error (not in flight) once its call raised; heartbeat misses stay 0 on healthy
links, idle and busy, and climb on a frozen peer."""

from __future__ import annotations

import threading
import time
import urllib.request

import numpy as np
import pytest

import hixl
import hixl.metrics

parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        body = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in parser.text_string_to_metric_families(body)
        for s in fam.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert hits, f"no sample {name} {labels}"
    return sum(hits)


def agree(e: hixl.Hixl, srv: hixl.metrics.MetricsServer, peer: str) -> dict:
    """The peer's stats, checked against a scrape taken right after (nothing moves between)."""
    st = e.stats()[peer]
    s = scrape(srv.url)
    lab = {"engine": e.local_engine, "peer": peer, "backend": st["backend"]}
    assert value(s, "hixl_requests_in_flight", **lab) == st["in_flight"], (st, s)
    assert value(s, "hixl_errors_total", **lab) == st["errors"], st
    assert value(s, "hixl_notifications_total", **lab) == st["notifies"], st
    assert value(s, "hixl_operations_total", op="write", **lab) == st["ops_write"], st
    assert value(s, "hixl_heartbeats_missed_total", **lab) == st["heartbeat_misses"], st
    assert st["in_flight"] >= 0, st
    return st


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_notifications_leave_in_flight_at_zero_in_stats_and_metrics(make_peer, backend) -> None:
    peer = make_peer(1 << 16)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": backend})
    srv = hixl.metrics.serve(e)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        for i in range(5):
            e.send_notify(peer.engine, hixl.NotifyDesc(f"n{i}", "m"))
            st = agree(e, srv, peer.engine)
            assert (st["in_flight"], st["notifies"], st["errors"]) == (0, i + 1, 0), st
        assert [n for n, _ in peer.notifies()] == [f"n{i}" for i in range(5)]
    finally:
        srv.close()
        e.finalize()


def test_a_timed_out_put_is_an_error_and_not_in_flight_once_it_raised(make_peer) -> None:
    peer = make_peer(1 << 20)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "0"})
    srv = hixl.metrics.serve(e)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 20, np.uint8)
        e.register(src)
        # Frozen, the peer cannot answer: each put's deadline (now) passes with its first
        # part on the wire (1 MiB: more than one part, more than a 4 KiB put dropped unsent).
        with peer.stopped():
            for _ in range(2):
                with pytest.raises(hixl.Timeout):
                    e.put(peer.engine, src.ctypes.data, peer.addr, 1 << 20, timeout_ms=0)
            st = agree(e, srv, peer.engine)
            assert (st["in_flight"], st["errors"], st["ops_write"]) == (0, 2, 0), st
            lab = {"engine": e.local_engine, "peer": peer.engine, "backend": "tcp"}
            assert value(scrape(srv.url), "hixl_errors_total", status="TIMEOUT", **lab) == 2
        # Resumed, the peer serves both writes; the link reports them (its queue empties), and
        # the requests, counted when they timed out, are not counted again.
        deadline = time.monotonic() + 30
        while e.stats()[peer.engine]["queue_slots_used"] > 0:
            assert time.monotonic() < deadline, e.stats()
            time.sleep(0.01)
        st = agree(e, srv, peer.engine)
        assert (st["in_flight"], st["errors"], st["ops_write"]) == (0, 2, 0), st
        e.put(peer.engine, src.ctypes.data, peer.addr, 4096)
        st = agree(e, srv, peer.engine)
        assert (st["in_flight"], st["errors"], st["ops_write"]) == (0, 2, 1), st
    finally:
        srv.close()
        e.finalize()


HEARTBEAT_MS = 250
INTERVALS = 8  # watched per phase: a miss about every other tick (the bug) cannot hide


def test_heartbeat_misses_stay_zero_on_a_healthy_link_and_climb_on_a_frozen_peer(make_peer) -> None:
    peer = make_peer(1 << 20)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": str(HEARTBEAT_MS)})
    srv = hixl.metrics.serve(e)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 20, np.uint8)
        e.register(src)
        # Idle.
        time.sleep(INTERVALS * HEARTBEAT_MS / 1000)
        st = agree(e, srv, peer.engine)
        assert st["alive"] and st["heartbeat_misses"] == 0, st
        # Busy: 1 MiB writes back to back on another thread.
        stop = threading.Event()
        moved = [0]

        def pump() -> None:
            while not stop.is_set():
                e.put(peer.engine, src.ctypes.data, peer.addr, 1 << 20)
                moved[0] += 1

        t = threading.Thread(target=pump)
        t.start()
        try:
            time.sleep(INTERVALS * HEARTBEAT_MS / 1000)
        finally:
            stop.set()
            t.join(30)
        st = agree(e, srv, peer.engine)
        assert moved[0] > 0 and st["alive"] and st["heartbeat_misses"] == 0, (moved, st)
        # Frozen: every interval from now on is a miss (the link dies after three); read from
        # the scrape alone, as a miss may land between two reads.
        lab = {"engine": e.local_engine, "peer": peer.engine, "backend": "tcp"}
        with peer.stopped():
            deadline = time.monotonic() + 10
            while value(scrape(srv.url), "hixl_heartbeats_missed_total", **lab) == 0:
                assert time.monotonic() < deadline, e.stats()
                time.sleep(0.02)
    finally:
        srv.close()
        e.finalize()


def test_every_failed_transfer_is_counted_with_its_status(make_peer) -> None:
    """A put refused at submission (a local range never registered) and puts to a peer whose
    link died are errors in `stats()` and in the metrics, by status; a put to an engine never
    connected is counted under peer="_unlinked"."""
    peer = make_peer(1 << 16)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "100"})
    srv = hixl.metrics.serve(e)
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(4096, np.uint8)
        e.register(src)
        stray = np.ones(4096, np.uint8)  # never registered
        with pytest.raises(hixl.ParamInvalid):
            e.put(peer.engine, stray.ctypes.data, peer.addr, 4096)
        st = agree(e, srv, peer.engine)
        assert (st["errors"], st["errors_by_status"]) == (1, {"PARAM_INVALID": 1}), st
        lab = {"engine": e.local_engine, "peer": peer.engine}
        assert value(scrape(srv.url), "hixl_errors_total", status="PARAM_INVALID", **lab) == 1
        peer.proc.kill()
        peer.proc.wait(10)
        deadline = time.monotonic() + 30
        while e.stats()[peer.engine]["alive"]:
            assert time.monotonic() < deadline, "the link to a killed peer never died"
            time.sleep(0.02)
        for _ in range(2):
            with pytest.raises(hixl.HixlError):
                e.put(peer.engine, src.ctypes.data, peer.addr, 4096, timeout_ms=2000)
        st = e.stats()[peer.engine]
        assert st["errors"] == 3 and sum(st["errors_by_status"].values()) == 3, st
        samples = scrape(srv.url)
        assert value(samples, "hixl_errors_total", **lab) == 3
        with pytest.raises(hixl.NotConnected):
            e.put("127.0.0.1:9", src.ctypes.data, 0, 4096)
        unlinked = {"engine": e.local_engine, "peer": "_unlinked", "status": "NOT_CONNECTED"}
        assert value(scrape(srv.url), "hixl_errors_total", **unlinked) == 1
    finally:
        srv.close()
        e.finalize()
