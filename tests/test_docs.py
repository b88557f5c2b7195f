"""The README's reference tables are held to the code: the option table to the engine's one
table of options (`OPTIONS` in crates/hixl-core/src/options/mod.rs, exported as
`hixl.option_keys()`), one row per option with the engine's default; HIXL's keys; the status
codes; every HIXL_* variable's row, in the README when a user sets it, in docs/TESTING.md when
only the tests, benchmarks and CI do. docs/API.md to the Python API. Every page of docs/ is one
click from the README, whose links are absolute (it is the package index's description), and
every link into the repository names a file that exists."""

from __future__ import annotations

import ast
import inspect
import re
import tomllib
from pathlib import Path

import hixl
from hixl.nixl import NETWORK_BACKENDS

README = Path(__file__).resolve().parent.parent / "README.md"
# The repository, as pyproject.toml's [project.urls] gives it, and its files' URL prefix.
REPO = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["urls"]["Source"]
BLOB = f"{REPO}/blob/main/"
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
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"]({BLOB}docs/{p.name}" not in text]
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


def _links(text: str) -> list[str]:
    """The targets of a Markdown text's links and images: inline, reference-style and HTML."""
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)", text)
    reference = re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, re.M)
    html = re.findall(r"""(?:href|src)\s*=\s*["']([^"']+)""", text)
    return inline + reference + html


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_has_no_relative_link() -> None:
    """The README is the package's description on the package index, which has neither the
    repository's files nor the README's own anchors: every link is absolute."""
    links = _links(README.read_text())
    assert links, "no link found: the link parser is broken"
    relative = [u for u in links if not re.match(r"https?://", u)]
    assert not relative, f"README links that break on the package index: {relative}"


def _repository_links(text: str) -> list[str]:
    """The links of `text` into this repository's files (Markdown links and bare URLs)."""
    return re.findall(rf"{re.escape(REPO)}/(?:blob|tree)/main/[^\s)>\]\"'`]*", text)


def test_every_repository_link_names_a_file_that_exists() -> None:
    """Links to the repository (the README's, docs/'s, and the package's docstrings', which
    name the repository because docs/ does not ship in the wheel) point to a file or folder of
    this checkout, and a #anchor into a Markdown file to one of its headings."""
    root = README.parent
    sources = [
        README,
        *sorted(DOCS.glob("*.md")),
        *sorted((root / "python" / "hixl").rglob("*.py")),
    ]
    sources += sorted((root / "crates" / "hixl-py" / "src").rglob("*.rs"))
    checked, broken = 0, []
    for src in sources:
        for url in _repository_links(src.read_text()):
            rel, _, anchor = url.split("/main/", 1)[1].rstrip(".,;:").partition("#")
            target = root / rel
            checked += 1
            if not target.exists():
                broken.append(f"{src.name}: {url} (no {rel})")
            elif anchor and target.suffix == ".md":
                heads = re.findall(r"^#+\s+(.+?)\s*$", target.read_text(), re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{src.name}: {url} (no heading #{anchor})")
    assert checked >= 20, checked
    assert not broken, broken


def test_no_docstring_points_into_a_checkout() -> None:
    """The wheel has no docs/: a docstring names the repository's URL, never a bare
    docs/NAME.md or "the repository's" file."""
    found = []
    for f in sorted((README.parent / "python" / "hixl").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                if re.search(r"(?<![/\w])docs/\w+\.md|repository's", doc):
                    found.append(f"{f.name}: {getattr(node, 'name', '<module>')}")
    ext = [getattr(hixl._hixl, n) for n in dir(hixl._hixl) if not n.startswith("__")]
    for obj in [*ext, *(getattr(hixl.Hixl, n) for n in dir(hixl.Hixl) if not n.startswith("__"))]:
        doc = getattr(obj, "__doc__", None) or ""
        if isinstance(doc, str) and re.search(r"(?<![/\w])docs/\w+\.md|repository's", doc):
            found.append(f"hixl._hixl: {getattr(obj, '__qualname__', obj)}")
    assert not found, f"docstrings that point into a checkout: {found}"


# Names spelt HIXL_* in the code that are not environment variables: the C header's constants
# (statuses, access modes, ops, request states, the default timeout), HIXL's error names
# (hixl.HIXL_001001, ...), the Rust table HIXL_OPTIONS and hixl.nixl's backend names.
NOT_ENV = {"HIXL_OPTIONS", "HIXL_READ", "HIXL_WRITE", "HIXL_REQ_"} | set(NETWORK_BACKENDS)
NOT_ENV_PREFIX = ("HIXL_ACCESS_", "HIXL_REQ_", "HIXL_TIMEOUT_DEFAULT", "HIXL_00")
TESTING = DOCS / "TESTING.md"
TESTING_VARS = "## Variables of the tests, benchmarks and CI"


def _variables_named_in(files: list[Path]) -> set[str]:
    statuses = {f"HIXL_{s.name}" for s in hixl.Status}
    names: set[str] = set()
    for f in files:
        if "target" in f.parts or not f.is_file():
            continue
        names |= set(re.findall(r"\bHIXL_[A-Z0-9_]+", f.read_text(errors="replace")))
    names -= statuses | NOT_ENV
    return {n for n in names if not n.startswith(NOT_ENV_PREFIX)}


def _env_rows(text: str) -> dict[str, str]:
    """The variables of a table's rows (its first cell may name several), each with the
    row's meaning (the third cell)."""
    rows = {}
    for line in text.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `HIXL_") and len(cells) >= 3:
            for name in re.findall(r"`(HIXL_[A-Z0-9_]+)`", cells[0]):
                assert name not in rows, f"{name} has two rows"
                rows[name] = cells[2]
    return rows


def test_every_environment_variable_has_one_row_where_its_reader_is() -> None:
    """Every HIXL_* variable the code, scripts, tests or benches name has one row: in the
    README's Environment table when the package reads it and a user may set it, in
    docs/TESTING.md's variables table when only the tests, benchmarks, build scripts or CI
    read it, or when it is a test hook of the package (its row says "Test hook" or "Test
    fault"). A variable added without its row, a row in both tables, a test-only variable in
    the README and a row naming a variable nothing reads fail here."""
    root = README.parent
    files = [root / ".ci" / "run"]
    for sub in ("python", "crates", "scripts", "tests", "benches", "examples"):
        for ext in ("*.py", "*.rs", "*.sh"):
            files += (root / sub).rglob(ext)
    shipped_files = [*(root / "python" / "hixl").rglob("*.py")]
    shipped_files += [
        f
        for f in (root / "crates").glob("*/src/**/*.rs")
        if f.name != "tests.rs" and not f.name.endswith("_tests.rs")
    ]
    named = _variables_named_in(files)
    shipped = _variables_named_in(shipped_files)
    assert "HIXL_LOG_LEVEL" in shipped and "HIXL_SOAK_SECONDS" in named - shipped
    env = README.read_text().split("## Environment", 1)[1].split("\n## ", 1)[0]
    user = _env_rows(env)
    testing = _env_rows(TESTING.read_text().split(TESTING_VARS, 1)[1].split("\n## ", 1)[0])

    # The discovery options' variables are written as HIXL_DISCOVERY_<NAME> in the code.
    def discovery(n: str) -> bool:
        return n.startswith("HIXL_DISCOVERY_")

    missing = sorted(n for n in named if n not in user and n not in testing and not discovery(n))
    assert not missing, (
        f"environment variables without a row (README or docs/TESTING.md): {missing}"
    )
    both = sorted(set(user) & set(testing))
    assert not both, f"variables with a row in both the README and docs/TESTING.md: {both}"
    test_only = sorted(n for n in user if n not in shipped and not discovery(n))
    assert not test_only, f"README rows of variables the package never reads: {test_only}"
    unmarked = sorted(
        n for n, meaning in testing.items() if n in shipped and not meaning.startswith("Test ")
    )
    assert not unmarked, (
        f"docs/TESTING.md rows of package variables not marked Test hook: {unmarked}"
    )
    stale = sorted(n for n in [*user, *testing] if n not in named and not discovery(n))
    assert not stale, f"rows of variables nothing reads: {stale}"


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
