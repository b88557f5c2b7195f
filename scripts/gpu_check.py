"""The GPU figures of scripts/gpu_check.sh: a short benchmark of hixl's device paths, each
figure beside its baseline from the same run, written as JSON. Every figure records which
path moved the bytes ("cuda_ipc", "tcp staging": the backend `stats()` names) or why it was
not measured.

  python scripts/gpu_check.py --out figures.json

Needs a GPU; torch (or CuPy) for the in-process baselines (without either, baselines are
recorded as missing). Bytes are checked on the host after each measured copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import hixl

HERE = Path(__file__).resolve().parent
PEER = HERE.parent / "tests" / "_cuda_peer.py"
W = hixl.TransferOp.WRITE
GIB = 1 << 30


def timed(fn: Any, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(secs: list[float], nbytes: int) -> dict[str, float]:
    return {
        "min_s": min(secs),
        "median_s": statistics.median(secs),
        "best_gbps": nbytes / min(secs) / 1e9,
        "median_gbps": nbytes / statistics.median(secs) / 1e9,
    }


def torch_or_none() -> Any:
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


def baseline_d2d(n: int, runs: int) -> dict[str, Any]:
    torch = torch_or_none()
    if torch is None:
        return {"missing": "torch with CUDA is not installed"}
    a = torch.full((n,), 7, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)
        torch.cuda.synchronize()

    copy()
    return {"path": "torch in-process copy_", **summary(timed(copy, 5), n)}


def baseline_blocks(blk: int, count: int, runs: int) -> dict[str, Any]:
    torch = torch_or_none()
    if torch is None:
        return {"missing": "torch with CUDA is not installed"}
    a = torch.ones(count * blk, dtype=torch.uint8, device="cuda:0")
    b = torch.zeros(count * 2 * blk, dtype=torch.uint8, device="cuda:0")
    perm = np.random.default_rng(0).permutation(count)

    def copy() -> None:
        for i, j in enumerate(perm):
            b[2 * j * blk : (2 * j + 1) * blk].copy_(a[i * blk : (i + 1) * blk])
        torch.cuda.synchronize()

    copy()
    return {"path": "torch in-process copy_ per block", **summary(timed(copy, 3), count * blk)}


def staging(p: dict[str, Any], src: Any, m: int) -> dict[str, Any]:
    """cuda -> TCP staging -> cuda beside host -> TCP -> host, one engine forced onto tcp
    (the same link carries both: device bytes through pinned bounce buffers on both sides,
    host bytes zero-copy), with the device bytes checked on the host afterwards."""
    t = hixl.Hixl()
    t.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        t.register(src)
        host = np.frombuffer(bytearray(src.read(0, m)), np.uint8)
        t.register(host)
        t.connect(p["engine"], timeout_ms=20_000)
        path = t.stats()[p["engine"]]["backend"]

        def dev() -> None:
            t.transfer_sync(p["engine"], W, [(src.addr, p["dev"], m)], timeout_ms=120_000)

        def plain() -> None:
            t.transfer_sync(p["engine"], W, [(host.ctypes.data, p["plain"], m)], timeout_ms=120_000)

        dev()
        plain()
        back = hixl.cuda_alloc(m, 0)
        t.register(back)
        t.transfer_sync(p["engine"], hixl.TransferOp.READ, [(back.addr, p["dev"], m)])
        equal = back.read(0, m) == src.read(0, m)
        staged = summary(timed(dev, 3), m)
        base = summary(timed(plain, 3), m)
        return {
            "bytes": m,
            "path": f"{path} staging (pinned bounce buffers on both sides)",
            **staged,
            "equal": equal,
            "baseline": {"path": f"{path} host -> host (zero-copy)", **base},
            "ratio": staged["best_gbps"] / base["best_gbps"],
            "goal": ">= 0.8 x baseline",
        }
    finally:
        t.finalize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--size", type=int, default=GIB, help="bytes of the large copy (1 GiB)")
    args = ap.parse_args()
    info = hixl._hixl.cuda_info()
    result: dict[str, Any] = {"hixl": hixl.__version__, "cuda": info, "figures": {}}
    if not info["available"]:
        result["skipped"] = info["reason"]
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"no GPU: {info['reason']}")
        return 0
    n = args.size
    cmd = [sys.executable, str(PEER), str(n)]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    figs = result["figures"]

    def figure(name: str, fn: Any) -> None:
        """One figure; an error (a sandbox that refuses CUDA IPC, ...) is recorded, not fatal."""
        try:
            figs[name] = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is a finding to record
            figs[name] = {"path": "none", "error": f"{type(exc).__name__}: {exc}"}

    try:
        assert peer.stdout is not None and peer.stdin is not None
        p = json.loads(peer.stdout.readline())
        e = hixl.Hixl()
        e.initialize("127.0.0.1")
        src = hixl.cuda_alloc(n, 0)
        pattern = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        for off in range(0, n, 1 << 20):
            src.write(off, pattern[: min(1 << 20, n - off)])
        e.register(src)
        e.connect(p["engine"], timeout_ms=20_000)
        path = e.stats()[p["engine"]]["backend"]
        result["link_backend"] = path

        def one(descs: list[tuple[int, int, int]]) -> None:
            e.transfer_sync(p["engine"], W, descs, timeout_ms=60_000)

        def large() -> dict[str, Any]:
            big = [(src.addr, p["dev"], n)]
            one(big)  # warm-up: opens the IPC handle
            return {
                "bytes": n,
                "path": path,
                **summary(timed(lambda: one(big), 5), n),
                "baseline": baseline_d2d(n, 5),
                "goal": ">= 0.9 x baseline",
            }

        def checked() -> dict[str, Any]:
            # Bytes on the host after the fact: the peer's device memory read back whole.
            check = hixl.cuda_alloc(n, 0)
            e.register(check)
            e.transfer_sync(p["engine"], hixl.TransferOp.READ, [(check.addr, p["dev"], n)])
            return {"path": path, "equal": check.read(0, n) == src.read(0, n)}

        def latency() -> dict[str, Any]:
            small = [(src.addr, p["dev"], 4096)]
            lat = timed(lambda: one(small), 2000)[100:]
            return {
                "path": path,
                "median_us": statistics.median(lat) * 1e6,
                "p99_us": sorted(lat)[int(len(lat) * 0.99)] * 1e6,
            }

        def scattered() -> dict[str, Any]:
            blk, count = 64 << 10, 1024
            perm = np.random.default_rng(0).permutation(count)
            blocks = [
                (src.addr + i * blk, p["dev"] + int(j) * blk, blk) for i, j in enumerate(perm)
            ]
            one(blocks)
            return {
                "path": path,
                **summary(timed(lambda: one(blocks), 5), count * blk),
                "baseline": baseline_blocks(blk, count, 3),
            }

        figure("ipc_d2d_large", large)
        figure("bytes_checked", checked)
        figure("d2d_4k_latency", latency)
        figure("scattered_1024x64k", scattered)
        figure("staging_tcp", lambda: staging(p, src, min(n, 256 << 20)))
        e.finalize()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if peer.poll() is None and peer.stdin is not None:
            peer.stdin.write("exit\n")
            peer.stdin.flush()
            try:
                peer.wait(30)
            except subprocess.TimeoutExpired:
                peer.kill()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if figs.get("bytes_checked", {}).get("equal") else 1


if __name__ == "__main__":
    sys.exit(main())
