#!/usr/bin/env bash
# CI job: the C++ sources compile for aarch64. On ARM the CPU kernels are one variant (DEFAULT),
# vectorised by ATen's at::vec, which is NEON there; no hand-written NEON. Debian's cross
# compiler checks every non-Python C++ file with -fsyntax-only against the headers of the
# development environment's torch (scripts/env.sh), with the flags setup.py uses on aarch64.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX_AARCH64="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
if ! command -v "$CXX_AARCH64" >/dev/null; then
  echo "== installing g++-aarch64-linux-gnu"
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends g++-aarch64-linux-gnu) >/dev/null
fi
SAFEATTN_ENV_ONLY=1 source scripts/env.sh
read -r -a includes < <(python -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))')
abi="$(python -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
# The C++ standard torch's headers ask for: C++20 from 2.10 on (as CMakeLists.txt), C++17 before.
std="$(python -c 'import torch; v = tuple(int(x) for x in torch.__version__.split(".")[:2]); print("c++20" if v >= (2, 10) else "c++17")')"
sources=(csrc/safeattn.cpp csrc/common/*.cpp csrc/ops/*.cpp csrc/ops/cpu/*_kernel.cpp)
echo "== $("$CXX_AARCH64" --version | head -1): -fsyntax-only, torch $(python -c 'import torch; print(torch.__version__)') headers, ${#sources[@]} files"
t0=$SECONDS
printf '%s\n' "${sources[@]}" | xargs -P "$(nproc)" -I{} "$CXX_AARCH64" -fsyntax-only -std="$std" -O3 -fopenmp -fPIC \
  -DCPU_CAPABILITY=DEFAULT -DCPU_CAPABILITY_DEFAULT -D_GLIBCXX_USE_CXX11_ABI="$abi" -DTORCH_API_INCLUDE_EXTENSION_H \
  -Wno-unknown-pragmas -Wno-psabi -Icsrc "${includes[@]}" {}
echo "aarch64: ${#sources[@]} files compile ($((SECONDS - t0)) s)"
