"""The KV-cache API moved from the top level and ``hixl.datadist`` to ``hixl.kv``: the old
paths still give the same objects for one release, each with a DeprecationWarning, and
``import hixl`` / ``import hixl.kv`` warn about nothing."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import hixl
import hixl.kv


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_importing_hixl_and_hixl_kv_warns_about_nothing() -> None:
    out = _python("import hixl, hixl.kv, hixl.llm_datadist; hixl.kv.init; hixl.Hixl")
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", ["init", "finalize", "Cache", "allocate_cache", "HIXL_001002"])
def test_a_moved_top_level_name_is_the_kv_one_with_a_deprecation_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"hixl\.kv\.{name}"):
        old = getattr(hixl, name)
    assert old is getattr(hixl.kv, name)
    assert name not in hixl.__all__ and name in hixl.kv.__all__


def test_an_unknown_top_level_name_is_still_an_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_name"):
            _ = hixl.no_such_name  # type: ignore[attr-defined]


def test_hixl_datadist_is_an_alias_that_warns_once() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import hixl.datadist\n"
        "    from hixl.datadist import Cache, init\n"
        "    from hixl.datadist._context import context\n"
        "import hixl.kv, hixl.kv._context\n"
        "assert [str(x.category.__name__) for x in w] == ['DeprecationWarning'], w\n"
        "assert 'hixl.kv' in str(w[0].message)\n"
        "assert Cache is hixl.kv.Cache and init is hixl.kv.init\n"
        "assert context is hixl.kv._context.context\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
