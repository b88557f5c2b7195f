#!/usr/bin/env bash
# Builds what `pip install hixl` downloads: an abi3 wheel (CPython >= 3.11) per Linux
# architecture, tagged manylinux_2_28 (glibc >= 2.28: RHEL/Rocky/Alma 8, Ubuntu 20.04,
# Debian 11 and newer), plus the sdist, into dist/ (or $HIXL_WHEEL_OUT). No container:
# maturin links with zig (pip package ziglang) against glibc 2.28's symbol versions, whatever
# glibc this machine has. Then `auditwheel show` must confirm each wheel's tag, or this fails.
#
#   bash scripts/build_wheels.sh                  # x86_64, aarch64 when its Rust target is
#                                                 # installed (rustup target add ...), sdist
#   HIXL_WHEEL_ARCHS="x86_64 aarch64" bash scripts/build_wheels.sh   # exactly these (must build)
#
# Needs: rustup/cargo, and in the active Python environment maturin, ziglang and auditwheel
# (pip install "maturin>=1.5,<2" ziglang auditwheel). Prints the path of each file it made.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${HIXL_WHEEL_OUT:-dist}
GLIBC=2_28 # the manylinux_2_28 policy; no wheel may need newer glibc symbols than this
PY=${PYTHON:-python}

for m in maturin ziglang auditwheel; do
  "$PY" -c "import $m" 2>/dev/null || {
    echo "build_wheels.sh: $m is missing: pip install 'maturin>=1.5,<2' ziglang auditwheel" >&2
    exit 2
  }
done

installed=$(rustup target list --installed 2>/dev/null || true)
if [ -n "${HIXL_WHEEL_ARCHS:-}" ]; then
  archs=$HIXL_WHEEL_ARCHS
else
  archs=x86_64
  if grep -qx aarch64-unknown-linux-gnu <<<"$installed"; then
    archs+=" aarch64"
  else
    echo "build_wheels.sh: no aarch64 wheel: the Rust target is not installed" \
      "(rustup target add aarch64-unknown-linux-gnu); the release workflow builds it" >&2
  fi
fi

rm -rf "$OUT"
mkdir -p "$OUT"
for arch in $archs; do
  target=$arch-unknown-linux-gnu
  grep -qx "$target" <<<"$installed" || rustup target add "$target"
  echo "--- wheel: $target, manylinux_$GLIBC (zig)"
  "$PY" -m maturin build --release --locked --zig --compatibility "manylinux_$GLIBC" \
    --target "$target" -o "$OUT"
done
echo "--- sdist"
"$PY" -m maturin sdist -o "$OUT"

# Each wheel: abi3, and auditwheel finds it consistent with manylinux_2_28 or older for its
# architecture (a symbol from a newer glibc, or a library outside the manylinux set, fails).
for arch in $archs; do
  whl=$(ls "$OUT"/hixl-*-abi3-*"_$arch".whl)
  report=$("$PY" -m auditwheel show "$whl")
  echo "$report"
  tag=$(tr '\n' ' ' <<<"$report" | grep -oE 'following platform tag: "[^"]+"' | cut -d'"' -f2 || true)
  minor=$(sed -nE "s/^manylinux_2_([0-9]+)_$arch\$/\\1/p" <<<"$tag")
  if [ -z "$minor" ] || [ "$minor" -gt "${GLIBC#2_}" ]; then
    echo "build_wheels.sh: $whl: auditwheel says '${tag:-no manylinux tag}', want" \
      "manylinux_${GLIBC}_$arch or older" >&2
    exit 1
  fi
  echo "auditwheel: $(basename "$whl") is $tag"
done
ls -1 "$OUT"/*
