#!/usr/bin/env bash
# A/B of runtime settings on one GPU machine: each setting in its own torchrun (the CUDA
# connection count is read when the CUDA context starts), the same run.py call otherwise.
#
#   AB_MODELS     "model[:attn] ..."      default "gpt:1.3b:sdpa llama:350m"
#   AB_CDMC       CUDA_DEVICE_MAX_CONNECTIONS values   default "1 8" (1: what Megatron-Core's SP needs)
#   AB_OVERLAP    AUTOSHARD_OVERLAP_GRAD_SYNC values   default "1 0" (1: DP gradient buckets under backward)
#   AB_COMPILE    AUTOSHARD_COMPILE values             default "0" (eager; 1: torch.compile the per-rank
#                 graph, and a plan with ZeRO-3 layers then fails, so pair it with AB_ARGS without
#                 --variants zero3, e.g. AB_ARGS="--configs autoshard,fsdp2-noreshard,fsdp2-noreshard-compiled";
#                 auto, run.py's own default: compile where the plan allows)
#   AB_ARGS       extra run.py arguments (default: the searched plan + forced ZeRO-3, FSDP2 without reshard)
#   CAL_DIR       calibration files <family>_<size>.json (benchmarks/gpu_session.sh calibrate/probe)
#
# Writes $OUT/ab/<model>_c<cdmc>_o<overlap>/results.{json,md} and prints one line per run.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT}"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
mkdir -p "$OUT/ab"
for spec in ${AB_MODELS:-gpt:1.3b:sdpa llama:350m}; do
  model_spec "$spec"
  for cdmc in ${AB_CDMC:-1 8}; do
    for overlap in ${AB_OVERLAP:-1 0}; do
     for compile in ${AB_COMPILE:-0}; do
      name="${TAG}_c${cdmc}_o${overlap}"; [[ $compile == 1 ]] && name+="_compiled"
      CUDA_DEVICE_MAX_CONNECTIONS=$cdmc AUTOSHARD_OVERLAP_GRAD_SYNC=$overlap AUTOSHARD_COMPILE=$compile timeout 300 \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/run.py \
        "${MODEL_ARGS[@]}" --batch 16 --seq 1024 --precision bf16 --steps 6 --warmup 2 \
        ${AB_ARGS:---configs autoshard,fsdp2-noreshard --variants zero3} \
        --out "$OUT/ab/$name" > "$OUT/ab/$name.log" 2>&1
      echo "=== $name rc=$?"
      "$PYTHON" - "$OUT/ab/$name/results.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as err:  # noqa: BLE001
    print("  no results:", err); sys.exit()
for r in rows:
    print(f"  {r['config']:<22} {r.get('median_step_s', float('nan')) * 1e3:8.1f} ms  {r.get('plan', '')}  {r['status'][:60]}")
PY
     done
    done
  done
done
