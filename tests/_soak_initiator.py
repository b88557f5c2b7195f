"""One soak initiator process: THREADS threads do mixed READ/WRITE batches against their own
slice of the target's buffer and verify every byte; the engine is replaced every few seconds
(connect/disconnect churn). Prints one JSON line: ops, bytes, errors.

    python _soak_initiator.py TARGET REMOTE_BASE SLICE_BYTES FIRST_SLICE TRANSPORT SECONDS
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

import hixl

THREADS = 2
REENGINE_S = 4.0


def main() -> None:
    target, base, slice_bytes, first, transport, seconds = sys.argv[1:7]
    base, slice_bytes, first, seconds = int(base), int(slice_bytes), int(first), float(seconds)
    end = time.monotonic() + seconds
    totals = {"ops": 0, "bytes": 0, "errors": [], "engines": 0}
    lock = threading.Lock()
    while time.monotonic() < end:
        e = hixl.Hixl()
        e.initialize("127.0.0.1", {"hixl.backends": transport})
        e.connect(target, timeout_ms=10_000)
        totals["engines"] += 1
        until = min(end, time.monotonic() + REENGINE_S)

        def work(t: int, e: hixl.Hixl = e, until: float = until) -> None:
            rng = np.random.default_rng(first * 1000 + t + totals["engines"] * 7)
            src = np.empty(slice_bytes, np.uint8)
            dst = np.empty(slice_bytes, np.uint8)
            e.register(src)
            e.register(dst)
            remote = base + (first + t) * slice_bytes
            ops = nbytes = 0
            try:
                while time.monotonic() < until:
                    block = int(rng.choice([512, 4096, 65536]))
                    n = slice_bytes // block
                    src[:] = rng.integers(0, 256, slice_bytes, dtype=np.uint8)
                    perm = rng.permutation(n).astype(np.uint64)
                    idx = np.arange(n, dtype=np.uint64)
                    b = np.uint64(block)
                    wr = np.stack(
                        [src.ctypes.data + idx * b, remote + perm * b, np.full(n, b)], 1
                    ).astype(np.uint64)
                    e.transfer_sync(target, hixl.TransferOp.WRITE, wr, 30_000)
                    dst[:] = 0
                    rd = wr.copy()
                    rd[:, 0] = dst.ctypes.data + idx * b
                    req = e.transfer_async(target, hixl.TransferOp.READ, rd, timeout_ms=30_000)
                    if req.wait(40_000) != hixl.TransferStatus.COMPLETED:
                        req.result()
                    if not (dst == src).all():
                        bad = int(np.flatnonzero(dst != src)[0])
                        raise AssertionError(f"thread {t}: byte {bad} differs after a round trip")
                    ops += 2
                    nbytes += 2 * slice_bytes
            except BaseException as exc:  # noqa: BLE001 - reported in the JSON line
                with lock:
                    totals["errors"].append(f"{type(exc).__name__}: {exc}")
            with lock:
                totals["ops"] += ops
                totals["bytes"] += nbytes

        ths = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        e.finalize()
    print(json.dumps(totals), flush=True)


if __name__ == "__main__":
    main()
