#!/usr/bin/env bash
# The cost model against models the project did not write: one 4-GPU machine calibrated once (per machine, no
# model probe, no plan residuals), then searched and forced plans of Hugging Face configs (benchmarks/hf_zoo.py,
# random weights) and reference models measured next to their predictions, in device calls of <= 10 minutes.
#
#   OUT=/some/dir benchmarks/zoo_campaign.sh PHASE
#
# PHASE
#   pairs   `autoshard cluster calibrate` on GPUs 0,1 (all-reduce/all-gather over 2 ranks, matmul, attention,
#           copy, AdamW) → $OUT/cal_x2.json; then two 2-GPU sessions at once on GPUs 0,1 and 2,3 (PAIR_A, PAIR_B:
#           model lists), each model one process per config
#   x4      calibrate on all 4 GPUs → $OUT/cal_x4.json, then X4 (model list) on 4 GPUs
#   both    x4 with X4_BUDGET_S (240) of BUDGET_S, then pairs (calibrated again over 2 ranks) in the rest
# Every autoshard process measures the searched plan and the forced variants VARIANTS (empty: none; default replicate,zero3:
# benchmarks/baselines/plans.py), each compiled as the runtime compiles on CUDA; BASELINES (empty: none; default
# fsdp2-noreshard-compiled, the best hand-written baseline of the sharded campaign) run as their own
# processes, and run.py predicts each with its nearest autoshard plan. Plans are searched for this machine as
# detected (CLUSTER=detected: its memory), on the calibrated cluster. ROUNDS (1) rounds.
# The calibration file is the only thing measured on the machine that the predictions read.
# benchmarks/zoo_summary.py turns the trees into the accuracy table (step and memory errors per plan, predicted
# and measured ratios of the searched plan to the baselines).
# Files: the session trees and logs go to $WORK (default /tmp/zoo_work), packed with the calibration into
# $OUT/zoo.tgz after each phase; $OUT keeps only zoo.tgz, zoo.md, campaign-level logs and the calibration
# files (few files: a device call returns a limited number).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:?set OUT to the results folder}"
PHASE="${1:?phase: pairs | x4 | both}"
BUDGET_S="${BUDGET_S:-560}"
PYTHON="${PYTHON:-python3}"
VARIANTS="${VARIANTS-replicate,zero3}"
BASELINES="${BASELINES-fsdp2-noreshard-compiled}"
CONFIGS="autoshard${BASELINES:+,$BASELINES}"
WORK="${WORK:-/tmp/zoo_work}"
mkdir -p "$OUT" "$WORK"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"

calibrate() {  # calibrate GPUS NPROC FILE
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES="$1" timeout 240 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$2" \
    -m autoshard.calibrate --out "$3" --raw "$WORK/$(basename "${3%.json}")_raw.json" \
    > "$WORK/$(basename "${3%.json}").log" 2>&1
  echo "=== calibrate on GPUs $1: rc=$? in $((SECONDS - t0))s: $(tail -1 "$WORK/$(basename "${3%.json}").log" | cut -c1-300)"
}

session() {  # session NAME GPUS NPROC MODELS BUDGET CALIBRATION
  CUDA_VISIBLE_DEVICES="$2" NPROC="$3" MODELS="$4" CONFIGS="$CONFIGS" ROUNDS="${ROUNDS:-1}" BUDGET_S="$5" \
    CLUSTER=detected CALIBRATION="$6" RUN_LIMIT="${RUN_LIMIT:-420}" RUN_ARGS="${VARIANTS:+--plans forced --variants $VARIANTS}" PROFILE_ROUND=0 \
    OUT="$WORK/$1" bash "$ROOT/benchmarks/sharded_session.sh" > /dev/null 2>&1
}

pairs() {  # pairs BUDGET
  calibrate 0,1 2 "$OUT/cal_x2.json"
  local left=$(($1 - SECONDS))
  session pairA 0,1 2 "${PAIR_A:-hf-qwen2:0.5b hf-llama:1b hf-gemma:2b}" "$left" "$OUT/cal_x2.json" &
  session pairB 2,3 2 "${PAIR_B:-hf-gpt2:350m hf-qwen2:1.5b hf-phi:1.3b}" "$left" "$OUT/cal_x2.json" &
  wait
}

x4() {  # x4 BUDGET
  calibrate 0,1,2,3 4 "$OUT/cal_x4.json"
  session x4 0,1,2,3 4 "${X4:-hf-llama:7b llama:1.3b}" "$(($1 - SECONDS))" "$OUT/cal_x4.json"
}

case "$PHASE" in
  pairs) pairs "$BUDGET_S" ;;
  x4) x4 "$BUDGET_S" ;;
  both) x4 "${X4_BUDGET_S:-240}"; pairs "$BUDGET_S" ;;
  *) echo "unknown phase $PHASE (pairs | x4 | both)" >&2; exit 2 ;;
esac
cp "$OUT"/cal_*.json "$WORK"/ 2>/dev/null
tar czf "$OUT/zoo.tgz" -C "$WORK" .
"$PYTHON" benchmarks/zoo_summary.py "$WORK" > "$OUT/zoo.md" 2> "$WORK/zoo_summary.err"
cat "$OUT/zoo.md"
