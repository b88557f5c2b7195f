"""What a registry page and `pip install hixl` rely on, read from the installed distribution:
`python -m hixl`, the metadata (classifiers, URLs, license file, keywords, a Markdown readme)
and the documented extras. scripts/build_wheels.sh checks the wheel's platform tag."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import hixl

DIST = metadata.distribution("hixl")


def test_python_dash_m_hixl_is_the_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hixl", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"hixl {hixl.__version__}"


def test_metadata_for_a_registry_page() -> None:
    md = DIST.metadata
    assert md["Version"] == hixl.__version__
    assert md["Description-Content-Type"] == "text/markdown"
    assert "## Install" in (DIST.read_text("METADATA") or "")  # the README, rendered
    assert "Apache-2.0" in (md["License"] or md["License-Expression"] or "")
    classifiers = md.get_all("Classifier") or []
    for c in (
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Rust",
        "Typing :: Typed",
    ):
        assert c in classifiers
    urls = dict(u.split(", ", 1) for u in md.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert "kv-cache" in (md["Keywords"] or "")
    assert md.get_all("License-File") == ["LICENSE"]
    assert any(str(f).endswith("LICENSE") for f in DIST.files or [])


def test_extras_are_the_documented_ones() -> None:
    extras = set(DIST.metadata.get_all("Provides-Extra") or [])
    assert {"plot", "metrics", "torch", "test"} <= extras
    reqs = DIST.requires or []
    assert any(r.startswith("matplotlib") and "extra == 'plot'" in r for r in reqs)
    assert any(r.startswith("prometheus") and "extra == 'metrics'" in r for r in reqs)
    assert any(r.startswith("torch") and "extra == 'torch'" in r for r in reqs)
