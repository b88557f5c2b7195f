"""What the LLM-DataDist sample ports use in place of torch.distributed: a barrier and a way
to tell the other process something, both through the test that runs them (tests/
test_llm_datadist.py relays "SAY" lines and releases "BARRIER" lines when both got there),
and the data every test fills tensors with."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np


def say(obj: Any) -> None:
    """Tells the other process `obj` (it gets it from hear())."""
    print("SAY " + json.dumps(obj), flush=True)


def hear() -> Any:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the test went away")
    return json.loads(line)


def barrier(name: str) -> None:
    """Returns when the other process has reached the barrier of the same name too."""
    print(f"BARRIER {name}", flush=True)
    line = sys.stdin.readline().strip()
    if line != f"GO {name}":
        raise SystemExit(f"expected GO {name}, got {line!r}")


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The bytes a tensor filled with `seed` holds."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def fill(arr: np.ndarray, seed: int) -> None:
    arr.reshape(-1).view(np.uint8)[:] = pattern(arr.nbytes, seed)


def check(ok: bool, what: str) -> None:
    print(f"CHECK {'ok' if ok else 'FAILED'} {what}", flush=True)
    if not ok:
        raise SystemExit(f"check failed: {what}")


def expect_code(code: Any, fn: Any, *args: Any, **kwargs: Any) -> None:
    """fn(*args) must raise LLMException with status_code `code`."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - checked below
        got = getattr(exc, "status_code", None)
        check(got == code, f"{fn.__name__} raised {got} ({exc}), expected {code}")
        return
    check(False, f"{fn.__name__} did not raise {code}")


def dump(out: str, name: str, arr: np.ndarray) -> None:
    np.save(f"{out}/{name}.npy", np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
