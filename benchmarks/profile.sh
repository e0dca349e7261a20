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
# Environment: STAGE_TIMEOUT (seconds per target, default 420).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
TIMEOUT="${STAGE_TIMEOUT:-420}"
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section LaunchStats)

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

for target in "${@:-attention}"; do
  case "$target" in
    attention | softmax) "profile_$target" ;;
    *) echo "profile: unknown target $target (attention, softmax)" ;;
  esac
done
