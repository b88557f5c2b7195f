"""The README's option table is held to the engine's one table of options (`OPTIONS` in
crates/hixl-core/src/options.rs, exported as `hixl.option_keys()`): one row per option, with
the engine's default."""

from __future__ import annotations

import re
from pathlib import Path

import hixl

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_has_a_row_per_option_with_its_default() -> None:
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"^\| `(hixl\.[a-z_.]+)` \| (.*?) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    missing = []
    for key, default, _ in hixl.option_keys():
        if key not in rows:
            missing.append(key)
            continue
        shown = rows[key]
        if default:
            want = f"`{default}`"
            assert shown.startswith(want), f"README shows {key} = {shown}, the engine {want}"
        else:
            assert shown.startswith("unset"), f"README shows {key} = {shown}, the engine: unset"
    assert not missing, f"options without a README row: {missing}"


def test_readme_has_a_row_per_hixl_option_key_with_what_it_does() -> None:
    text = README.read_text()
    for key, effect in hixl.hixl_option_keys():
        assert f"| `{key}` | {effect} |" in text, f"README lacks the row of HIXL's {key}"
