#!/usr/bin/env bash
# Runs the memory-grant tests on a machine with an NVIDIA GPU and driver, as is:
#   tests/gpu/run_gpu_tests.sh            (BUILD_DIR=... to choose the build directory)
# Builds the GPU test program (and libbubble under it), then runs it for cuda-vmm and cuda-ipc:
# lend, grant, a kernel in a second process writes a pattern, the trainer checks it, revoke.
# Exit 0 only if both passed.
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

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_COMPILER="$nvcc"
cmake --build "$build" -j"$(nproc)" --target bubble_grant_gpu_test
exe=$(find "$build" -type f -name bubble_grant_gpu_test -perm -u+x | head -n1)
status=0
for backend in cuda-vmm cuda-ipc; do
  echo "== $backend"
  "$exe" "$backend" || status=1
done
exit $status
