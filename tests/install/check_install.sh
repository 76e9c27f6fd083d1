#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, then builds and runs a consumer through
# find_package(bubble) (shared and static) and through pkg-config.
set -euo pipefail
build="$1"; src="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d /tmp/bubble-install-XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
export BUBBLE_RUNTIME_DIR="$tmp/run"
cmake -S "$src/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$tmp/prefix" > /dev/null
cmake --build "$tmp/consumer" > /dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/consumer/consumer"
"$tmp/consumer/consumer_static"
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
cc "$src/consumer/main.c" -o "$tmp/pc" $(pkg-config --cflags --libs bubble)
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/pc"
test -f "$tmp/prefix/include/bubble/bubble.h"
echo "install: find_package, static, pkg-config all work"
