#!/bin/sh
# Prints the Rust bindings of bubble.h on stdout. Regenerate after changing the header with
#   ./bindgen.sh > src/bindings.rs
# tests/bindings_fresh.rs runs this same script and fails when the checked-in file differs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
include=${BUBBLE_INCLUDE_DIR:-$here/../../../capi/include}
exec "${BINDGEN:-bindgen}" "$include/bubble/bubble.h" \
  --allowlist-function 'bb_.*' --allowlist-type 'bb_.*' --allowlist-var 'BB_.*' \
  --no-prepend-enum-name --no-doc-comments --size_t-is-usize --rustified-enum 'bb_(bubble_kind|on_trainer_exit|wake_mode)' \
  -- -I"$include"
