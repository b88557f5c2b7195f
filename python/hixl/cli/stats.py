"""Watch a running engine through its metrics endpoint (hixl.metrics.serve).

    hixl stats --url http://127.0.0.1:9464/metrics            # one table, now
    hixl stats --url http://127.0.0.1:9464/metrics --watch 2  # a table every 2 s, with rates
    hixl stats --url 127.0.0.1:9464                           # http:// and /metrics assumed

One row per engine, peer and backend: link state, bytes written and read (and MB/s between
two scrapes when watching), operations, failed requests, requests in flight, request-queue
slots in use, heartbeat intervals missed, and the median request time estimated from the
latency histogram (the upper bound of the bucket holding the median). Exit status: 0, or 1
when the endpoint cannot be read (one line naming it).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from .._redact import scrub

NAME = "stats"
HELP = "watch a running engine's metrics endpoint (peers, bytes, rates, in flight, errors)"

_SAMPLE = re.compile(r"^([a-z_]+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Key = tuple[str, str, str]  # engine, peer, backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        required=True,
        help="the endpoint, e.g. http://127.0.0.1:9464/metrics (host:port: http, /metrics)",
    )
    p.add_argument(
        "--watch", type=float, metavar="SECONDS", help="print a table every SECONDS (Ctrl-C ends)"
    )
    p.add_argument("--count", type=int, help="with --watch: stop after this many tables")
    p.add_argument("--timeout", type=float, default=5.0, help="per scrape, seconds (default 5)")


def endpoint(url: str) -> str:
    """`url` as it is scraped: without a scheme ("127.0.0.1:9464") it is http://, and without a
    path /metrics; a scheme other than http and https, or no host, raises ValueError."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected http://host:port/metrics (or host:port)")
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, parts.path or "/metrics", parts.query, "")
    )


def scrape(url: str, timeout: float) -> dict[Key, dict[str, Any]]:
    """Per (engine, peer, backend): the counters of the exposition."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    rows: dict[Key, dict[str, Any]] = defaultdict(lambda: defaultdict(float))
    buckets: dict[Key, list[tuple[float, float]]] = defaultdict(list)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2))), float(m.group(3))
        if "peer" not in labels:
            continue
        key = (labels["engine"], labels["peer"], labels["backend"])
        op = labels.get("op")
        if name == "hixl_request_duration_seconds_bucket":
            le = labels["le"]
            buckets[key].append((float("inf") if le == "+Inf" else float(le), value))
        elif op:
            rows[key][f"{name}:{op}"] += value
        elif name == "hixl_errors_total":
            rows[key][name] += value
        else:
            rows[key][name] = value
    for key, bs in buckets.items():
        bs.sort()
        total = bs[-1][1] if bs else 0
        rows[key]["p50_s"] = next((le for le, n in bs if total and n >= total / 2), float("nan"))
    return rows


def table(
    now: dict[Key, dict[str, Any]], before: dict[Key, dict[str, Any]] | None, dt: float
) -> str:
    head = (
        f"{'peer':24} {'via':4} {'up':>2} {'MB out':>9} {'MB in':>9} {'MB/s out':>8} "
        f"{'MB/s in':>8} {'ops':>8} {'err':>5} {'fly':>5} {'queue':>5} {'hb miss':>7} {'p50':>9}"
    )
    lines = [head]
    for key in sorted(now):
        r = now[key]
        out, inn = r["hixl_bytes_total:write"], r["hixl_bytes_total:read"]
        rate_out = rate_in = "-"
        if before and key in before and dt > 0:
            rate_out = f"{(out - before[key]['hixl_bytes_total:write']) / dt / 1e6:.1f}"
            rate_in = f"{(inn - before[key]['hixl_bytes_total:read']) / dt / 1e6:.1f}"
        ops = r["hixl_operations_total:write"] + r["hixl_operations_total:read"]
        p50 = r.get("p50_s", float("nan"))
        p50_text = "-" if p50 != p50 else ("inf" if p50 == float("inf") else f"<={p50 * 1e6:.0f}us")
        lines.append(
            f"{key[1]:24} {key[2]:4} {int(r['hixl_link_up']):>2} {out / 1e6:9.2f} {inn / 1e6:9.2f} "
            f"{rate_out:>8} {rate_in:>8} {int(ops):>8} {int(r['hixl_errors_total']):>5} "
            f"{int(r['hixl_requests_in_flight']):>5} {int(r['hixl_queue_slots_used']):>5} "
            f"{int(r['hixl_heartbeats_missed_total']):>7} {p50_text:>9}"
        )
    if len(lines) == 1:
        lines.append("(no links)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    p: argparse.ArgumentParser = args.parser
    if args.watch is not None and args.watch <= 0:
        p.error(f"--watch {args.watch}: must be a positive number of seconds")
    if args.count is not None and args.count < 1:
        p.error(f"--count {args.count}: must be at least 1")
    try:
        url = endpoint(args.url)
    except ValueError as exc:
        p.error(f"--url {args.url!r}: {exc}")
    before: dict[Key, dict[str, Any]] | None = None
    t_before = 0.0
    shown = 0
    while True:
        try:
            now = scrape(url, args.timeout)
        except OSError as exc:
            print(scrub(f"hixl stats: cannot read {url}: {exc}", url), file=sys.stderr)
            return 1
        t_now = time.monotonic()
        print(table(now, before, t_now - t_before), flush=True)
        shown += 1
        if args.watch is None or (args.count is not None and shown >= args.count):
            return 0
        before, t_before = now, t_now
        time.sleep(args.watch)
        print()
