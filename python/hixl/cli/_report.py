"""Output of ``hixl bench``: the table, JSON, CSV, the plot and the progress bar."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import Any

from ._sizes import human

#: Every column of a row, in table order, with its heading and format.
COLUMNS: list[tuple[str, str, str]] = [
    ("op", "op", "{}"),
    ("transport", "via", "{}"),
    ("block", "block", "size"),
    ("batch", "batch", "{}"),
    ("requests", "reqs", "{}"),
    ("gbps", "GB/s", "{:.3f}"),
    ("lat_avg_us", "avg us", "{:.1f}"),
    ("lat_p50_us", "p50 us", "{:.1f}"),
    ("lat_p99_us", "p99 us", "{:.1f}"),
    ("post_us", "post us", "{:.1f}"),
    ("cpu_initiator_s_per_gb", "cpu i s/GB", "{:.3f}"),
    ("cpu_target_s_per_gb", "cpu t s/GB", "{:.3f}"),
    ("memcpy_gbps", "memcpy", "{:.2f}"),
    ("x_memcpy", "x memcpy", "{:.2f}"),
    ("cma_gbps", "raw cma", "{:.2f}"),
    ("x_cma", "x cma", "{:.2f}"),
    ("socket_gbps", "raw tcp", "{:.2f}"),
    ("x_socket", "x tcp", "{:.2f}"),
    ("check", "check", "{}"),
]
#: Columns every row has (the rest appear with --baseline / --check).
BASE_KEYS = [k for k, _, _ in COLUMNS[:12]] + ["request_bytes", "seconds", "check", "strided"]
#: Fewer latency samples than this make p99 the largest sample; the table marks it with "~".
P99_MIN_SAMPLES = 100
#: hixl at this share of its raw baseline or more is "near the limit".
NEAR_LIMIT = 0.8


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "size":
        return human(int(value))
    if isinstance(value, str) and len(value) > 12:
        return "FAILED"
    return fmt.format(value)


def _row_cell(r: dict[str, Any], key: str, fmt: str) -> str:
    text = _cell(r.get(key), fmt)
    if key == "op" and r.get("strided"):
        return f"{text} strided"
    if key == "lat_p99_us" and r.get(key) is not None and r["requests"] < P99_MIN_SAMPLES:
        return f"~{text}"
    return text


def table(rows: list[dict[str, Any]]) -> str:
    """Aligned text table of the columns present in any row, then its footnotes and verdicts."""
    cols = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    grid = [[h for _, h, _ in cols]] + [[_row_cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in grid]
    if any(r["requests"] < P99_MIN_SAMPLES for r in rows):
        lines.append(
            f"~ p99 of a row with fewer than {P99_MIN_SAMPLES} requests is its slowest one "
            "(too few samples for a 99th percentile; a run without --quick takes more)"
        )
    lines += verdicts(rows)
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (op, via) group that was measured against a raw baseline: its range of
    ratios and whether it is near the limit that baseline sets, and why not where it is not."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((_row_cell(r, "op", "{}"), r["transport"]), []).append(r)
    out = []
    for (op, via), rs in groups.items():
        # A TCP row's limit is a raw socket; a same-host row's is raw cross-memory attach.
        base = "x_socket" if via == "tcp" else "x_cma"
        pts = sorted((r["block"], r[base]) for r in rs if r.get(base))
        if not pts:
            continue
        name = "raw CMA" if base == "x_cma" else "raw TCP"
        lo, hi = min(x for _, x in pts), max(x for _, x in pts)
        below = [b for b, x in pts if x < NEAR_LIMIT]
        if not below:
            verdict = f"near the limit (at least {NEAR_LIMIT:.1f}x everywhere)"
        elif below == [b for b, _ in pts[: len(below)]]:
            verdict = (
                f"near the limit from {human(pts[len(below)][0])} on"
                if len(below) < len(pts)
                else "below the limit at every size"
            ) + (
                f"; below it up to {human(below[-1])}, where the fixed cost of a request "
                "(queueing, waking the waiter, the reply) outweighs moving the bytes"
            )
        else:
            sizes = ", ".join(human(b) for b in below)
            verdict = f"below the limit at {sizes} (noise or contention?)"
        out.append(f"verdict {op} {via}: {lo:.2f}-{hi:.2f}x {name}: {verdict}")
    return out


def to_csv(rows: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue()


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def emit(
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    json_path: str | None,
    csv_path: str | None,
    plot_path: str | None,
) -> None:
    """Writes everything asked for; the table goes to stdout unless JSON or CSV does."""
    if json_path:
        _write(json_path, json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if csv_path:
        _write(csv_path, to_csv(rows))
    if "-" not in (json_path, csv_path):
        print(table(rows))
    if plot_path:
        plot(rows, plot_path, str(meta["machine"].get("cpu", "")))


def require_matplotlib(p: argparse.ArgumentParser) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("--plot needs matplotlib, which is not installed: pip install 'hixl[plot]'")


def plot(rows: list[dict[str, Any]], path: str, subtitle: str) -> None:
    """Bandwidth vs block size: one line per op/transport/batch, baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["transport"], r["batch"]), []).append(r)
    batches = {k[2] for k in groups}
    for (op, via, batch), rs in groups.items():
        rs.sort(key=lambda r: r["block"])
        label = f"{op} {via}" + (f" x{batch}" if len(batches) > 1 else "")
        ax.plot([r["block"] for r in rs], [r["gbps"] for r in rs], marker="o", label=label)
    for key, name in (
        ("memcpy_gbps", "memcpy"),
        ("cma_gbps", "raw CMA"),
        ("socket_gbps", "raw TCP"),
    ):
        first = next(iter(groups.values()))
        pts = [(r["block"], r[key]) for r in first if r.get(key)]
        if pts:
            ax.plot(*zip(*pts, strict=True), linestyle="--", label=f"{name} ({first[0]['op']})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (bytes)")
    ax.set_ylabel("GB/s (decimal)")
    ax.set_title(f"hixl bench\n{subtitle}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int) -> Any:
    """A progress bar on stderr that appears only when a run lasts over a second and stderr
    is a terminal (tqdm); a silent stand-in otherwise."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="row", file=sys.stderr, delay=1.0, disable=None, leave=False)
