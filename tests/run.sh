#!/usr/bin/env bash
# Runs every libbubble test: installs missing Debian packages, configures and builds the release
# preset, then runs the whole CTest suite (unit, multi-process, protocol, agent, bindings).
#
#   bash tests/run.sh [ctest arguments, e.g. -R process/]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/.ci/setup.sh" release
cd "$root/build/release"
ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
