#!/usr/bin/env bash
# Makes VENV a Python with Ray 2.60.0 and torch for tests/test_ray.py and benches/ray_rdt.py
# (HIXL_RAY_PYTHON=VENV/bin/python), and prints that python's path on its last line.
#   scripts/install_ray.sh VENV [WHEEL]
# VENV is created (with $PYTHON, default python3) when it has no bin/python; an existing one
# keeps what it has: first `pip install --dry-run ray==2.60.0` must change no installed package
# (else nothing is installed and the script fails, naming them). torch 2.13.0 (CPU build) is
# installed only where torch is missing. WHEEL, when given, is a hixl wheel installed into VENV
# (--no-deps) so the tests' Ray workers import that hixl; without it they import hixl from
# PYTHONPATH (the source tree's python/ with its built extension).
set -euo pipefail
venv="${1:?usage: scripts/install_ray.sh VENV [WHEEL]}"
wheel="${2:-}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
# What the dry run would change among installed packages (a "Would install" of a name that is
# installed already at another version).
changes=$("$py" - <<'PY'
import subprocess, sys
from importlib import metadata
out = subprocess.run(
    [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--report", "-", "ray==2.60.0"],
    capture_output=True, text=True, check=True,
).stdout
import json
have = {d.metadata["Name"].lower(): d.version for d in metadata.distributions()}
for item in json.loads(out).get("install", []):
    name, ver = item["metadata"]["name"].lower(), item["metadata"]["version"]
    if name in have and have[name] != ver:
        print(f"{name} {have[name]} -> {ver}")
PY
)
if [ -n "$changes" ]; then
  echo "ray==2.60.0 would change packages installed in $venv; nothing installed:" >&2
  echo "$changes" >&2
  exit 1
fi
"$py" -m pip install -q "ray==2.60.0"
if ! "$py" -c "import torch" 2>/dev/null; then
  "$py" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
fi
"$py" -c "import numpy" 2>/dev/null || "$py" -m pip install -q numpy
[ -z "$wheel" ] || "$py" -m pip install -q --no-deps --force-reinstall "$wheel"
"$py" -c "import ray, torch; print('ray', ray.__version__, 'torch', torch.__version__)" >&2
echo "$py"
