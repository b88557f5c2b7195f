"""The README's reference tables are held to the code: the option table to the engine's one
table of options (`OPTIONS` in crates/hixl-core/src/options/mod.rs, exported as
`hixl.option_keys()`), one row per option with the engine's default; HIXL's keys; the status
codes. docs/API.md to the Python API. And every page of docs/ is one click from the README."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import hixl
from hixl.nixl import NETWORK_BACKENDS

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = Path(__file__).resolve().parent.parent / "docs"
# The Python API reference, in two pages.
API = [DOCS / "API.md", DOCS / "API_TYPES.md"]


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


def _public_hixl_members() -> list[str]:
    return sorted(n for n in dir(hixl.Hixl) if not n.startswith("_"))


def _in_reference(name: str, text: str) -> bool:
    """Whether `name` (bare, or as hixl.name / Hixl.name) is a word of a heading of the API
    reference or of a span in backticks (`e.get` does not count for `get`)."""
    word = re.compile(rf"(?<![\w.])(?:hixl\.)?(?:Hixl\.)?{re.escape(name)}(?!\w)")
    if any(line.startswith("#") and word.search(line) for line in text.splitlines()):
        return True
    return any(word.search(span) for span in re.findall(r"`([^`\n]+)`", text))


def test_api_reference_covers_every_hixl_method_and_every_exported_name() -> None:
    """docs/API.md and docs/API_TYPES.md are held to the code: a method of Hixl or a name in
    hixl.__all__ that is added without an entry there fails here."""
    text = "\n".join(page.read_text() for page in API)
    missing = [f"Hixl.{n}" for n in _public_hixl_members() if not _in_reference(n, text)]
    missing += [n for n in hixl.__all__ if not _in_reference(n, text)]
    assert not missing, f"docs/API.md and docs/API_TYPES.md do not mention: {missing}"


def test_every_hixl_method_has_a_docstring_that_names_its_arguments() -> None:
    """help(hixl.Hixl.<method>) says more than one line and names each argument."""
    short, unnamed = [], []
    for name in _public_hixl_members():
        member = getattr(hixl.Hixl, name)
        doc = member.__doc__ or ""
        if len([line for line in doc.strip().splitlines() if line.strip()]) < 2:
            short.append(name)
        if callable(member):
            params = [p for p in inspect.signature(member).parameters if p != "self"]
            unnamed += [f"{name}({p})" for p in params if not re.search(rf"\b{p}\b", doc)]
    assert not short, f"Hixl methods whose docstring is one line or none: {short}"
    assert not unnamed, f"docstrings that do not mention these arguments: {unnamed}"


def test_readme_has_a_row_per_status_code() -> None:
    """The README's Status codes table: one row per `hixl.Status`, with its number."""
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"^\| ([A-Z_]+) \| (\d+) \|", line)
        if m:
            rows[m.group(1)] = int(m.group(2))
    for status in hixl.Status:
        assert status.name in rows, f"README lacks the status row of {status.name}"
        assert rows[status.name] == int(status), f"README: {status.name} = {rows[status.name]}"


def test_every_page_of_docs_is_linked_from_the_readme() -> None:
    """What moved out of the README stays one click away."""
    text = README.read_text()
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"](docs/{p.name}" not in text]
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


# Names spelt HIXL_* in the code that are not environment variables: the C header's constants
# (statuses, access modes, ops, request states, the default timeout), HIXL's error names
# (hixl.HIXL_001001, ...), the Rust table HIXL_OPTIONS and hixl.nixl's backend names.
NOT_ENV = {"HIXL_OPTIONS", "HIXL_READ", "HIXL_WRITE", "HIXL_REQ_"} | set(NETWORK_BACKENDS)
NOT_ENV_PREFIX = ("HIXL_ACCESS_", "HIXL_REQ_", "HIXL_TIMEOUT_DEFAULT", "HIXL_00")


def test_readme_has_a_row_per_environment_variable() -> None:
    """Every HIXL_* variable the code, scripts, tests or benches name appears in the README's
    Environment table (a variable added without its row fails here)."""
    root = README.parent
    statuses = {f"HIXL_{s.name}" for s in hixl.Status}
    files = [root / ".ci" / "run"]
    for sub in ("python", "crates", "scripts", "tests", "benches", "examples"):
        for ext in ("*.py", "*.rs", "*.sh"):
            files += (root / sub).rglob(ext)
    names = set()
    for f in files:
        if "target" in f.parts or not f.is_file():
            continue
        names |= set(re.findall(r"\bHIXL_[A-Z0-9_]+", f.read_text(errors="replace")))
    names -= statuses | NOT_ENV
    names = {n for n in names if not n.startswith(NOT_ENV_PREFIX)}
    env = README.read_text().split("## Environment", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"`(HIXL_[A-Z0-9_]+)`", env))
    # The discovery options' variables are written as HIXL_DISCOVERY_<NAME> in the code.
    missing = sorted(n for n in names if n not in rows and not n.startswith("HIXL_DISCOVERY_"))
    assert not missing, f"environment variables without a README row: {missing}"


def test_the_readme_test_commands_are_what_ci_runs() -> None:
    """The README's Two commands end with `bash .ci/run`, and its Tests section's Python
    command is the one `.ci/run` runs against the installed wheel (scripts/test.sh)."""
    text = README.read_text()
    two = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "\nbash .ci/run\n" in two, "README's Two commands lack `bash .ci/run`"
    assert "pip install . && hixl bench" in two, "README's Two commands lack the main job"
    tests = text.split("\n## Tests", 1)[1].split("\n## ", 1)[0]
    assert "bash scripts/test.sh" in tests, "README's Tests section lacks the Python test command"
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci, ".ci/run no longer runs scripts/test.sh"


def test_readme_has_the_backend_table_row_for_row() -> None:
    """The README's backend table is exactly `hixl.backends()` (the engine's one table), in
    its order; and each backend's own options have their rows in the options table."""
    rows = []
    for line in README.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| (.*?) \| (.*?) \| (.*?) \| (yes|no) \|$", line)
        if m:
            rows.append(m.groups())
    want = [
        (
            b["name"],
            b["meaning"],
            b["domains"],
            b["offered"] or "always",
            "yes" if b["cli"] else "no",
        )
        for b in hixl.backends()
    ]
    assert rows == want
    keys = {k for k, _, _ in hixl.option_keys()}
    for b in hixl.backends():
        for key, _, _ in b["options"]:
            assert key.startswith(f"hixl.{b['name']}.") and key in keys, key
            assert f"| `{key}` |" in README.read_text(), f"{key} has no README row"
