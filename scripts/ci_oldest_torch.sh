#!/usr/bin/env bash
# CI job: safeattn as a user gets it, against the oldest torch it supports. In a second environment
# (requirements-oldest.txt, cached outside the clone like scripts/env.sh's), scripts/build_wheel.sh
# builds the sdist, then a binary wheel from it with --no-build-isolation (a reduced build: CPU
# kernels only, SAFEATTN_CUDA=0, the default CPU ISA), named for that torch and checked with
# auditwheel; scripts/test_wheel.sh installs the wheel with plain pip into a fresh environment with
# no compiler on PATH and runs the op tests the sdist carries from a folder outside the clone.
#
#   bash scripts/ci_oldest_torch.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
SAFEATTN_REQUIREMENTS="$PWD/requirements-oldest.txt" SAFEATTN_ENV_ONLY=1 source scripts/env.sh
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
