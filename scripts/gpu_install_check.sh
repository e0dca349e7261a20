#!/usr/bin/env bash
# The install route on the GPU test host (H100/H200, torch 2.11 preinstalled, no network), as a
# new user follows the README: a fresh virtual environment, the README's install line word for
# word (the wheels it names come from .whl/, carried with the call, since pip has no index there),
# then `python -m safeattn info`, and, at once, a build for another GPU (TORCH_CUDA_ARCH_LIST=8.0)
# whose first CUDA call must raise the clear error. Stages, each with its own time limit and a
# one-line summary in $OUT/summary.txt:
#
#   bash scripts/gpu_install_check.sh install     # both builds, info, the error test
#   bash scripts/gpu_install_check.sh tests       # CUDA tests against the installed build
#   bash scripts/gpu_install_check.sh generic     # CUDA attention tests on the generic kernels
#   bash scripts/gpu_install_check.sh bench       # the generic kernels vs SDPA flash; the prefill table
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
USER_VENV=/tmp/safeattn-user-venv
OTHER=/tmp/safeattn-other-arch
SUMMARY="$OUT/summary.txt"
touch "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
# pip with no index: the README's packages come from the carried wheels and the host's own.
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$ROOT/.whl"

stage_install() {
  local t0=$SECONDS
  rm -rf "$USER_VENV" "$OTHER"
  # The host's packages (its python3 is itself a venv's) stand for `pip install torch` and the
  # rest of what it has: a .pth line puts them on the new environment's path.
  python3 -m venv "$USER_VENV"
  python3 -c 'import site; print(site.getsitepackages()[0])' \
    >"$("$USER_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/host_packages.pth"
  # The other-arch build, alongside: the same sources for sm_80 only, the Hopper kernels out.
  mkdir -p "$OTHER" && tar -c --exclude=./build --exclude=./.git --exclude='*.so' . | tar -x -C "$OTHER"
  (cd "$OTHER" && TORCH_CUDA_ARCH_LIST=8.0 SAFEATTN_CPU_ISAS=DEFAULT SAFEATTN_ATTN_HEAD_DIMS=64 MAX_JOBS=4 \
    timeout 480 python3 setup.py build_ext --inplace >"$OUT/other_build.log" 2>&1; echo $? >"$OUT/other_rc") &
  (
    source "$USER_VENV/bin/activate"
    # The README's install line, word for word.
    set -x
    pip install torch setuptools ninja nvidia-cutlass==4.2.0.0 || {
      echo "NOTE: not every dependency of nvidia-cutlass is on this offline host: --no-deps"
      pip install --no-deps nvidia-cutlass==4.2.0.0
    }
    MAX_JOBS=12 pip install --no-build-isolation .
  ) >"$OUT/install.log" 2>&1
  local rc=$?
  wait
  if [ $rc != 0 ]; then
    tail -30 "$OUT/install.log"
    say "install: FAILED (install.log)"
  else
    say "install: README line ok in $((SECONDS - t0)) s $(grep -m1 NOTE "$OUT/install.log")"
    (cd /tmp && "$USER_VENV/bin/python" -m safeattn info) >"$OUT/info.txt" 2>&1
    grep -E "^(safeattn|CUDA|attention|  |GPU)" "$OUT/info.txt" | tee -a "$SUMMARY"
  fi
  if [ "$(cat "$OUT/other_rc")" != 0 ]; then
    tail -20 "$OUT/other_build.log"
    say "other-arch build: FAILED (other_build.log)"
  else
    (cd /tmp && PYTHONPATH="$OTHER/python" python3 -m safeattn info) >"$OUT/info_other.txt" 2>&1
    grep -E "^(CUDA|GPU)" "$OUT/info_other.txt" | tee -a "$SUMMARY"
    PYTHONPATH="$OTHER/python" timeout 120 python3 - <<'PY' 2>&1 | tail -4 | tee -a "$SUMMARY"
import torch, safeattn
try:
    safeattn.safe_softmax(torch.randn(2, 3, device="cuda"), -1)
    print("other-arch build: NO ERROR (wrong)")
except RuntimeError as error:
    print("other-arch build, first CUDA call:", str(error).split("Exception raised")[0].strip())
PY
    (cd "$OTHER" && PYTHONPATH="$OTHER/python" timeout 120 python3 -m pytest -q -p no:cacheprovider \
      tests/test_cuda_targets.py -k clear_error 2>&1 | tail -1 | sed 's/^/other-arch error test: /' | tee -a "$SUMMARY")
  fi
}

pytest_user() {  # NAME ARGS...: pytest with the README-installed safeattn, from the source tree
  local name=$1
  shift
  (source "$USER_VENV/bin/activate" && timeout -k 10 "${STAGE_TIMEOUT:-300}" python -m pytest -q -rfE \
    -p no:cacheprovider -n "${PYTEST_WORKERS:-14}" "$@" >"$OUT/pytest_$name.log" 2>&1)
  say "$name: $(grep -E '(passed|failed|error)' "$OUT/pytest_$name.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -15
}

stage_tests() {
  pytest_user cuda_targets tests/test_cuda_targets.py -k clear_error -n 0
  pytest_user attention_cuda tests/test_attention.py -k cuda
  pytest_user serving_cuda tests/test_varlen.py tests/test_kvcache.py tests/test_transformers_paged.py -k cuda
}

stage_generic() {
  pytest_user attention_generic --generic-kernels tests/test_attention.py -k cuda
  STAGE_TIMEOUT=240 pytest_user backward_generic --generic-kernels tests/test_attention_cuda_backward.py \
    -k "cuda and not opcheck and not gradcheck and not sm90 and not 256"
}

stage_bench() {
  source "$USER_VENV/bin/activate"
  timeout 300 python -m safeattn bench attention --device cuda --generic-kernels --head-dim 64 128 \
    --cuda-dtype bfloat16 float16 --repeats-cuda 20 >"$OUT/bench_generic.txt" 2>&1
  grep -E "^\|" "$OUT/bench_generic.txt" | tee -a "$SUMMARY"
}

for stage in "$@"; do
  "stage_$stage"
done
echo "==== summary"
cat "$SUMMARY"
