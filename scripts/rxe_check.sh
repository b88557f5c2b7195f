#!/usr/bin/env bash
# The RDMA suites on a real verbs stack: the kernel's soft-RoCE (rdma_rxe) in the VM of
# scripts/rxe_vm.sh, with hixl's real provider (libibverbs loaded at run time) on rxe0.
# Runs there: the cross-process Rust suites (crates/hixl-core/tests/rdma.rs, rdma_verbs.rs:
# bytes moved and compared, scattered, READ, notify after data, remote access errors raised by
# the NIC, QP error and re-post, deregistration in flight, a peer killed, one poller thread),
# the multi-rail suite (crates/hixl-core/tests/rdma_rails.rs on rxe0,rxe1: a large WRITE and
# READ striped across both rails, small requests on one rail each), the Python end-to-end
# tests (tests/test_rdma.py, hixl.backends=rdma) with PYTHON, `hixl info` (the device's limits
# and the queue sizes used on it), failover (rdma_failover.rs: rxe0's netdev taken down
# mid-transfer and up again, the requests moved to tcp) and last rxe1's netdev taken down
# mid-transfer (the rail is left out and every byte arrives over rxe0); then two hosts
# (scripts/rxe_pair_check.py in two VMs joined by one virtio-net link).
#
#   scripts/rxe_check.sh [PYTHON]     PYTHON: an interpreter with hixl installed (default python3)
#
# Needs cargo (the test binaries are built here, then run in the guest) and what
# scripts/rxe_vm.sh needs. Exit status: the guest's (0: every suite passed).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
py=$(command -v "$py")
all=$(cargo test -p hixl-core --release --test rdma --test rdma_verbs --test rdma_rails --test rdma_failover \
  --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    names = ("rdma", "rdma_verbs", "rdma_rails", "rdma_failover")
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] in names and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
bins=$(echo "$all" | awk '$1 == "rdma" || $1 == "rdma_verbs" {print $2}')
rails=$(echo "$all" | awk '$1 == "rdma_rails" {print $2}')
failover=$(echo "$all" | awk '$1 == "rdma_failover" {print $2}')
[ "$(echo "$bins" | wc -l)" = 2 ] && [ -n "$rails" ] && [ -n "$failover" ] \
  || { echo "rxe_check: the rdma test binaries were not built" >&2; exit 2; }
# shellcheck disable=SC2016 # expanded in the guest
guest='set -e
echo "--- ibv_devinfo"; ibv_devinfo -d rxe0 -v | grep -E "hca_id|max_cqe|max_qp_wr|max_sge|max_qp_rd_atom|state|active_mtu"
for b in $BINS; do echo "--- $(basename "$b")"; "$b" --test-threads=1; done
echo "--- $(basename "$RAILS") on rxe0,rxe1"; HIXL_RDMA_DEVICE=rxe0,rxe1 "$RAILS" --test-threads=1 --skip a_rail
echo "--- tests/test_rdma.py"; "$PY" -m pytest -q -p no:cacheprovider tests/test_rdma.py -rs
echo "--- hixl info"; "$PY" -m hixl info | grep -E "^  rdma "
"$PY" -m hixl info | grep -qE "^  rdma +yes .*rxe0 \(port 1 active; device max_cqe [0-9]+ .*hixl uses CQ [0-9]+ SQ"
echo "--- $(basename "$FAILOVER"): rxe0 (its netdev v0) taken down mid-transfer, then up"; "$FAILOVER" --test-threads=1
echo "--- $(basename "$RAILS"): rxe1 (its netdev v1) taken down mid-transfer (last: it stays down)"
HIXL_RDMA_DEVICE=rxe0,rxe1 HIXL_RAILS_DOWN=v1 "$RAILS" --test-threads=1 --exact a_rail_that_fails_mid_transfer_is_left_out_and_its_parts_complete_on_the_other'
scripts/rxe_vm.sh run --rails 2 --timeout 480 -- env HIXL_RDMA_DEVICE=rxe0 HIXL_RDMA_GID_INDEX=1 \
  PYTHONDONTWRITEBYTECODE=1 BINS="$(echo $bins)" RAILS="$rails" FAILOVER="$failover" PY="$py" sh -c "$guest"
# Two hosts: two VMs, each its own NIC and rxe0, the target's VM powered off mid-transfer.
secret=$("$py" -c 'import secrets; print(secrets.token_hex(16))')
pair=(env HIXL_SECRET="$secret" PYTHONDONTWRITEBYTECODE=1 "$py" scripts/rxe_pair_check.py)
scripts/rxe_vm.sh pair --timeout 300 -- "${pair[@]}" initiator -- "${pair[@]}" target
