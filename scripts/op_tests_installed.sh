#!/usr/bin/env bash
# The op tests against an installed safeattn, run from a folder outside the clone that holds the
# tests (an unpacked sdist, or a copy of tests/ and the generator one of them runs), so that the
# safeattn imported is the installed one and never the source tree's. Used by
# scripts/ci_oldest_torch.sh (the sdist built against the oldest torch) and scripts/test_wheel.sh
# (a binary wheel installed by pip). `python` is the interpreter that has the installed safeattn.
#
#   bash scripts/op_tests_installed.sh TESTS_ROOT INSTALLED_DIR [pytest args]
#
# TESTS_ROOT: the folder with tests/ and scripts/gen_attention_instances.py; INSTALLED_DIR: where
# safeattn must be imported from (checked before any test runs).
set -euo pipefail
cd "$1"
installed="$2"
shift 2
inductor_cache="$(mktemp -d)"
trap 'rm -rf "$inductor_cache"' EXIT
# Inductor's cache (/tmp/torchinductor_$USER by default) outlives a run, and its key does not
# cover safeattn's ops: a graph compiled by another build of safeattn was served from it here.
export TORCHINDUCTOR_CACHE_DIR="$inductor_cache"
python - "$installed" <<'EOF'
import sys
from pathlib import Path

import safeattn

where = Path(safeattn.__file__).resolve()
assert where.is_relative_to(Path(sys.argv[1]).resolve()), f"imported {where}, not the installed copy"
print("imported", where)
EOF
python -m safeattn info

# A build with the baseline CPU variant alone (the CI builds): torch's own kernels, the tests'
# peers, run at the same ISA (read once at import), so each error is bounded by the peer's on
# equal terms. On an AVX-512 host torch's softmax otherwise sums 65536-long float32 rows with
# twice the baseline's accuracy (test_every_row_strategy's "2x the peer's error" bound failed by 2%).
if [ "$(python -c 'import safeattn; print(",".join(safeattn.build_info()["cpu_isas"]))')" = DEFAULT ]; then
  export ATEN_CPU_CAPABILITY=default
fi
echo "== pytest (op tests against torch $(python -c 'import torch; print(torch.__version__)'))"
python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --maxschedchunk 1 \
  tests/test_build_check.py tests/test_sdpa_mask.py tests/test_softmax.py tests/test_attention.py "$@"
