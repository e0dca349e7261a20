#!/usr/bin/env bash
# Nsight Compute over the CUDA kernels, at the shapes of the benchmarks beside it. Runs on the GPU
# host on an existing build (`bash scripts/gpu_check.sh build profile` builds and profiles in one
# call; PROFILE names what it profiles there), writing each report under $OUT (default
# ./gpu_out) and one summary line per target on stdout.
#
#   bash benchmarks/profile.sh [attention] [softmax]      (default: attention)
#
#   attention  benchmarks/profile_attention.py (D=PROFILE_HEAD_DIM, default 128): speed of light,
#              occupancy, warp stalls, memory and compute of each prefill attention kernel
#   softmax    our softmax forward and torch.softmax's at the float32 shapes where torch is
#              closest (`python -m safeattn bench softmax --device cuda --profile`)
#   generic    the generic kernels (forced: the A100 / Ada proxy) beside FlashAttention-2's (SDPA
#              flash), D=PROFILE_HEAD_DIM (default 64), is_causal: the second call's forward and
#              dK/dV kernels of each, every section, the instruction mix by opcode and, per
#              kernel, its SASS with executed counts and stalls (ncu_generic_*_sass.csv, read
#              by benchmarks/sass_counts.py);
#              PROFILE_SIDES="ours" leaves FlashAttention-2 out
#   short      the sm_90a forward beside cuDNN's at the sweep's shortest causal shape (S=512 B=32
#              H=16 D=128 is_causal, PROFILE_CASE to change it): one warm launch of each, every
#              section and the SASS with executed counts and stalls (ncu_short_*_sass.csv, read by
#              benchmarks/sass_counts.py): where a short tile's fixed cost goes
#   decode     one decode step of safeattn (the serving API) beside SDPA cuDNN's at
#              PROFILE_DECODE="B KV HKV D" (default "1 4096 8 128", Hq=32, bf16): every kernel of
#              the step (an NVTX range), every section, and the SASS with executed counts and stalls
#              (ncu_decode_*_sass.csv): what a step spends beside cuDNN's
# Environment: STAGE_TIMEOUT (seconds per target, default 420).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
TIMEOUT="${STAGE_TIMEOUT:-420}"
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section LaunchStats)

# A report's pages for reading here: $OUT/NAME.txt (every section; further ncu --import options
# after SUMMARY), NAME_sass.csv (the SASS with executed counts and stalls, for
# benchmarks/sass_counts.py), the report itself removed; then the lines of NAME.txt that SUMMARY
# (an extended regex) matches, cut to 150 columns.
ncu_pages() {
  local name=$1 summary=$2
  shift 2
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/${name}_sass.csv" 2>&1
  ncu --import "$OUT/$name.ncu-rep" "$@" >"$OUT/$name.txt" 2>&1
  rm -f "$OUT/$name.ncu-rep"
  grep -E "$summary" "$OUT/$name.txt" | cut -c1-150
}

profile_attention() {
  # Past the first is_causal call (4 kernels): the second one and the first dense-mask call.
  timeout -k 10 "$TIMEOUT" ncu --target-processes all --kernel-name regex:'attention|summarize' \
    --launch-skip 4 --launch-count 12 "${NCU_SECTIONS[@]}" \
    python benchmarks/profile_attention.py --head-dim "${PROFILE_HEAD_DIM:-128}" --calls 2 >"$OUT/ncu_attention.txt" 2>&1
  echo "profile attention (rc $?): $(grep -c 'attention' "$OUT/ncu_attention.txt") lines naming attention kernels in ncu_attention.txt"
}

profile_softmax() {
  timeout -k 10 "$TIMEOUT" ncu --kernel-name regex:'softmax' "${NCU_SECTIONS[@]}" \
    python -m safeattn bench softmax --device cuda --profile --dtypes fp32 --shapes 1048576x1024,4194304x128 \
    >"$OUT/ncu_softmax.txt" 2>&1
  echo "profile softmax (rc $?): ncu_softmax.txt"
  grep -E '^  [a-z_:]*softmax|Duration|DRAM Throughput|Achieved Occupancy|Registers Per' "$OUT/ncu_softmax.txt" |
    cut -c1-150
}

profile_generic() {
  local d=${PROFILE_HEAD_DIM:-64} side regex args
  for side in ${PROFILE_SIDES:-ours flash}; do
    if [ $side = ours ]; then
      regex='attention_fwd_kernel|attention_bwd_dkdv'
      args=(--generic)
    else
      regex='flash_fwd_kernel|flash_bwd_dq_dk_dv'
      args=(--peer flash)
    fi
    timeout -k 10 "$TIMEOUT" ncu --clock-control none --set full --import-source no --kernel-name regex:"$regex" \
      --launch-skip 2 --launch-count 2 --print-metric-instances details -o "$OUT/ncu_generic_$side" -f \
      python benchmarks/profile_attention.py "${args[@]}" --head-dim "$d" --calls 2 >"$OUT/ncu_generic_$side.log" 2>&1
    echo "profile generic $side (rc $?): ncu_generic_$side.log"
    ncu_pages "ncu_generic_$side" \
      '^  [a-zA-Z_:<>]*(attention|flash)|Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Compute \(SM\) Th' \
      --print-metric-instances details
  done
}

profile_short() {
  local case=${PROFILE_CASE:-S=512 B=32 H=16:16 D=128 causal} side regex impl
  for side in ours cudnn; do
    if [ $side = ours ]; then
      regex='fwd_kernel'
      impl=safeattn
    else
      regex='flash_fprop'
      impl='SDPA cuDNN'
    fi
    timeout -k 10 "$TIMEOUT" ncu --clock-control none --set full --import-source no --kernel-name regex:"$regex" \
      --launch-skip 1 --launch-count 1 -o "$OUT/ncu_short_$side" -f \
      python benchmarks/profile_attention.py --case "$case" --impl "$impl" --forward-only --calls 3 \
      >"$OUT/ncu_short_$side.log" 2>&1
    echo "profile short $side (rc $?): ncu_short_$side.log"
    ncu_pages "ncu_short_$side" \
      '^  [a-zA-Z_:<>]*(fwd_kernel|fprop)|Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Compute \(SM\) Th'
  done
}

profile_decode() {
  local b kv hkv d side impl
  read -r b kv hkv d <<<"${PROFILE_DECODE:-1 4096 8 128}"
  for side in ours cudnn; do
    impl=safeattn
    [ $side = cudnn ] && impl='SDPA cuDNN'
    timeout -k 10 "$TIMEOUT" ncu --clock-control none --set full --import-source no --nvtx --nvtx-include profiled/ \
      -o "$OUT/ncu_decode_$side" -f python benchmarks/profile_attention.py --decode "$kv" --decode-batch "$b" \
      --decode-kv-heads "$hkv" --head-dim "$d" --impl "$impl" --calls 3 >"$OUT/ncu_decode_$side.log" 2>&1
    echo "profile decode $side (rc $?): ncu_decode_$side.log"
    ncu_pages "ncu_decode_$side" \
      '^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size'
  done
}

for target in "${@:-attention}"; do
  case "$target" in
    attention | softmax | generic | short | decode) "profile_$target" ;;
    *) echo "profile: unknown target $target (attention, softmax, generic, short, decode)" ;;
  esac
done
