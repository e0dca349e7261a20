#!/usr/bin/env bash
# CI job: safeattn as a binary wheel. In its own environment (requirements-wheel.txt: the CPU
# build of torch, cached outside the clone like scripts/env.sh's), scripts/build_wheel.sh builds
# a reduced wheel (CPU kernels only, SAFEATTN_CUDA=0, the default CPU ISA; named
# +cputorch<release>cxx11abiTRUE) and checks it with auditwheel; scripts/test_wheel.sh installs
# it with pip into a fresh environment with no compiler on PATH and runs the op tests from a
# folder outside the clone.
#
#   bash scripts/ci_wheel.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
SAFEATTN_REQUIREMENTS="$PWD/requirements-wheel.txt" SAFEATTN_ENV_ONLY=1 source scripts/env.sh
dist="$(mktemp -d)"
trap 'rm -rf "$dist"' EXIT
t0=$SECONDS
# The AVX2 / AVX512 variants are the same sources with other flags, built and tested by
# scripts/test.sh; here they would cost two minutes of CI.
SAFEATTN_CUDA=0 SAFEATTN_CPU_ISAS=DEFAULT bash scripts/build_wheel.sh "$dist"
echo "wheel built and checked in $((SECONDS - t0)) s"
t0=$SECONDS
bash scripts/test_wheel.sh "$(ls "$dist"/safeattn-*.whl)" "$@"
echo "wheel installed and tested in $((SECONDS - t0)) s"
