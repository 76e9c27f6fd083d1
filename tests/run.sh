#!/usr/bin/env bash
# Runs every libbubble test. Installs missing Debian packages, configures and builds, then:
#   1. the whole CTest suite on the release build (unit, multi-process, protocol, fault
#      injection, agent, bindings, PyTorch pipeline);
#   2. the unit and multi-process tests again under AddressSanitizer+UBSan and ThreadSanitizer;
#   3. every libFuzzer target for a bounded time over its seed corpus.
#
#   bash tests/run.sh            # all of the above (about 10 minutes on 2 cores from scratch)
#   bash tests/run.sh --quick    # step 1 only
#   BUBBLE_FUZZ_SECONDS=N        # seconds per fuzz target (default 30)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"  # the presets are read from the current directory
quick=0
[ "${1:-}" = "--quick" ] && quick=1
jobs="$(nproc)"

"$root/.ci/setup.sh" release
echo "== tests: release build"
(cd "$root/build/release" && ctest --output-on-failure -j "$jobs" --timeout 900)
note_cargo() {
  if grep -q '^BB_CARGO:FILEPATH=.*NOTFOUND' "$root/build/release/CMakeCache.txt"; then
    echo "== note: cargo was not found, so the Rust binding tests and the cross-language and"
    echo "   examples runs (which include a Rust task) did not run: install Rust (rustup)"
  fi
}
if ((quick)); then
  note_cargo
  exit 0
fi

for preset in asan tsan; do
  echo "== tests: $preset build (unit, multi-process and security)"
  cmake --preset "$preset" -S "$root" > /dev/null
  cmake --build --preset "$preset" -j "$jobs" --target bubble_unit_tests bubble_process_tests \
    bb_test_task bb_test_trainer bb_hostile_task bubble_cuda_double bubble_grant_peer \
    bubble_security_tests bb_security_probe
  # Left out here: agent_limits (the agent is not built in these stages), and the tests that
  # drop a process's descriptor limit to what it holds (the hub service test to 3, the
  # at_its_descriptor_limit ones to no room at all): the sanitizers' own runtime then cannot open what
  # it needs (the pipe it probes memory with, its reports), and reports the code under test
  # falsely. The release stage runs them.
  (cd "$root/build/$preset" &&
     ctest --output-on-failure -j "$jobs" --timeout 900 -R '^(unit|process|security)/' \
       -E 'agent_limits|a_hub_service_whose_poll_fails|at_its_descriptor_limit')
done

echo "== fuzzing: ${BUBBLE_FUZZ_SECONDS:-30} s per target"
cmake --preset fuzz -S "$root" -DBUBBLE_FUZZ_SECONDS="${BUBBLE_FUZZ_SECONDS:-30}" > /dev/null
cmake --build --preset fuzz -j "$jobs" --target fuzz_hub_header fuzz_task_page fuzz_control_frame
(cd "$root/build/fuzz" && ctest --output-on-failure -j "$jobs" -L fuzz)
note_cargo
echo "== all test stages passed"
