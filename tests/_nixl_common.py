"""What the two NIXL-style test programs (_nixl_target.py, _nixl_initiator.py) share: the
seeded contents both sides can recompute, and bounded waits."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

ROWS, COLS = 64, 4096  # a (64, 4096) uint8 "tensor", unravelled into 64 row descriptors
T = TypeVar("T")


def pattern(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (ROWS, COLS), dtype=np.uint8)


def rows(arr: np.ndarray) -> list[tuple[int, int, int]]:
    """One (addr, len, dev_id) descriptor per row, as NIXL users unravel a tensor."""
    base, n = arr.ctypes.data, arr.shape[1] * arr.itemsize
    return [(base + i * n, n, 0) for i in range(arr.shape[0])]


def published(path: Path) -> bytes | None:
    """The bytes the other program wrote to path (it renames the finished file there)."""
    return path.read_bytes() if path.exists() else None


def wait(what: str, poll: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = poll()
        if got:
            return got
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.001)


def fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    sys.exit(1)


def ok(step: str) -> None:
    print(f"OK {step}", flush=True)
