#!/usr/bin/env bash
# One call on the GPU test host (H100/H200, torch 2.11 preinstalled, no network): build, then the
# stages named on the command line, each writing its full log under $OUT (default ./gpu_out) and
# printing a one-line summary last, so that the reply's output tail carries every result. The logs
# end up in $OUT/logs.tgz, next to $OUT/summary.txt.
#
#   bash scripts/gpu_check.sh build tests sanitize bench
#
# Stages:
#   build     MAX_JOBS=16 editable build; `python -m safeattn info`
#   tests     the suite, one pytest process per file (a crash in one file, such as the
#             aoti_load_package segfault seen on torch 2.11, does not hide the others), -n 4,
#             a per-test timeout; failures listed by name
#   suite     the whole suite in one pytest process (-n PYTEST_WORKERS): the summary line to quote
#   pick      the files in PICK (one pytest process, -k PICK_K when set)
#   cuda      only the CUDA cases (-k cuda) plus the CUDA-only files: the short form of `tests`
#   sanitize  compute-sanitizer memcheck over a reduced CUDA selection of every op (SANITIZE_FILES
#             and SANITIZE_K override the files and the -k expression)
#   bench     bench_sdpa_mask / bench_softmax / bench_attention with --device cuda
#   quickbench the same, attention with --quick
#   attnbench only bench_attention --quick
#   maskbench only bench_sdpa_mask
#   masksweep bench_sdpa_mask at 4096^2 once per SAFEATTN_MASK_WAVES in MASK_WAVES (1 2 4 8)
#   softmaxbench only bench_softmax, its forward rows copied into the summary
#   softmaxprofile Nsight Compute over our softmax forward and torch.softmax's (float32 shapes)
#   aoti      scripts/aoti_probe.py: which AOTInductor package crashes on load (the torch-only
#             control on CPU, then every case on CUDA)
#   decodeprofile torch.profiler tables of both decode paths, Nsight Compute over the split one
#   profile   Nsight Compute over scripts/profile_attention.py (D=PROFILE_HEAD_DIM, default 128):
#             speed of light, occupancy, warp stalls, memory and compute of each attention kernel
# Environment: STAGE_TIMEOUT (seconds per pytest file or benchmark, default 420), PYTEST_WORKERS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
TIMEOUT="${STAGE_TIMEOUT:-420}"
WORKERS="${PYTEST_WORKERS:-4}"
SUMMARY="$OUT/summary.txt"
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section LaunchStats)
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

stage_build() {
  local t0=$SECONDS
  if ! python -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    say "build: FAILED (build.log)"
    return 1
  fi
  python -m safeattn info >"$OUT/info.txt" 2>&1
  say "build: ok in $((SECONDS - t0)) s; $(grep -i -m1 'cuda archs' "$OUT/info.txt")"
}

# run_pytest NAME ARGS...: one pytest process, its summary line and failing test ids kept.
run_pytest() {
  local name=$1
  shift
  local per_test=() chunk=()
  python -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 300)
  # One test at a time per worker, so that the slow tests tests/conftest.py puts first spread
  # over the workers (an xdist without the option keeps its default chunks).
  python -m pytest --help 2>/dev/null | grep -q -- --maxschedchunk && chunk=(--maxschedchunk 1)
  timeout -k 10 "$TIMEOUT" python -m pytest -q -rfEs -p no:cacheprovider "${per_test[@]}" "${chunk[@]}" \
    -n "$WORKERS" "$@" >"$OUT/pytest_$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s|no tests ran' "$OUT/pytest_$name.log" | tail -1)
  [ $rc -eq 124 ] && line="TIMEOUT after ${TIMEOUT}s (progress in pytest_$name.log)"
  say "pytest $name (rc $rc): ${line:-no summary line (crash? see pytest_$name.log)}"
  grep -E '^(FAILED|ERROR) ' "$OUT/pytest_$name.log" | head -30 | tee -a "$SUMMARY"
}

stage_tests() {
  local f
  for f in tests/test_*.py; do
    run_pytest "$(basename "$f" .py)" "$f"
  done
}

stage_suite() {
  run_pytest suite tests
}

stage_pick() {
  # shellcheck disable=SC2086
  run_pytest pick ${PICK:?PICK names the test files} ${PICK_K:+-k "$PICK_K"}
}

stage_cuda() {
  run_pytest cuda_cases tests -k "cuda" --ignore tests/test_attention_cuda_backward.py
  run_pytest cuda_attention_backward tests/test_attention_cuda_backward.py
}

stage_sanitize() {
  # Small CUDA cases of every op (no compile, opcheck or 2^31-element cases: too slow under the
  # tool). -n 1: the tool serialises kernels anyway.
  timeout -k 10 "$TIMEOUT" compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 \
    python -m pytest -q -p no:cacheprovider -x \
    ${SANITIZE_FILES:-tests/test_sdpa_mask.py tests/test_softmax.py tests/test_attention.py tests/test_attention_cuda_backward.py} \
    -k "${SANITIZE_K:-cuda and not compile and not opcheck and not pow_31}" \
    >"$OUT/sanitize.log" 2>&1
  local rc=$?
  say "sanitize (rc $rc): $(grep -E 'ERROR SUMMARY' "$OUT/sanitize.log" | tail -1); $(grep -E '[0-9]+ (passed|failed|skipped).* in [0-9.]+s' "$OUT/sanitize.log" | tail -1)"
}

run_bench() {
  local name=$1
  shift
  timeout -k 10 "$TIMEOUT" python "$@" >"$OUT/bench_$name.txt" 2>&1
  say "bench $name (rc $?): $OUT/bench_$name.txt"
}

stage_bench() {
  run_bench sdpa_mask benchmarks/bench_sdpa_mask.py --device cuda
  run_bench softmax benchmarks/bench_softmax.py --device cuda
  run_bench attention benchmarks/bench_attention.py --device cuda
}

stage_quickbench() {
  run_bench sdpa_mask benchmarks/bench_sdpa_mask.py --device cuda
  run_bench softmax benchmarks/bench_softmax.py --device cuda
  stage_attnbench
}

stage_maskbench() {
  run_bench sdpa_mask benchmarks/bench_sdpa_mask.py --device cuda
  grep -E '^\| [0-9]' "$OUT/bench_sdpa_mask.txt" | tee -a "$SUMMARY"
}

stage_masksweep() {
  # bench_sdpa_mask at Q = KV = 4096 once per SAFEATTN_MASK_WAVES (blocks: waves of 2048 threads per SM).
  local w
  for w in ${MASK_WAVES:-1 2 4 8}; do
    SAFEATTN_MASK_WAVES=$w run_bench "sdpa_mask_waves$w" benchmarks/bench_sdpa_mask.py --device cuda --lengths 4096 \
      ${MASK_SWEEP_ARGS:-}
    grep -E '^\| [0-9]' "$OUT/bench_sdpa_mask_waves$w.txt" | sed "s/^/waves $w /" | tee -a "$SUMMARY"
  done
}

stage_softmaxbench() {
  run_bench softmax benchmarks/bench_softmax.py --device cuda
  grep -E '^ *(bf16|fp32) ' "$OUT/bench_softmax.txt" | head -10 | tee -a "$SUMMARY"
}

stage_softmaxprofile() {
  # Nsight Compute over our forward and torch.softmax's at the float32 shapes where torch is ahead.
  timeout -k 10 "$TIMEOUT" ncu --kernel-name regex:'softmax' "${NCU_SECTIONS[@]}" \
    python benchmarks/bench_softmax.py --device cuda --profile --dtypes fp32 --shapes 1048576x1024,4194304x128 \
    >"$OUT/ncu_softmax.txt" 2>&1
  say "softmaxprofile (rc $?): ncu_softmax.txt"
  grep -E '^  [a-z_:]*softmax|Duration|DRAM Throughput|Achieved Occupancy|Registers Per' "$OUT/ncu_softmax.txt" |
    cut -c1-150 | tee -a "$SUMMARY"
}

stage_attnbench() {
  run_bench attention benchmarks/bench_attention.py --device cuda --quick
}

stage_aoti() {
  # The control first: a plain package in a process that never imports safeattn, and one that
  # does. AOTI_BACKTRACE=1 reruns crashed cases under cuda-gdb (minutes each).
  local backtrace=()
  [ "${AOTI_BACKTRACE:-0}" = 1 ] && backtrace=(--backtrace)
  timeout -k 10 "$TIMEOUT" python scripts/aoti_probe.py --device cpu --cases torch_only,linear --out "$OUT" 2>&1 |
    tee "$OUT/aoti_cpu.txt" | grep -E '^aoti' | cut -c1-240 | tee -a "$SUMMARY"
  timeout -k 10 "$TIMEOUT" python scripts/aoti_probe.py --device cuda --out "$OUT" "${backtrace[@]}" 2>&1 |
    tee "$OUT/aoti_cuda.txt" | grep -E '^aoti' | cut -c1-240 | tee -a "$SUMMARY"
}

stage_profile() {
  # Past the first is_causal call (4 kernels): the second one and the first dense-mask call.
  timeout -k 10 "$TIMEOUT" ncu --target-processes all --kernel-name regex:'attention|summarize' \
    --launch-skip 4 --launch-count 12 "${NCU_SECTIONS[@]}" \
    python scripts/profile_attention.py --head-dim "${PROFILE_HEAD_DIM:-128}" --calls 2 >"$OUT/ncu_attention.txt" 2>&1
  say "profile (rc $?): $(grep -c 'attention' "$OUT/ncu_attention.txt") lines naming attention kernels in ncu_attention.txt"
}

stage_decodeprofile() {
  # Per-kernel device times of both decode paths, then Nsight Compute over the split kernels.
  local kv
  for kv in 4096 32768; do
    SAFEATTN_ATTN_DECODE=0 python scripts/profile_attention.py --decode "$kv" --table >"$OUT/decode_table_$kv.txt" 2>&1
    python scripts/profile_attention.py --decode "$kv" --table >"$OUT/decode_split_table_$kv.txt" 2>&1
  done
  timeout -k 10 "$TIMEOUT" ncu --kernel-name regex:decode --launch-skip 2 --launch-count 2 \
    "${NCU_SECTIONS[@]}" python scripts/profile_attention.py --decode 32768 --calls 2 >"$OUT/ncu_decode.txt" 2>&1
  say "decodeprofile (rc $?): decode_*table_*.txt, ncu_decode.txt"
  grep -hE '^-- |attention' "$OUT"/decode_*table_*.txt | cut -c1-260 | tee -a "$SUMMARY"
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])' | tee -a "$OUT/gpu.txt"
for stage in "$@"; do
  case "$stage" in
    build) stage_build || break ;;
    tests | suite | pick | cuda | sanitize | bench | quickbench | attnbench | maskbench | masksweep | softmaxbench | \
      softmaxprofile | aoti | profile | decodeprofile) "stage_$stage" ;;
    *) say "unknown stage $stage" ;;
  esac
done
echo "==== summary"
cat "$SUMMARY"
# The device tool brings back at most 8 files: every log goes into one archive beside the summary.
(cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name logs.tgz -printf '%P\n' |
  tar czf logs.tgz -T - --remove-files)
