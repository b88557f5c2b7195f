"""Metrics: the Prometheus endpoint scraped over real HTTP and parsed with prometheus_client,
its figures held to what the test moved; the peer-label cap; per-request telemetry."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import hixl
import hixl.metrics

parser = pytest.importorskip("prometheus_client.parser")


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    hits = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    assert hits, f"no sample {name} {labels}"
    return sum(hits)


def test_scraped_metrics_match_what_moved(make_peer) -> None:
    peer = make_peer(1 << 16)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    srv = hixl.metrics.serve(e)
    try:
        assert srv.url.startswith("http://127.0.0.1:")
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 16, np.uint8)
        h = e.register(src)
        for i in range(10):
            e.put(peer.engine, src.ctypes.data, peer.addr + i * 4096, 4096)
        reqs = [e.get_async(peer.engine, src.ctypes.data, peer.addr, 8192) for _ in range(3)]
        for r in reqs:
            assert r.wait(5000) == hixl.TransferStatus.COMPLETED
        # One failure the target reports: its memory is gone.
        assert int(peer.cmd("map_named", "gone", 8192)) > 0
        gone = e.remote_region(peer.engine, "gone").addr
        assert peer.cmd("unmap_named", "gone") == "OK"
        with pytest.raises(hixl.ParamInvalid):
            e.put(peer.engine, src.ctypes.data, gone, 4096)

        s = scrape(srv.url)
        lab = {"engine": e.local_engine, "peer": peer.engine, "backend": "tcp"}
        assert value(s, "hixl_link_up", **lab) == 1
        assert value(s, "hixl_bytes_total", op="write", **lab) == 10 * 4096
        assert value(s, "hixl_bytes_total", op="read", **lab) == 3 * 8192
        assert value(s, "hixl_operations_total", op="write", **lab) == 10
        assert value(s, "hixl_operations_total", op="read", **lab) == 3
        assert value(s, "hixl_errors_total", status="PARAM_INVALID", **lab) == 1
        assert value(s, "hixl_errors_total", status="TIMEOUT", **lab) == 0
        assert value(s, "hixl_requests_in_flight", **lab) == 0
        assert value(s, "hixl_queue_slots_used", **lab) == 0
        assert value(s, "hixl_queue_slots", **lab) == 4096  # hixl.queue_depth
        value(s, "hixl_heartbeats_missed_total", **lab)  # present: value() fails when absent
        assert value(s, "hixl_request_duration_seconds_count", **lab) == 13
        assert value(s, "hixl_request_duration_seconds_bucket", le="+Inf", **lab) == 13
        assert value(s, "hixl_request_duration_seconds_sum", **lab) > 0
        assert value(s, "hixl_registered_bytes", engine=e.local_engine) == h.len
        assert value(s, "hixl_registered_regions", engine=e.local_engine) == 1
        assert value(s, "hixl_peers", engine=e.local_engine) == 1
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(srv.url.replace("/metrics", "/other"), timeout=10)
        assert err.value.code == 404
    finally:
        srv.close()
        e.finalize()


def test_peer_labels_are_capped_and_the_rest_summed(make_peer) -> None:
    peers = [make_peer(1 << 16) for _ in range(4)]
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        src = np.ones(1 << 16, np.uint8)
        e.register(src)
        for k, p in enumerate(peers):
            e.connect(p.engine, timeout_ms=5000)
            for _ in range(k + 1):  # peer k moved (k + 1) x 4 KiB
                e.put(p.engine, src.ctypes.data, p.addr, 4096)
        text = hixl.metrics.text(e, max_peers=2)
        s = {}
        for fam in parser.text_string_to_metric_families(text):
            for smp in fam.samples:
                s[(smp.name, frozenset(smp.labels.items()))] = smp.value
        labelled = {dict(ls)["peer"] for (n, ls) in s if n == "hixl_link_up"}
        assert labelled == {peers[3].engine, peers[2].engine, "_other"}, labelled
        assert value(s, "hixl_link_up", peer="_other") == 2
        assert value(s, "hixl_bytes_total", op="write", peer="_other") == (1 + 2) * 4096
        assert value(s, "hixl_bytes_total", op="write") == (1 + 2 + 3 + 4) * 4096
        assert value(s, "hixl_peers") == 4
    finally:
        e.finalize()


def test_a_request_reports_its_telemetry_once_it_ended(make_peer) -> None:
    peer = make_peer(1 << 16)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "shm"})
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 16, np.uint8)
        e.register(src)
        descs = [(src.ctypes.data + i * 4096, peer.addr + i * 8192, 4096) for i in range(4)]
        req = e.transfer_async(peer.engine, hixl.TransferOp.WRITE, descs)
        assert req.wait(5000) == hixl.TransferStatus.COMPLETED
        t = req.telemetry()
        assert t is not None
        assert (t["backend"], t["bytes"], t["descs"], t["retries"]) == ("shm", 16384, 4, 0)
        assert t["status"] == hixl.TransferStatus.COMPLETED and t["duration_us"] > 0
        # post_us may exceed duration_us (a same-host copy can end inside the call), but it is
        # microseconds of one call, not seconds or nanoseconds.
        assert 0 < t["post_us"] < 1e6, t
        assert abs(t["start_unix_us"] / 1e6 - time.time()) < 60
        # A request still in flight has none yet.
        e2 = hixl.Hixl()
        e2.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        try:
            e2.connect(peer.engine, timeout_ms=5000)
            e2.register(src)
            with peer.stopped():
                slow = e2.put_async(peer.engine, src.ctypes.data, peer.addr, 4096)
                assert slow.telemetry() is None
            assert slow.wait(5000) == hixl.TransferStatus.COMPLETED
            assert slow.telemetry()["backend"] == "tcp"
        finally:
            e2.finalize()
    finally:
        e.finalize()


def test_queue_and_heartbeat_gauges_follow_a_stalled_peer(make_peer) -> None:
    """While the peer is frozen, requests sit in flight (and in the queue) and heartbeat
    intervals go by without progress; afterwards all of it drains."""
    import time

    peer = make_peer(1 << 20)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.heartbeat_ms": "300"})
    try:
        e.connect(peer.engine, timeout_ms=5000)
        src = np.ones(1 << 20, np.uint8)
        e.register(src)
        with peer.stopped():
            n = 64  # 64 MiB: more than the sockets' buffers hold, so some stay queued
            reqs = [e.put_async(peer.engine, src.ctypes.data, peer.addr, 1 << 20) for _ in range(n)]
            # The first interval without progress (the link would die after three).
            deadline = time.monotonic() + 5
            while (st := e.stats()[peer.engine])["heartbeat_misses"] == 0:
                assert time.monotonic() < deadline, st
                time.sleep(0.02)
            assert st["in_flight"] == n, st
            assert st["queue_slots"] == 4096 and st["queue_slots_used"] >= 1, st
        for r in reqs:
            assert r.wait(10_000) == hixl.TransferStatus.COMPLETED
        st = e.stats()[peer.engine]
        assert (st["in_flight"], st["queue_slots_used"]) == (0, 0), st
    finally:
        e.finalize()


def test_the_collector_serves_through_prometheus_client(engine) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    buf = np.zeros(8192, np.uint8)
    engine.register(buf)
    reg = CollectorRegistry()
    reg.register(hixl.metrics.collector(engine))
    out = generate_latest(reg).decode()
    line = f'hixl_registered_bytes{{engine="{engine.local_engine}"}} 8192.0'
    assert line in out, out


def test_a_port_given_as_an_engine_is_refused_and_a_taken_port_named(engine) -> None:
    """`serve(9464)`, as `prometheus_client.start_http_server(9464)` is called, once served on
    a free port and every scrape failed; the port is a keyword, and a taken one is named."""
    import errno
    import socket

    with pytest.raises(
        TypeError, match=r"engines\[0\]=9464 \(int\) is not a hixl.Hixl engine.*port=9464"
    ):
        hixl.metrics.serve(9464)
    with pytest.raises(TypeError, match=r"engines\[1\]='x' \(str\) is not a hixl.Hixl"):
        hixl.metrics.text(engine, "x")
    with pytest.raises(TypeError, match=r"collector\(\): engines\[0\]=1"):
        hixl.metrics.collector(1)
    with pytest.raises(ValueError, match="port must be an integer in \\[0, 65535\\].*'9464'"):
        hixl.metrics.serve(engine, port="9464")  # type: ignore[arg-type]
    with hixl.metrics.serve(engine) as srv:
        with pytest.raises(TypeError, match=r"MetricsServer.add\(\): engines\[0\]=5"):
            srv.add(5)  # type: ignore[arg-type]
        assert srv.engines == [engine]
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*in use") as ei:
            hixl.metrics.serve(engine, port=port)
        assert ei.value.errno == errno.EADDRINUSE
    finally:
        taken.close()
