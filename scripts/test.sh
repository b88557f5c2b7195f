#!/usr/bin/env bash
# The Python test command (the README's); expects the hixl wheel installed in the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider --timeout=300 tests "$@"
