#!/bin/sh
# Prints the Rust bindings of bubble.h on stdout. Regenerate after changing the header with
#   ./bindgen.sh > src/bindings.rs
# tests/bindings_fresh.rs runs this same script and fails when the checked-in file differs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
include=${BUBBLE_INCLUDE_DIR:-$here/../../../capi/include}
bindgen=${BINDGEN:-bindgen}
# size_t became usize by default in bindgen 0.64, and the flag that asked for it went in 0.65.
case $("$bindgen" --version | sed 's/^bindgen //') in
  0.[0-5]?.* | 0.6[0-3].*) size_t_is_usize=--size_t-is-usize ;;
  *) size_t_is_usize= ;;
esac
exec "$bindgen" "$include/bubble/bubble.h" \
  --allowlist-function 'bb_.*' --allowlist-type 'bb_.*' --allowlist-var 'BB_.*' \
  --no-prepend-enum-name --no-doc-comments $size_t_is_usize --rustified-enum 'bb_(bubble_kind|on_trainer_exit|wake_mode)' \
  -- -I"$include"
