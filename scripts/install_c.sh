#!/usr/bin/env bash
# Installs hixl's C library under PREFIX (default /usr/local): lib/libhixl.so.0.1.0 with its
# soname link libhixl.so.0 and dev link libhixl.so, lib/libhixl.a, include/hixl.h and
# lib/pkgconfig/hixl.pc. Builds it first (cargo build --release -p hixl-c).
#   scripts/install_c.sh /opt/hixl && PKG_CONFIG_PATH=/opt/hixl/lib/pkgconfig pkg-config --libs hixl
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="$(realpath -m "${1:-/usr/local}")"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
cargo build --release -q -p hixl-c
target="${CARGO_TARGET_DIR:-target}/release"
install -d "$prefix/lib/pkgconfig" "$prefix/include"
install -m 0755 "$target/libhixl.so" "$prefix/lib/libhixl.so.$version"
ln -sfn "libhixl.so.$version" "$prefix/lib/libhixl.so.0"
ln -sfn "libhixl.so.0" "$prefix/lib/libhixl.so"
install -m 0644 "$target/libhixl.a" "$prefix/lib/libhixl.a"
install -m 0644 crates/hixl-c/include/hixl.h "$prefix/include/hixl.h"
cat > "$prefix/lib/pkgconfig/hixl.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: hixl
Description: One-sided, batched transfers of registered memory between processes and hosts
Version: $version
Libs: -L\${libdir} -lhixl
Libs.private: -lpthread -ldl -lm
Cflags: -I\${includedir}
PC
echo "installed hixl $version under $prefix"
