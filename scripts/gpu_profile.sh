#!/usr/bin/env bash
# Where a step's device time goes, kernel by kernel, on the GPU machine (no Rust there; the
# binaries come from `scripts/gpu_verify.sh build`). Nsight Compute times every kernel of a
# short eager gpu-bench run (one prefill, one decode step), and ncu_summary.py splits the
# launches into steps and totals each step by kernel:
#
#   bash scripts/gpu_profile.sh                 # qwen2.5-0.5b, decode batch 1, prefill 2048
#   PRESET=llama-3.2-1b BATCH=32 PREFILL=512 bash scripts/gpu_profile.sh
#
# Kernels are timed one at a time (ncu serialises them), so the sum is device time with no
# launch gaps: set beside gpu-bench's ms/step it says how much of a step is host overhead.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out/results}"
preset="${PRESET:-qwen2.5-0.5b}"
batch="${BATCH:-1}"
prefill="${PREFILL:-2048}"
# EXTRA: more gpu-bench flags (e.g. --no-split-decode), named in the output files.
extra="${EXTRA:-}"
tag="${extra:+-$(echo "$extra" | tr -dc 'a-z0-9-' | sed 's/^-*//')}"
mkdir -p "$out"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
csv="$out/ncu-$preset-b$batch-p$prefill$tag.csv"
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    gpu-out/gpu-bench --presets "$preset" --batches "$batch" --prefill-lens "$prefill" \
    --prefill-reps 1 --decode-steps 1 --warmup 0 --copy-mib 64 --copy-reps 1 --enforce-eager \
    --gemm-size 0 --sampled-batches 0 $extra \
    --json "$out/profiled-run.json" >"$csv"
python3 scripts/ncu_summary.py "$csv" | tee "$out/ncu-$preset-b$batch-p$prefill$tag.txt"
