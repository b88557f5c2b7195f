"""Registration handles: a handle names one registration, never whatever is registered at its
range now (docs/RELIABILITY.md, threat model (b))."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np

import hixl

PUT = Path(__file__).with_name("_sec_put.py")


def test_a_stale_handle_deregisters_nothing_registered_since_at_the_same_range() -> None:
    """An application deregisters a buffer, registers it again, then (a bug, or a library
    holding the old handle) deregisters the first handle once more. That call does nothing:
    the new registration stays, its object stays alive, and a peer process's WRITEs into it
    land (before the fix the stale handle removed the new region: the peer's puts failed, and
    the Python binding let go of the object while it was still registered)."""
    n = 1 << 16
    with hixl.Hixl() as t:
        t.initialize("127.0.0.1:0")
        arr = np.zeros(n, np.uint8)
        addr, ref = arr.ctypes.data, weakref.ref(arr)
        h1 = t.register(arr)
        t.deregister_mem(h1)
        h2 = t.register(arr)
        assert (h2.addr, h2.len) == (h1.addr, h1.len) and h2.id != h1.id
        del arr
        t.deregister_mem(h1)  # stale: names a registration that is gone
        gc.collect()
        assert ref() is not None, "the object of the live registration was let go"
        p = subprocess.Popen(
            [sys.executable, str(PUT), t.local_engine, str(addr), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = p.communicate("go\n", timeout=60)
        finally:
            p.kill()
        assert p.returncode == 0, f"the peer's put failed: {err[-2000:]}"
        assert out.split()[-3:] == ["DONE", "20", "0"], out
        buf = ref()
        assert buf is not None and bytes(buf) == b"\x5a" * n
        t.deregister_mem(h2)
        del buf
        gc.collect()
        assert ref() is None, "released once its own handle deregistered it"
