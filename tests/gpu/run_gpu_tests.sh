#!/usr/bin/env bash
# Runs the memory-grant tests on a machine with an NVIDIA GPU and driver, as is:
#   tests/gpu/run_gpu_tests.sh            (BUILD_DIR=... to choose the build directory)
# Builds the GPU test programs (and libbubble under them) and runs: the grant test for cuda-vmm and
# cuda-ipc (lend, grant, a kernel in a second process writes a pattern, the trainer checks it,
# revoke, and the device memory comes back when the lender goes; with 2+ GPUs also from the last
# GPU to a task that sees only that one, as the agent launches tasks; and the lender's work on
# another thread during a graph capture in global mode, which must stay intact); GPU-timed bubbles on a real
# stream; the NCCL pipeline example (2+ GPUs).
# Exit 0 only if all passed; a test that cannot run here (exit 77) is reported as skipped. It
# needs only the CUDA Toolkit (nvcc, cudart, NCCL for the pipeline), CMake and a C++ compiler: the
# agent, the bindings and the benchmarks are not built.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build-gpu}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "no NVIDIA GPU is visible here (nvidia-smi -L failed): run this on a GPU machine" >&2
  exit 1
fi
nvcc=${CUDACXX:-}
if [ -z "$nvcc" ]; then nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); fi
if [ ! -x "$nvcc" ]; then
  echo "nvcc not found: install the CUDA Toolkit or set CUDACXX" >&2
  exit 1
fi

# The toolkit of that nvcc for headers and cudart as well, not another one that happens to be
# at /usr/local/cuda.
toolkit=$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_COMPILER="$nvcc" \
  -DCUDAToolkit_ROOT="$toolkit" -DBUBBLE_GPU_TESTS_ONLY=ON -DBUBBLE_BUILD_DAEMON=OFF \
  -DBUBBLE_BUILD_BINDINGS=OFF -DBUBBLE_BUILD_BENCH=OFF
cmake --build "$build" -j"$(nproc)" --target bubble_grant_gpu_test bubble_stream_timing_gpu_test
status=0
# Runs one test program; exit 77 means it cannot run here (it says why), not a failure.
run() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 77 ]; then
    echo "-- skipped"
  elif [ "$rc" -ne 0 ]; then
    echo "-- FAILED (exit $rc)"
    status=1
  fi
}
exe=$(find "$build" -type f -name bubble_grant_gpu_test -perm -u+x | head -n1)
for backend in cuda-vmm cuda-ipc; do
  echo "== $backend"
  run "$exe" "$backend"
done

# GPU-timed bubbles: marks on a stream behind real kernels.
echo "== stream timing"
run "$(find "$build" -type f -name bubble_stream_timing_gpu_test -perm -u+x | head -n1)"

# The NCCL pipeline example: stages passing activations with NCCL send/recv, bubbles found by
# the NCCL profiler plugin alone, a CUDA side task per stage using its memory grant. It needs one
# GPU per stage.
gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if [ "$gpus" -lt 2 ]; then
  echo "== nccl pipeline: skipped, it needs 2 GPUs and this machine has $gpus"
elif cmake --build "$build" -j"$(nproc)" --target nccl_pipeline nccl_side_task nccl_profiler_bubble; then
  pipeline=$(find "$build" -type f -name nccl_pipeline -perm -u+x | head -n1)
  echo "== nccl pipeline ($gpus GPUs)"
  run "$pipeline" --stages 2 --side-tasks
else
  echo "nccl pipeline example did not build (is NCCL installed with the CUDA Toolkit?)" >&2
  status=1
fi
exit $status
