"""Ray tensor handoff between two actors: hixl.ray's transport, Ray's NIXL transport on hixl's
NIXL face, and Ray's object store.

    HIXL_RAY_PYTHON=/path/to/venv-with-ray/bin/python python benches/ray_rdt.py [--quick]

One local Ray cluster (ray.init on this host), a sender and a receiver actor. A handoff is the
sender's method call returning torch CPU tensors, the receiver's task that takes the ref (the
receive), and ray.get of that task's small result in the driver; the row is the median of its
iterations (after 2 warm-up ones), per transport and size: 4 KiB, 1 MiB, 64 MiB and 100 x
256 KiB. The sender returns the same tensors each time (made once, outside the timing), so the
rows time the handoff, not the making. Before timing, each (transport, size) is checked
byte-exact once (sha256 on both sides). Prints one JSON line per row, then a table.

Run it with a Python that has Ray 2.60 and torch (scripts/install_ray.sh makes one); from
another one it re-runs itself under $HIXL_RAY_PYTHON. Ray's workers inherit PYTHONPATH: hixl's
NIXL shim and this checkout's python/ are put on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KIB, MIB = 1 << 10, 1 << 20
# (label, bytes per tensor, tensors, iterations)
SIZES = [
    ("4KiB", 4 * KIB, 1, 40),
    ("1MiB", MIB, 1, 30),
    ("64MiB", 64 * MIB, 1, 8),
    ("100x256KiB", 256 * KIB, 100, 15),
]
TRANSPORTS = ["hixl", "nixl", "object"]


def reexec() -> None:
    """Runs this script under $HIXL_RAY_PYTHON with the shim and python/ on PYTHONPATH."""
    py = os.environ.get("HIXL_RAY_PYTHON")
    if not py:
        sys.exit("Ray is not importable here: set HIXL_RAY_PYTHON (scripts/install_ray.sh)")
    shim = ROOT / "python" / "hixl" / "nixl" / "shim"
    path = [str(shim), str(ROOT / "python"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HIXL_RAY_BENCH_REEXEC": "1"}
    os.execve(py, [py, __file__, *sys.argv[1:]], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a third of the iterations")
    args = ap.parse_args()
    try:
        import ray
        import torch
    except ImportError:
        if os.environ.get("HIXL_RAY_BENCH_REEXEC"):
            raise
        reexec()
    import hixl.ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    hixl.ray.register()

    @ray.remote(enable_tensor_transport=True)
    class Sender:
        def __init__(self) -> None:
            self.cache: dict[tuple[int, int], list[Any]] = {}

        def make(self, size: int, count: int) -> list[Any]:
            key = (size, count)
            if key not in self.cache:
                g = torch.Generator().manual_seed(size + count)
                self.cache[key] = [
                    torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
                    for _ in range(count)
                ]
            return self.cache[key]

    @ray.remote(enable_tensor_transport=True)
    class Receiver:
        def take(self, ts: list[Any]) -> int:
            return sum(int(t.numel()) for t in ts)

        def sha(self, ts: list[Any]) -> str:
            h = hashlib.sha256()
            for t in ts:
                h.update(t.numpy().tobytes())
            return h.hexdigest()

    s, r = Sender.remote(), Receiver.remote()

    def call(t: str, size: int, count: int) -> Any:
        m = s.make if t == "object" else s.make.options(tensor_transport=t)
        return m.remote(size, count)

    rows = []
    for label, size, count, iters in SIZES:
        n = max(3, iters // 3) if args.quick else iters
        g = torch.Generator().manual_seed(size + count)
        want = hashlib.sha256()
        for _ in range(count):
            want.update(
                torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
            )
        for t in TRANSPORTS:
            got = ray.get(r.sha.remote(call(t, size, count)))
            if got != want.hexdigest():
                sys.exit(f"{t} {label}: bytes differ")
            times = []
            for i in range(n + 2):
                t0 = time.perf_counter()
                ray.get(r.take.remote(call(t, size, count)))
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            row = {
                "transport": t,
                "size": label,
                "median_ms": round(statistics.median(times) * 1000, 3),
                "iters": n,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    ray.shutdown()
    print(f"\n{'size':<12}" + "".join(f"{t:>12}" for t in TRANSPORTS) + "   (median ms)")
    for label, *_ in SIZES:
        ms = {x["transport"]: x["median_ms"] for x in rows if x["size"] == label}
        print(f"{label:<12}" + "".join(f"{ms[t]:>12.3f}" for t in TRANSPORTS))


if __name__ == "__main__":
    main()
