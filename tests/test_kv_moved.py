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


@pytest.mark.parametrize(
    "name", ["init", "finalize", "pull_cache", "allocate_cache", "HIXL_001002"]
)
def test_a_moved_top_level_name_is_the_kv_one_with_a_deprecation_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"hixl\.kv\.{name}"):
        old = getattr(hixl, name)
    assert old is getattr(hixl.kv, name)
    assert name not in hixl.__all__ and name in hixl.kv.__all__


@pytest.mark.parametrize(("old", "new"), sorted(hixl.kv.RENAMED.items()))
def test_a_renamed_kv_class_keeps_its_old_name_for_a_release(old: str, new: str) -> None:
    """The kv classes that shared a name with a different llm_datadist class were renamed:
    the old name, in hixl.kv and at the top level, is the same class, with a warning."""
    with pytest.warns(DeprecationWarning, match=rf"hixl\.kv\.{old} is deprecated.*hixl\.kv\.{new}"):
        got = getattr(hixl.kv, old)
    assert got is getattr(hixl.kv, new) and got.__name__ == new
    assert new in hixl.kv.__all__ and old not in hixl.kv.__all__
    with pytest.warns(DeprecationWarning, match=rf"hixl\.{old} is deprecated.*hixl\.kv\.{new}"):
        assert getattr(hixl, old) is got
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            getattr(hixl, new)  # never a top-level name


def test_no_kv_name_is_a_different_llm_datadist_class() -> None:
    import hixl.llm_datadist as ld

    shared = set(hixl.kv.__all__) & set(ld.__all__)
    assert not [n for n in shared if getattr(hixl.kv, n) is not getattr(ld, n)], shared
    out = _python("from hixl.kv import *; from hixl.llm_datadist import *")
    assert out.returncode == 0, out.stderr  # neither star import warns


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
