#!/usr/bin/env bash
# CI job: safeattn as a user installs it, against the oldest torch it supports. In a second
# environment (requirements-oldest.txt, cached outside the clone like scripts/env.sh's), it
# builds the sdist, installs it with --no-build-isolation (CPU kernels only, SAFEATTN_CUDA=0, the
# default CPU ISA) into a folder outside the clone, and from the unpacked sdist imports it, runs
# `python -m safeattn info` and the op tests that the sdist carries (scripts/op_tests_installed.sh).
#
#   bash scripts/ci_oldest_torch.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
SAFEATTN_REQUIREMENTS="$root/requirements-oldest.txt" SAFEATTN_ENV_ONLY=1 source scripts/env.sh
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "== oldest torch: $(python -c 'import torch; print("torch", torch.__version__, "C++11 ABI", torch._C._GLIBCXX_USE_CXX11_ABI)')"

echo "== sdist"
log="$work/build.log"
SAFEATTN_CUDA=0 python setup.py -q sdist -d "$work/dist" >"$log" 2>&1 || { cat "$log"; exit 1; }
sdist="$(echo "$work"/dist/safeattn-*.tar.gz)"

echo "== pip install --no-build-isolation $(basename "$sdist")"
t0=$SECONDS
# The default CPU ISA only (SAFEATTN_CPU_ISAS): the AVX2 / AVX512 variants are the same sources
# with other flags, built and tested by scripts/test.sh; here they cost two minutes of CI.
SAFEATTN_CUDA=0 SAFEATTN_CPU_ISAS=DEFAULT python -m pip install -q --no-build-isolation --no-deps --no-cache-dir \
  --target "$work/site" "$sdist" \
  >"$log" 2>&1 || { cat "$log"; exit 1; }
echo "built and installed in $((SECONDS - t0)) s"

# From the unpacked sdist (its tests, and the generator that one of them runs), which has no
# built _C: the safeattn imported is the installed one.
tar xzf "$sdist" -C "$work"
PYTHONPATH="$work/site" bash scripts/op_tests_installed.sh "$work/$(basename "$sdist" .tar.gz)" "$work/site" "$@"
