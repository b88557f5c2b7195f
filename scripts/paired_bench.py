"""Paired `hixl bench --quick --baseline` runs of several variants, interleaved, on one machine.

Each variant is a `hixl` executable plus options. The runs alternate (A B C A B C ...) so that a
noisy neighbour hurts every variant alike; every row is reported as the median, over the runs,
of hixl's ratio to the raw baseline measured in that same run (process_vm_writev/readv for shm
rows, a raw socket for tcp rows), and then as quotients of those medians against the first
variant.

    python scripts/paired_bench.py --runs 3 \\
        --variant old=/tmp/venv-old/bin/hixl \\
        --variant new=.venv/bin/hixl \\
        --variant secret=.venv/bin/hixl:hixl.secret=$(hixl secret)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path


def parse_variant(text: str) -> tuple[str, list[str]]:
    """NAME=EXE[:KEY=VALUE[,KEY=VALUE...]] -> (name, command)."""
    name, _, rest = text.partition("=")
    exe, _, opts = rest.partition(":")
    cmd = [exe, "bench", "--quick", "--baseline"]
    for kv in filter(None, opts.split(",")):
        cmd += ["--option", kv]
    return name, cmd


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variant", action="append", required=True, help="NAME=EXE[:K=V,K=V]")
    args = ap.parse_args()
    variants = dict(parse_variant(v) for v in args.variant)
    ratios: dict[str, dict[tuple[str, str, int], list[float]]] = {k: {} for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, cmd in variants.items():
                out = Path(tmp) / f"{name}-{i}.json"
                subprocess.run([*cmd, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
                for r in json.loads(out.read_text())["rows"]:
                    base = r["x_raw"]  # the row's own baseline (cma same-host, tcp)
                    ratios[name].setdefault((r["op"], r["transport"], r["block"]), []).append(base)
    names = list(variants)
    first = names[0]
    print(f"median of {args.runs} interleaved runs of: hixl GB/s / raw baseline of the same run")
    head = f"{'op':>5} {'via':>4} {'block':>9} " + " ".join(f"{n:>9}" for n in names)
    print(head + "".join(f" {n + '/' + first:>14}" for n in names[1:]))
    for key in ratios[first]:
        med = {n: statistics.median(ratios[n][key]) for n in names if key in ratios[n]}
        row = f"{key[0]:>5} {key[1]:>4} {key[2]:>9} " + " ".join(
            f"{med.get(n, float('nan')):>9.3f}" for n in names
        )
        print(row + "".join(f" {med.get(n, float('nan')) / med[first]:>14.2f}" for n in names[1:]))


if __name__ == "__main__":
    main()
