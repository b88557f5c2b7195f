"""Output of ``hixl bench``: the table, JSON, CSV, the plot and the progress bar."""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
import textwrap
from typing import Any

from .. import backends
from ._sizes import human, size_ticks

#: Every column of a row, in table order, with its heading and format.
COLUMNS: list[tuple[str, str, str]] = [
    ("op", "op", "{}"),
    ("transport", "via", "{}"),
    ("block", "block", "size"),
    ("batch", "batch", "{}"),
    ("requests", "reqs", "{}"),
    ("gbps", "GB/s", "{:.3f}"),
    ("lat_avg_us", "avg us", "us"),
    ("lat_p50_us", "p50 us", "us"),
    ("lat_p99_us", "p99 us", "us"),
    ("post_us", "post us", "us"),
    ("cpu_initiator_s_per_gb", "cpu i", "{:.3f}"),
    ("cpu_target_s_per_gb", "cpu t", "{:.3f}"),
    ("check", "check", "{}"),
]
#: The columns of the --baseline table (each row against its own transport's raw baseline).
BASELINE_COLUMNS: list[tuple[str, str, str]] = [
    ("op", "op", "{}"),
    ("transport", "via", "{}"),
    ("block", "block", "size"),
    ("batch", "batch", "{}"),
    ("gbps", "GB/s", "{:.3f}"),
    ("baseline", "baseline", "{}"),
    ("raw_gbps", "raw GB/s", "{:.3f}"),
    ("x_raw", "x raw", "{:.2f}"),
    ("x_raw_spread", "spread", "{}"),
]
#: A row's baseline by its transport: the raw path that transport's bytes take (each
#: backend's `baseline` in the engine's table; backends without one are left out).
BASELINE_OF = {b["name"]: b["baseline"] for b in backends() if b["baseline"]}
#: Ratios of the repetitions within this share of each other are stable enough for a verdict.
STABLE_SPREAD = 0.10
#: The widest line `table` prints.
MAX_WIDTH = 100
#: Columns every row has (the rest appear with --baseline / --check).
BASE_KEYS = [k for k, _, _ in COLUMNS[:12]] + ["request_bytes", "seconds", "check", "strided"]
#: Fewer latency samples than this make p99 the largest sample; the table marks it with "~".
P99_MIN_SAMPLES = 100
#: hixl at this share of its raw baseline or more is "close to raw".
NEAR_RAW = 0.8


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "size":
        return human(int(value))
    if fmt == "us":  # microseconds: a tenth where it is small, whole ones from 1000 on
        return f"{value:.1f}" if value < 1000 else f"{value:.0f}"
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


def _grid(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> list[str]:
    cols = [c for c in columns if any(r.get(c[0]) is not None for r in rows)]
    grid = [[h for _, h, _ in cols]] + [[_row_cell(r, k, f) for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in grid) for i in range(len(cols))]
    sep = "  " if sum(widths) + 2 * (len(widths) - 1) <= MAX_WIDTH else " "
    return [sep.join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in grid]


#: What the columns of the table mean, under it.
LEGEND = [
    "reqs: requests timed (each moves block x batch bytes); GB/s: their bytes / wall time",
    "us: microseconds from post to completion (post us: the submitting call alone)",
    "cpu i/t: CPU seconds per GB moved, initiator/target",
]
#: What the columns of the --baseline table mean, under it.
BASELINE_LEGEND = [
    "raw GB/s: the row's own raw path (baseline), measured in turns with hixl",
    "x raw: hixl's GB/s / raw GB/s, the median of the repetitions (above 1: faster than raw)",
    "spread: how far those repetitions' ratios disagree, (largest - smallest) / median;",
    f"    over {STABLE_SPREAD:.0%} gets no verdict",
]


def table(rows: list[dict[str, Any]], load: dict[str, Any] | None = None) -> str:
    """Aligned text table of the columns present in any row, then its legend and footnotes;
    with --baseline a second table (each row beside its own transport's raw baseline), its
    legend and the verdicts, and, when most verdicts are withheld, a line saying the machine
    looks busy (`load`: what ``_machine.load_during`` read). No line is wider than
    MAX_WIDTH."""
    lines = _grid(rows, COLUMNS)
    lines += LEGEND
    if any(r["requests"] < P99_MIN_SAMPLES for r in rows):
        lines.append(
            f"~ p99: fewer than {P99_MIN_SAMPLES} requests, so the slowest one "
            "(a run without --quick takes more)"
        )
    based = [r for r in rows if r.get("baseline")]
    if based:
        lines.append("")
        lines += _grid(based, BASELINE_COLUMNS)
        lines += BASELINE_LEGEND
        lines += verdicts(based)
        note = busy_note(*withheld(based), load or {})
        if note:
            lines += textwrap.wrap(note, MAX_WIDTH, subsequent_indent="    ")
    return "\n".join(lines)


def _unstable(ratios: list[float]) -> bool:
    """Repetitions too few or too far apart for a verdict."""
    return len(ratios) < 2 or spread(ratios) > STABLE_SPREAD


def withheld(rows: list[dict[str, Any]]) -> tuple[int, int]:
    """(sizes given no verdict, sizes measured against a baseline) over every group."""
    reps = [r["x_raw_reps"] for r in rows if r.get("x_raw_reps")]
    return sum(_unstable(x) for x in reps), len(reps)


def busy_note(held: int, total: int, load: dict[str, Any]) -> str | None:
    """When most verdicts are withheld (`held` of `total` sizes), a line saying the machine
    looks busy, with what `load` read (``loadavg``, ``cores``, ``steal_share``: see
    ``_machine.load_during``); None otherwise."""
    if total == 0 or 2 * held <= total:
        return None
    seen = []
    if load.get("loadavg"):
        one, five, fifteen = load["loadavg"]
        cores = f" on {load['cores']} cores" if load.get("cores") else ""
        seen.append(f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}{cores}")
    if load.get("steal_share") is not None:
        seen.append(f"CPU steal {load['steal_share']:.1%} of the run")
    why = f" ({'; '.join(seen)})" if seen else ""
    return (
        f"busy machine? {held} of {total} sizes got no verdict: their repetitions disagree, "
        f"as when other work shares the CPUs{why}; run again on a quieter machine"
    )


def spread(ratios: list[float]) -> float:
    """How far apart repeated ratios are: (largest - smallest) / median."""
    s = sorted(ratios)
    return (s[-1] - s[0]) / s[len(s) // 2]


def verdict(ratios_by_size: list[tuple[int, list[float]]], base: str) -> str:
    """What the ratios of one (op, via) group to `base` say, from each size's repetitions:
    sizes whose repetitions disagree by more than STABLE_SPREAD get no verdict (their spread is
    named instead); the stable ones are at or above raw (>= 1), close to raw (>= NEAR_RAW) or
    below it."""
    unstable = [(b, r) for b, r in ratios_by_size if _unstable(r)]
    stable = [(b, statistics.median(r)) for b, r in ratios_by_size if (b, r) not in unstable]
    parts = []
    above = [b for b, x in stable if x >= 1]
    near = [b for b, x in stable if NEAR_RAW <= x < 1]
    below = [b for b, x in stable if x < NEAR_RAW]
    sizes = lambda bs: ", ".join(human(b) for b in bs)  # noqa: E731
    if above:
        parts.append(f"at or above raw {base} at {sizes(above)}")
    if near:
        parts.append(f"within {1 - NEAR_RAW:.0%} of raw {base} at {sizes(near)}")
    if below:
        parts.append(f"below {NEAR_RAW:.1f}x raw {base} at {sizes(below)}")
    if unstable:
        spreads = [spread(r) for _, r in unstable if len(r) >= 2]
        why = (
            f"its repetitions spread {min(spreads):.0%}-{max(spreads):.0%}"
            if spreads
            else "one repetition"
        )
        parts.append(f"no verdict at {sizes([b for b, _ in unstable])} ({why})")
    return "; ".join(parts)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (op, via) group measured against its raw baseline (see `verdict`)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((_row_cell(r, "op", "{}"), r["transport"]), []).append(r)
    out = []
    for (op, via), rs in groups.items():
        pts = sorted((r["block"], r["x_raw_reps"]) for r in rs if r.get("x_raw_reps"))
        if pts:
            line = f"verdict {op} {via}: {verdict(pts, rs[0]['baseline'])}"
            out += textwrap.wrap(line, MAX_WIDTH, subsequent_indent="    ")
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
        print(table(rows, meta.get("load")))
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
    ticks = size_ticks([r["block"] for r in rows])
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks])
    ax.minorticks_off()
    ax.set_xlabel("block size")
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
