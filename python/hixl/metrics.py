"""Prometheus metrics of hixl engines: an HTTP endpoint, or a collector for prometheus_client.

    srv = hixl.metrics.serve(engine, port=9464)   # http://127.0.0.1:9464/metrics
    ...
    srv.close()

The exposition (Prometheus text format 0.0.4) has, per engine, peer and backend:
``hixl_link_up``, ``hixl_bytes_total{op}``, ``hixl_operations_total{op}``,
``hixl_errors_total{status}``, ``hixl_notifications_total``, ``hixl_requests_in_flight``,
per RDMA rail ``hixl_rdma_rail_up{device}``, ``hixl_rdma_rail_bytes_total{device}`` and
``hixl_rdma_rail_returns_total{device}``, and the histogram ``hixl_request_duration_seconds``;
per engine: ``hixl_registered_bytes``, ``hixl_registered_regions`` and ``hixl_peers``. Peer
labels are capped: the `max_peers` peers that moved the most bytes keep their own label, the
others are summed under ``peer="_other"``, so a fleet of thousands of peers stays a bounded
number of series.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from . import _place
from ._hixl import Hixl, metrics_text

__all__ = ["CONTENT_TYPE", "MetricsServer", "collector", "serve", "text"]

#: The Content-Type of the exposition.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Connections `serve` handles at once (one thread each), by default.
MAX_CONNECTIONS = 16
#: Seconds one connection may take, request and answer, by default.
TIMEOUT_S = 5.0

log = logging.getLogger("hixl.metrics")


class _CappedServer(ThreadingHTTPServer):
    """A threading HTTP server that holds at most `max_connections` connections (threads) and
    gives each `timeout_s` from accept to close: the oldest is cut to admit a new one, and
    the serving loop cuts any that ran out of time, however slowly it trickles bytes."""

    daemon_threads = True
    request_queue_size = 64  # the accept backlog: a burst of connects is not dropped

    def __init__(self, addr: tuple[str, int], handler: Any, cap: int, timeout_s: float) -> None:
        self.cap, self.timeout_s = cap, timeout_s
        self._lock = threading.Lock()
        # Open connection -> [deadline, already cut]; its thread removes it when it ends.
        self._open: dict[socket.socket, list[Any]] = {}
        self._cuts, self._warn_at = 0, 0.0
        super().__init__(addr, handler)

    @staticmethod
    def _cut(conn: socket.socket) -> None:
        try:
            conn.shutdown(socket.SHUT_RDWR)  # its thread then ends and closes it
        except OSError:
            pass

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            live = [c for c, (_, cut) in self._open.items() if not cut]
            if len(self._open) >= self.cap and not live:
                full = True
            else:
                full = False
                if len(self._open) >= self.cap:
                    self._open[live[0]][1] = True
                    self._cut(live[0])
                    self._cuts += 1
                    if time.monotonic() >= self._warn_at:  # at most one line per 10 s
                        self._warn_at = time.monotonic() + 10.0
                        log.warning(
                            "hixl.metrics: %d connections open (max_connections): the oldest "
                            "closed to admit %s (%d so far)",
                            self.cap,
                            client_address[0],
                            self._cuts,
                        )
                self._open[request] = [time.monotonic() + self.timeout_s, False]
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Called by serve_forever between polls: cuts the connections past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [c for c, st in self._open.items() if not st[1] and st[0] <= now]
            for c in late:
                self._open[c][1] = True
                self._cut(c)


def _engines(fn: str, engines: tuple[Any, ...]) -> list[Hixl]:
    """`engines` as a list, each checked to be a `Hixl`: anything else raises TypeError naming
    it (a port passed positionally, as to ``prometheus_client.start_http_server(9464)``, says
    that the port is a keyword)."""
    for i, e in enumerate(engines):
        if not isinstance(e, Hixl):
            hint = ""
            if fn == "serve" and isinstance(e, int) and not isinstance(e, bool):
                hint = f"; the port is a keyword: hixl.metrics.serve(engine, port={e})"
            raise TypeError(
                f"hixl.metrics.{fn}(): engines[{i}]={e!r} ({type(e).__name__}) is not a "
                f"hixl.Hixl engine{hint}"
            )
    return list(engines)


def text(*engines: Hixl, max_peers: int = 32) -> str:
    """The exposition of `engines` now (engines not initialized are left out)."""
    return metrics_text(_engines("text", engines), max_peers)


class MetricsServer:
    """A small HTTP server answering ``GET /metrics`` on a thread of its own."""

    def __init__(
        self,
        engines: list[Hixl],
        host: str,
        port: int,
        max_peers: int,
        max_connections: int = MAX_CONNECTIONS,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise ValueError(f"max_connections must be an integer >= 1, not {max_connections!r}")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (0 < timeout_s <= 3600)
        ):
            raise ValueError(f"timeout_s must be seconds in (0, 3600], not {timeout_s!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535] (0: a free one), not {port!r}")
        self.engines = engines
        self.max_peers = max_peers
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = float(timeout_s)  # each read and write; the server bounds the whole

            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = text(*owner.engines, max_peers=owner.max_peers).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # scrapes every few seconds would flood stderr

        try:
            self._http = _CappedServer((host, port), Handler, max_connections, float(timeout_s))
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"hixl.metrics.serve: cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(port=0 picks a free one)",
            ) from exc
        self._thread = _place.thread(self._http.serve_forever, args=(0.25,), name="hixl-metrics")
        self._thread.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when asked for port 0)."""
        return int(self._http.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        host = str(self._http.server_address[0])
        return f"http://{host}:{self.port}/metrics"

    def add(self, engine: Hixl) -> None:
        """Exposes one more engine."""
        self.engines.extend(_engines("MetricsServer.add", (engine,)))

    def close(self) -> None:
        """Stops serving and closes the socket (waits at most 5 s for the thread)."""
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    *engines: Hixl,
    port: int = 0,
    host: str = "127.0.0.1",
    max_peers: int = 32,
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = TIMEOUT_S,
) -> MetricsServer:
    """Serves the metrics of `engines` at ``http://host:port/metrics``. Binds to 127.0.0.1
    unless told otherwise (metrics name peers and sizes); port 0 picks a free port
    (``.port``). At most `max_connections` connections are served at once, one thread each
    (over it the oldest is closed), and each is closed `timeout_s` seconds after it was
    accepted, request and answer included. Engines are positional and the port a keyword:
    anything but a `Hixl` among `engines` (``serve(9464)``) raises TypeError naming it; a port
    that cannot be had raises OSError naming host and port."""
    return MetricsServer(
        _engines("serve", engines), host, port, max_peers, max_connections, timeout_s
    )


def collector(*engines: Hixl, max_peers: int = 32) -> Any:
    """A collector for prometheus_client (``REGISTRY.register(hixl.metrics.collector(e))``),
    when that package is installed; it yields the same families as the endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    engines = tuple(_engines("collector", engines))

    class Collector:
        def collect(self) -> Iterator[Any]:
            yield from text_string_to_metric_families(text(*engines, max_peers=max_peers))

    return Collector()
