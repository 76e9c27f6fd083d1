#!/usr/bin/env bash
# Installs what libbubble needs (Debian bookworm, as root), then configures and builds a preset.
# Run by examples/demo.sh, tests/run.sh and bench/run_all.sh.
# usage: .ci/setup.sh [preset]  (default: release); .ci/setup.sh --packages installs only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset="${1:-release}"

packages=(build-essential cmake pkg-config clang libclang-rt-14-dev
          libuv1-dev capnproto libcapnp-dev doctest-dev libsqlite3-dev
          golang-go bindgen python3 python3-pytest python3-torch
          iceoryx libiceoryx-binding-c-dev libgrpc++-dev protobuf-compiler-grpc
          libprotobuf-dev)  # only recommended by libgrpc++-dev, but the gRPC peer needs it
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== installing: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing Debian packages (${missing[*]}); run as root or install them first" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

[ "$preset" = --packages ] && exit 0

# The CUDA Toolkit is not a Debian package: every build compiles and links the CUDA code (no GPU
# is needed; the driver is loaded at run time). Say so at once rather than as CMake's error.
if [ -z "${CUDAToolkit_ROOT:-}" ] && [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc > /dev/null; then
  echo "error: the CUDA Toolkit was not found (no /usr/local/cuda/bin/nvcc, no nvcc on PATH):" >&2
  echo "  install it from NVIDIA's CUDA repository for Debian 12 (it goes to /usr/local/cuda; NCCL" >&2
  echo "  is optional), or set CUDAToolkit_ROOT to where it is. No GPU is needed." >&2
  exit 1
fi

# cargo from rustup lives in ~/.cargo/bin, which a login shell may not have put on PATH; the
# configure step looks for it there too (the Rust binding tests need it).
if ! command -v cargo > /dev/null && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  export PATH="${HOME:-/root}/.cargo/bin:$PATH"
fi

echo "== configuring and building (preset $preset)"
cd "$root"  # the presets are read from the current directory
cmake --preset "$preset" -S "$root" > /dev/null
cmake --build --preset "$preset" -j "$(nproc)"
