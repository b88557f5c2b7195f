#!/usr/bin/env bash
# Runs one command inside a small VM whose kernel has soft-RoCE (rdma_rxe): a real kernel RDMA
# stack and the real libibverbs, for testing hixl's verbs provider on a machine without an RDMA
# NIC or an rxe-capable kernel. The guest runs under qemu (TCG, no KVM needed); its root is this
# machine's own filesystem, read-only over virtio-9p, with a writable overlay over /tmp; no
# network leaves the VM (-nic none, or one virtio-net link to a second VM on host loopback).
#
#   scripts/rxe_vm.sh setup                        fetch the kernel, build the initramfs
#   scripts/rxe_vm.sh run [opts] -- CMD [ARG...]   boot, run CMD in the guest (cwd kept), exit with its status
#   scripts/rxe_vm.sh pair [opts] -- CMD_A -- CMD_B  two VMs, each its own NIC and rxe0 on it, joined
#                                                  by a virtio-net link; A is 192.0.2.1, B 192.0.2.2
#
# Options of run/pair: --timeout S (whole VM, default 600), --mem M (MiB, default 3072),
# --smp N (default 2), --rails N (rxe devices rxe0..rxeN-1, default 1), --out DIR (a folder of
# this machine the guest may write, at the same path; everything else is read-only there).
# In the guest: rxe0 on netdev v0 (192.0.2.1/24; a veth pair on one VM, virtio-net on a pair),
# HIXL_VM=1, HIXL_VM_IP=<its address> and HIXL_VM_OUT=<a writable folder> in the environment, GID index 1 is the IPv4-mapped one.
# Needs (Debian): qemu-system-x86 busybox-static cpio kmod ibverbs-providers rdma-core iproute2.
# The kernel is Debian's linux-image-amd64 of this release, unpacked (not installed) into
# $HIXL_VM_DIR (default target/rxe-vm).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
vmdir=${HIXL_VM_DIR:-$here/target/rxe-vm}
# The modules the guest loads, in this order (modprobe resolves each one's dependencies).
# crc32_generic is not a dependency of rdma_rxe but rxe asks the crypto API for it at start.
MODULES="virtio_pci 9pnet_virtio 9p overlay veth virtio_net crc32_generic rdma_rxe ib_uverbs"

die() { echo "rxe_vm: $*" >&2; exit 2; }

setup() {
  mkdir -p "$vmdir"
  command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (apt-get install qemu-system-x86)"
  [ -x /bin/busybox ] && /bin/busybox --list | grep -x insmod >/dev/null || die "busybox-static missing"
  if [ ! -e "$vmdir/kernel.ok" ]; then
    local pkg
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    if [ -z "$pkg" ] && [ "$(id -u)" = 0 ]; then
      apt-get update -qq >/dev/null 2>&1 || true
      pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    fi
    [ -n "$pkg" ] || die "apt-cache names no kernel for linux-image-amd64 (apt-get update first)"
    rm -rf "$vmdir/kernel" "$vmdir"/*.deb
    (cd "$vmdir" && apt-get download "$pkg" >/dev/null 2>&1) || die "apt-get download $pkg failed"
    dpkg -x "$vmdir"/"$pkg"_*.deb "$vmdir/kernel"
    rm -f "$vmdir"/*.deb
    touch "$vmdir/kernel.ok"
  fi
  local kver
  kver=$(ls "$vmdir/kernel/lib/modules")
  [ -e "$vmdir/kernel/lib/modules/$kver/modules.dep" ] || depmod -b "$vmdir/kernel" "$kver"
  local root="$vmdir/initramfs"
  rm -rf "$root" && mkdir -p "$root"/{bin,proc,sys,dev,host,mods,ovl}
  cp /bin/busybox "$root/bin/busybox"
  : >"$root/modules.order"
  local m line
  for m in $MODULES; do
    # --show-depends: "insmod /path/x.ko" lines, dependencies first.
    while read -r line; do
      line=${line#insmod }
      line=${line%% *}
      local base
      base=$(basename "$line")
      grep -qx "$base" "$root/modules.order" && continue
      cp "$line" "$root/mods/$base"
      echo "$base" >>"$root/modules.order"
    done < <(modprobe -d "$vmdir/kernel" -S "$kver" --show-depends "$m" | grep '^insmod')
  done
  cp "$here/scripts/rxe_vm_init.sh" "$root/init"
  chmod +x "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) >"$vmdir/initrd.gz"
  ln -sf "kernel/boot/vmlinuz-$kver" "$vmdir/vmlinuz"
}

# boot OUT NAME NIC_ARGS...: one VM; its command is OUT/cmd.sh; console to OUT/console.
boot() {
  local out=$1 ip=$2; shift 2
  qemu-system-x86_64 -accel tcg -cpu max -smp "$smp" -m "$mem" -display none -monitor none \
    -serial "file:$out/console" -no-reboot \
    -kernel "$vmdir/vmlinuz" -initrd "$vmdir/initrd.gz" \
    -append "console=ttyS0 quiet loglevel=3 panic=-1 hixl_out=$out hixl_ip=$ip hixl_rails=$rails hixl_keep=$keep" \
    -virtfs local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$out,mount_tag=out,security_model=none" \
    ${keep:+-virtfs "local,path=$keep,mount_tag=keep,security_model=none"} "$@" </dev/null
}

# cmdfile OUT ARG...: writes the guest's command (cwd and the arguments, quoted).
cmdfile() {
  local out=$1; shift
  { printf 'export PATH=%q\n' "$PATH"; printf 'cd %q || exit 125\n' "$PWD"; printf '%q ' "$@"; echo; } >"$out/cmd.sh"
}

# finish OUT: prints what the guest printed, returns its command's status (124: VM timed out).
finish() {
  local out=$1
  [ -e "$out/log" ] && cat "$out/log"
  local rc
  rc=$(cat "$out/rc" 2>/dev/null || true)
  if [[ $rc =~ ^[0-9]+$ ]]; then return "$rc"; fi
  echo "rxe_vm: the guest ended without a status; its console:" >&2
  tail -n 40 "$out/console" >&2 || true
  return 124
}

timeout_s=600 mem=3072 smp=2 rails=1 keep=
parse_opts() {
  while [ $# -gt 0 ]; do
    case $1 in
      --timeout) timeout_s=$2; shift 2 ;;
      --mem) mem=$2; shift 2 ;;
      --smp) smp=$2; shift 2 ;;
      --rails) rails=$2; shift 2 ;;
      --out) keep=$(cd "$2" && pwd); shift 2 ;;
      --) shift; rest=("$@"); return ;;
      *) die "unknown option '$1' (see the head of $0)" ;;
    esac
  done
  die "no command: $0 run [opts] -- CMD"
}

# fresh: (re)builds the initramfs when it is missing or older than its init script or this one.
fresh() {
  if [ ! -e "$vmdir/initrd.gz" ] || [ "$here/scripts/rxe_vm_init.sh" -nt "$vmdir/initrd.gz" ] \
    || [ "$here/scripts/rxe_vm.sh" -nt "$vmdir/initrd.gz" ]; then
    setup
  fi
}

newout() { local d; d=$(mktemp -d "${TMPDIR:-/tmp}/rxe-vm.XXXXXX"); chmod 777 "$d"; echo "$d"; }

# On any exit (Ctrl-C and an outer timeout included): no qemu and no temp folder left behind.
outs=() vms=()
cleanup() {
  local p
  for p in "${vms[@]}"; do kill "$p" 2>/dev/null || true; done
  [ ${#outs[@]} -gt 0 ] && rm -rf "${outs[@]}"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

case ${1:-} in
  setup) setup ;;
  run)
    shift; parse_opts "$@"
    fresh
    out=$(newout)
    outs+=("$out")
    cmdfile "$out" "${rest[@]}"
    timeout --kill-after=5 "$timeout_s" bash -c "$(declare -f boot); vmdir=$vmdir smp=$smp mem=$mem rails=$rails keep=$keep; boot $out 192.0.2.1 -nic none" || true
    st=0; finish "$out" || st=$?
    rm -rf "$out"
    exit "$st"
    ;;
  pair)
    shift; parse_opts "$@"
    fresh
    a=() b=() seen=0
    for x in "${rest[@]}"; do
      if [ "$x" = "--" ] && [ $seen = 0 ]; then seen=1; continue; fi
      if [ $seen = 0 ]; then a+=("$x"); else b+=("$x"); fi
    done
    [ ${#b[@]} -gt 0 ] || die "pair needs two commands: -- CMD_A -- CMD_B"
    outa=$(newout) outb=$(newout)
    outs+=("$outa" "$outb")
    cmdfile "$outa" "${a[@]}"; cmdfile "$outb" "${b[@]}"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    fns="$(declare -f boot); vmdir=$vmdir smp=$smp mem=$mem rails=$rails keep=$keep"
    timeout --kill-after=5 "$timeout_s" bash -c "$fns; boot $outa 192.0.2.1 \
      -netdev socket,id=n0,listen=127.0.0.1:$port -device virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01" &
    pa=$!
    vms+=("$pa")
    # B's qemu connects at start: wait until A's is listening (ss, not a probe connection,
    # which A's qemu would take for its peer).
    for _ in $(seq 100); do
      ss -Hltn "sport = :$port" 2>/dev/null | grep . >/dev/null && break
      sleep 0.1
    done
    timeout --kill-after=5 "$timeout_s" bash -c "$fns; boot $outb 192.0.2.2 \
      -netdev socket,id=n0,connect=127.0.0.1:$port -device virtio-net-pci,netdev=n0,mac=52:54:00:00:00:02" &
    pb=$!
    vms+=("$pb")
    wait $pa || true; wait $pb || true
    sa=0 sb=0
    echo "=== host A (192.0.2.1)"; finish "$outa" || sa=$?
    echo "=== host B (192.0.2.2)"; finish "$outb" || sb=$?
    rm -rf "$outa" "$outb"
    echo "rxe_vm: A exited $sa, B exited $sb"
    [ $sa = 0 ] && [ $sb = 0 ]
    ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
