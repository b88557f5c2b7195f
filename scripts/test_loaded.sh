#!/usr/bin/env bash
# The Python suite on a busy machine: two CPU-bound processes run beside it for the whole
# time, and the suite must pass RUNS times in a row (default 3). Use it to check that the
# tests wait for conditions with deadlines rather than trusting the scheduler's punctuality.
#
#   bash scripts/test_loaded.sh            # 3 runs of scripts/test.sh, two busy loops beside
#   RUNS=1 bash scripts/test_loaded.sh -k kv   # extra arguments go to pytest
#
# Expects the hixl wheel installed in the environment, as scripts/test.sh does. Stops at the
# first failing run and says which.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
busy=()
for _ in 1 2; do
  sh -c 'while :; do :; done' &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
for i in $(seq 1 "$RUNS"); do
  echo "=== loaded run $i of $RUNS ($(cut -d' ' -f1-3 /proc/loadavg) load)"
  start=$SECONDS
  if ! bash scripts/test.sh "$@"; then
    echo "loaded run $i of $RUNS failed" >&2
    exit 1
  fi
  echo "=== loaded run $i passed in $((SECONDS - start)) s"
done
echo "all $RUNS loaded runs passed"
