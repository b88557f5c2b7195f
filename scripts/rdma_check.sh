#!/usr/bin/env bash
# Runs the rdma backend's cross-process test suites (crates/hixl-core/tests/rdma.rs, rdma_verbs.rs) against a
# real RDMA device instead of the software provider: a NIC, or an rxe/siw device on a kernel
# that has them (rdma link add rxe0 type rxe netdev eth0). scripts/rxe_check.sh runs the same
# suites in a VM with rdma_rxe (CI does); on an RDMA NIC they have not run (see docs/RDMA.md).
#
#   HIXL_RDMA_DEVICE=mlx5_0 [HIXL_RDMA_GID_INDEX=3] [HIXL_RDMA_RAILS=mlx5_0,mlx5_1] scripts/rdma_check.sh
#
# With HIXL_RDMA_RAILS (two devices of this host, both reaching themselves) the multi-rail
# suite (tests/rdma_rails.rs) runs on them too; its rail-failure test then needs
# HIXL_RAILS_DOWN (the second device's netdev, taken down: root) and is skipped without it.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${HIXL_RDMA_DEVICE:?set HIXL_RDMA_DEVICE to a device name (ibv_devices lists them)}"
export HIXL_RDMA_DEVICE HIXL_RDMA_GID_INDEX="${HIXL_RDMA_GID_INDEX:-0}"
if command -v ibv_devinfo >/dev/null; then
  ibv_devinfo -d "$HIXL_RDMA_DEVICE" | sed -n '1,25p'
fi
echo "memlock limit: $(ulimit -l) (registrations pin memory: raise it if registering fails)"
# The real provider's C layouts against the installed header (needs libibverbs-dev).
HIXL_REQUIRE_IBVERBS_HEADER=1 cargo test -p hixl-core --release --lib rdma::verbs::ibverbs
# The cross-process suite on the device (its software-provider-only test says it skips).
cargo test -p hixl-core --release --test rdma --test rdma_verbs -- --test-threads=1 --nocapture
if [ -n "${HIXL_RDMA_RAILS:-}" ]; then
  HIXL_RDMA_DEVICE=$HIXL_RDMA_RAILS cargo test -p hixl-core --release --test rdma_rails -- --test-threads=1 --nocapture
fi
