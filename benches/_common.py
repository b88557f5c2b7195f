"""What the benchmark scripts share: argument parsing, the target process, timing, output."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

MIB = 1 << 20


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each of `iters` calls of `fn`, after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """The options every benchmark has; scripts add their own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", type=int, metavar="SIZE", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--iters", type=int, default=None, help="timed runs per row (default 10)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return ap


@dataclass
class Plan:
    """Sizes of one run: the big message, runs per row, and the scattered blocks."""

    size: int
    iters: int
    nblk: int
    blk: int = 16 * 1024

    @classmethod
    def of(cls, a: argparse.Namespace) -> Plan:
        quick = bool(a.quick)
        return cls(
            size=(32 if quick else 128) * MIB,
            iters=a.iters or (3 if quick else 10),
            nblk=2048 if quick else 8192,
        )

    @property
    def span(self) -> int:
        """Bytes the target must hold (a multiple of 2 MiB)."""
        return max(self.size, self.nblk * self.blk)


def start_target(script: str, size: int) -> tuple[subprocess.Popen, list[str]]:
    """Starts `script --serve SIZE` and returns it with the fields of its READY line."""
    proc = subprocess.Popen(
        [sys.executable, script, "--serve", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    tag, *fields = proc.stdout.readline().split()
    assert tag == "READY", tag
    return proc, fields


def start_json_target(script: str) -> tuple[subprocess.Popen, dict]:
    """Starts `script --serve` (a flag, no size) and returns it with the JSON object its first
    line holds."""
    proc = subprocess.Popen(
        [sys.executable, script, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def stop_target(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def bandwidth_row(secs: list[float], nbytes: int) -> dict[str, float]:
    """Best and median decimal GB/s."""
    return {
        "min_s": min(secs),
        "median_s": statistics.median(secs),
        "best_GBps": nbytes / min(secs) / 1e9,
        "median_GBps": nbytes / statistics.median(secs) / 1e9,
    }


def print_ratios(rows: dict[str, dict], pairs: list[tuple[str, str | None]], width: int) -> None:
    """Prints rows with their ratio to a baseline row (None: the row is a baseline)."""
    head = f"{'best GB/s':>10} {'median GB/s':>12} {'x raw best':>11} {'x raw med':>10}"
    print(f"{'row':{width}} {head}")
    for name, base in pairs:
        r = rows[name]
        b = rows[base] if base else r
        r["ratio_to_raw"] = r["best_GBps"] / b["best_GBps"]
        r["median_ratio_to_raw"] = r["median_GBps"] / b["median_GBps"]
        print(
            f"{name:{width}} {r['best_GBps']:10.2f} {r['median_GBps']:12.2f} "
            f"{r['ratio_to_raw']:11.2f} {r['median_ratio_to_raw']:10.2f}"
        )


def write_json(path: str | None, rows: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2)
