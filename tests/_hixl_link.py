"""A directory that puts this test run's own hixl, and nothing else of this environment, on
another interpreter's path (the vLLM tests' engines run in a venv of their own)."""

from __future__ import annotations

from pathlib import Path

import hixl


def hixl_dir(tmp: Path) -> Path:
    """`tmp`/hixl-path, holding only `hixl`: a link to the package this process imports (the
    source tree's, or the installed wheel's)."""
    d = tmp / "hixl-path"
    link = d / "hixl"
    if not link.exists():
        d.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(hixl.__file__).resolve().parent)
    return d
