#!/usr/bin/env bash
# The GPU check of hixl's CUDA paths, for a machine with a GPU and Python (torch and CuPy
# optional, no Rust toolchain needed): installs an abi3 wheel built elsewhere without its
# dependencies, runs tests/test_cuda.py and a short benchmark (scripts/gpu_check.py), and writes
# the figures as JSON, each with the path that moved its bytes. At most 6 minutes.
#
#   scripts/gpu_check.sh path/to/hixl-*.whl [figures.json]
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:?usage: scripts/gpu_check.sh WHEEL [OUT_JSON]}
out=${2:-gpu_check.json}
site=$(mktemp -d)/site
python3 -m pip install -q --no-deps --target "$site" "$wheel"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import hixl, json; print("hixl", hixl.__version__, json.dumps(hixl._hixl.cuda_info()))'
python3 -m hixl info || true
status=0
if python3 -c 'import pytest' 2>/dev/null; then
    # --noconftest: the GPU tests need none of the suite's fixtures (nor their packages).
    timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest -rs tests/test_cuda.py || status=$?
else
    echo "pytest is not installed: the GPU tests did not run" >&2
    status=3
fi
timeout 100 python3 scripts/gpu_check.py --out "$out" || status=$?
echo "figures in $out (test status $status)"
exit $status
