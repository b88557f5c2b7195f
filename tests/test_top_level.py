"""The top level of ``hixl`` is the engine's API: the KV names that read like an engine call
(``hixl.finalize``, ``hixl.link``, ...) still work for one release, warning that they are the
KV layer's and naming the engine's call; the benchmark baselines (``_raw_*``) and the other
internals of the extension are importable by name but listed in no ``__all__``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import hixl
import hixl.kv
from hixl import _hixl

ENGINE_CALL = {
    "init": "Hixl.initialize",
    "finalize": "Hixl.finalize",
    "link": "Hixl.connect",
    "unlink": "Hixl.disconnect",
}
RAW = ("_raw_tcp_sink", "_raw_tcp_send", "_raw_cma", "_raw_memcpy")


@pytest.mark.parametrize("name", sorted(ENGINE_CALL))
def test_a_kv_name_like_an_engine_call_warns_naming_both(name: str) -> None:
    with pytest.warns(DeprecationWarning) as got:
        old = getattr(hixl, name)
    msg = str(got[0].message)
    assert f"use hixl.kv.{name}" in msg and f"not {ENGINE_CALL[name]}" in msg, msg
    assert old is getattr(hixl.kv, name)


def test_the_old_finalize_still_ends_the_kv_layer() -> None:
    """hixl.finalize() is hixl.kv.finalize(): it runs (idempotent with no layer up) and leaves
    an engine made by the application alone."""
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1:0")
        with pytest.warns(DeprecationWarning, match="not Hixl.finalize"):
            hixl.finalize()
        assert e.local_engine.startswith("127.0.0.1:")
        e.alloc(4096)  # still up: the KV layer's finalize is not the engine's


def test_no_all_lists_a_raw_or_private_name() -> None:
    for mod in (hixl, _hixl):
        private = [n for n in mod.__all__ if n.startswith("_") and n != "__version__"]
        assert private == [], (mod.__name__, private)
        assert not any("_raw_" in n for n in mod.__all__)
        assert all(hasattr(mod, n) for n in mod.__all__)


def test_star_import_of_the_extension_brings_no_raw_helper() -> None:
    code = "from hixl._hixl import *; import sys; print(sorted(n for n in dir() if '_raw' in n))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_raw_helpers_stay_importable_for_the_bench() -> None:
    """hixl bench and benches/ import them by name from hixl._hixl: they are there and run."""
    for n in RAW:
        assert callable(getattr(_hixl, n)), n
    per_round = _hixl._raw_memcpy(4096, 4, 3)
    assert len(per_round) == 3 and all(s >= 0 for s in per_round)
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    descs = np.array([[src.ctypes.data, dst.ctypes.data, src.nbytes]], dtype=np.uint64)
    try:
        times = _hixl._raw_cma(os.getpid(), True, descs, 1)
    except hixl.HixlError as e:  # CMA can be refused (ptrace scope, seccomp)
        pytest.skip(f"process_vm_writev is refused here: {e}")
    assert len(times) == 1
    assert np.array_equal(dst, src)
