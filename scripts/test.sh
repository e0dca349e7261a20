#!/usr/bin/env bash
# Runs every test: the Python suite (pytest) and the C++ suite (Catch2 through CTest).
# Works on a fresh machine: sets up the environment and builds first (scripts/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# Without a GPU (CI, build hosts) the build compiles every CUDA file for one Ampere, the Hopper
# and one Blackwell target (with PTX), where setup.py's default list has six: each arch costs
# about 6 s per file on 2 cores; the machine code of 8.6 / 8.9 / 10.0 comes from the same sources.
# With a GPU, setup.py builds for it. TORCH_CUDA_ARCH_LIST, when set, decides either way.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  export TORCH_CUDA_ARCH_LIST="8.0;9.0;12.0+PTX"
fi
# Catch2 for the C++ suite; ccache, which scripts/env.sh uses to keep compiled objects between
# runs (CI's build of unchanged sources: seconds instead of about 25 minutes on 2 cores).
_missing=()
for _pkg in catch2 ccache; do
  dpkg -s "$_pkg" >/dev/null 2>&1 || _missing+=("$_pkg")
done
if [ ${#_missing[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq "${_missing[@]}") >/dev/null
fi
source scripts/env.sh
# A fresh Inductor cache: the default one (/tmp/torchinductor_$USER) outlives a run, and its key
# does not cover safeattn's ops, so it served a graph compiled for another build of safeattn
# (an op this build does not have) to the compile tests.
inductor_cache="$(mktemp -d)"
trap 'rm -rf "$inductor_cache"' EXIT
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$inductor_cache}"

echo "== pytest"
# --maxschedchunk 1: one test at a time per worker, so the slow tests that tests/conftest.py puts
# first spread over the workers.
python -m pytest tests -q -n "${PYTEST_WORKERS:-2}" --maxschedchunk 1 "$@"

# The Transformers integration against the 4.57 series (other mask keywords) and the newest
# release (continuous batching changed in 5.23): environments of their own, the same build.
for tf in 457 524; do
  echo "== pytest, requirements-tf$tf.txt (same build)"
  (SAFEATTN_REQUIREMENTS="requirements-tf$tf.txt" SAFEATTN_SKIP_BUILD=1 source scripts/env.sh &&
    python -m pytest tests/test_transformers.py tests/test_transformers_masks.py tests/test_transformers_paged.py \
      -q -n "${PYTEST_WORKERS:-2}" --maxschedchunk 1)
done

echo "== C++ tests (Catch2 + CTest)"
# The default ISA only: the C++ suite tests the API from C++, and pytest above ran every ISA
# variant of the same sources (three variants here cost CI minutes: 12 kernel compiles for 4).
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build/cmake -G Ninja -DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda -DSAFEATTN_CPU_ISAS=DEFAULT "${launcher[@]}" \
  -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build build/cmake -j"$(nproc)"
ctest --test-dir build/cmake --output-on-failure --no-tests=error
