"""The top level of ``hixl`` is the engine's API: the KV-cache layer's names are only
``hixl.kv``'s (each under one name), ``hixl.datadist`` does not exist, and the benchmark
baselines (``_raw_*``) and the other internals of the extension are importable by name but
listed in no ``__all__``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import hixl
import hixl.kv
from hixl import _hixl

RAW = ("_raw_tcp_sink", "_raw_tcp_send", "_raw_cma", "_raw_memcpy")

#: The old names of five hixl.kv classes, renamed so that none shares a name with a different
#: hixl.llm_datadist class (no release carries the old ones), with the new names.
OLD_KV_NAMES = {
    "Cache": "RegisteredCache",
    "TransferConfig": "CacheTransferConfig",
    "LLMClusterInfo": "PeerRank",
    "LayerSynchronizer": "LayerTracker",
    "LLMError": "KVError",
}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", sorted(set(hixl.kv.__all__) - {"KVLayout"} | set(OLD_KV_NAMES)))
def test_no_kv_name_is_a_top_level_name(name: str) -> None:
    """The top level is the engine's API: hixl.init, hixl.Cache, hixl.pull_cache, ... are
    AttributeErrors (hixl.kv has them), and asking warns about nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=rf"'hixl' has no attribute '{name}'"):
            getattr(hixl, name)
    assert name not in hixl.__all__


@pytest.mark.parametrize(("old", "new"), sorted(OLD_KV_NAMES.items()))
def test_a_kv_class_has_one_name(old: str, new: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match=rf"'hixl.kv' has no attribute '{old}'"):
            getattr(hixl.kv, old)
    assert getattr(hixl.kv, new).__name__ == new and old not in hixl.kv.__all__


def test_hixl_datadist_is_gone() -> None:
    """hixl.kv is the KV layer's one module path: hixl.datadist does not import."""
    out = _python("import hixl.datadist")
    assert out.returncode != 0
    assert "ModuleNotFoundError: No module named 'hixl.datadist'" in out.stderr, out.stderr


def test_importing_hixl_and_hixl_kv_warns_about_nothing() -> None:
    out = _python("import hixl, hixl.kv, hixl.llm_datadist; hixl.kv.init; hixl.Hixl")
    assert out.returncode == 0, out.stderr


def test_no_kv_name_is_a_different_llm_datadist_class() -> None:
    import hixl.llm_datadist as ld

    shared = set(hixl.kv.__all__) & set(ld.__all__)
    assert not [n for n in shared if getattr(hixl.kv, n) is not getattr(ld, n)], shared
    out = _python("from hixl.kv import *; from hixl.llm_datadist import *")
    assert out.returncode == 0, out.stderr  # neither star import warns


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
