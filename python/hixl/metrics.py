"""Prometheus metrics of hixl engines: an HTTP endpoint, or a collector for prometheus_client.

    srv = hixl.metrics.serve(engine, port=9464)   # http://127.0.0.1:9464/metrics
    ...
    srv.close()

The exposition (Prometheus text format 0.0.4) has, per engine, peer and backend:
``hixl_link_up``, ``hixl_bytes_total{op}``, ``hixl_operations_total{op}``,
``hixl_errors_total{status}``, ``hixl_notifications_total``, ``hixl_requests_in_flight`` and
the histogram ``hixl_request_duration_seconds``; per engine: ``hixl_registered_bytes``,
``hixl_registered_regions`` and ``hixl_peers``. Peer labels are capped: the `max_peers` peers
that moved the most bytes keep their own label, the others are summed under
``peer="_other"``, so a fleet of thousands of peers stays a bounded number of series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from ._hixl import Hixl, metrics_text

__all__ = ["CONTENT_TYPE", "MetricsServer", "collector", "serve", "text"]

#: The Content-Type of the exposition.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def text(*engines: Hixl, max_peers: int = 32) -> str:
    """The exposition of `engines` now (engines not initialized are left out)."""
    return metrics_text(list(engines), max_peers)


class MetricsServer:
    """A small HTTP server answering ``GET /metrics`` on a thread of its own."""

    def __init__(self, engines: list[Hixl], host: str, port: int, max_peers: int) -> None:
        self.engines = engines
        self.max_peers = max_peers
        owner = self

        class Handler(BaseHTTPRequestHandler):
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

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="hixl-metrics", daemon=True
        )
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
        self.engines.append(engine)

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
    *engines: Hixl, port: int = 0, host: str = "127.0.0.1", max_peers: int = 32
) -> MetricsServer:
    """Serves the metrics of `engines` at ``http://host:port/metrics``. Binds to 127.0.0.1
    unless told otherwise (metrics name peers and sizes); port 0 picks a free port
    (``.port``)."""
    return MetricsServer(list(engines), host, port, max_peers)


def collector(*engines: Hixl, max_peers: int = 32) -> Any:
    """A collector for prometheus_client (``REGISTRY.register(hixl.metrics.collector(e))``),
    when that package is installed; it yields the same families as the endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    class Collector:
        def collect(self) -> Iterator[Any]:
            yield from text_string_to_metric_families(text(*engines, max_peers=max_peers))

    return Collector()
