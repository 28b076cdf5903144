#!/usr/bin/env bash
# A/B of the compiled programs' overlap modes (passes/schedule_overlap.py, "compiled programs"): one
# torchrun of benchmarks/run.py per mode, each measuring the searched plan and the forced ZeRO-3 plan
# (autoshard-zero3), the first process also FSDP2 compiled per block (reshard True and False).
#
#   OUT=/some/dir [NPROC=2] [MODEL=llama:1.3b] [BATCH=16] [MODES="scheduler none reorder"] \
#       benchmarks/compile_overlap_ab.sh
#
# Writes $OUT/<mode>/results.{json,md} and $OUT/<mode>.log; $OUT/env.txt names torch and the card.
# LIMIT (s, default 200) bounds each process. DRY=1: CPU rehearsal (llama:tiny, fp32, eager-free modes).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT}"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [[ ${DRY:-0} == 1 ]]; then
  NPROC="${NPROC:-2}"; export OMP_NUM_THREADS=1
  shape=(--device cpu --precision fp32 --model llama:tiny --batch 4 --seq 16 --steps 3 --warmup 1)
  export AUTOSHARD_COMPILE=1
else
  NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
  shape=(--precision bf16 --model "${MODEL:-llama:1.3b}" --batch "${BATCH:-16}" --seq 2048 --steps 10 --warmup 3)
fi
{ "$PYTHON" -c "import torch; print('torch', torch.__version__)"; nvidia-smi -L 2>/dev/null; } > "$OUT/env.txt"
"$PYTHON" - >> "$OUT/env.txt" <<'PY'
import torch._inductor.config as c
known = c.get_config_copy()
for key in ("aten_distributed_optimizations.enable_overlap_scheduling", "aten_distributed_optimizations.collective_bucketing",
            "reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes"):
    print(key, "known" if key in known else "MISSING")
PY
first=1
for mode in ${MODES:-scheduler none reorder}; do
  configs=autoshard; [[ $first == 1 && ${DRY:-0} != 1 ]] && configs=autoshard,fsdp2-compiled,fsdp2-noreshard-compiled
  AUTOSHARD_COMPILE_OVERLAP=$mode timeout "${LIMIT:-200}" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" benchmarks/run.py "${shape[@]}" --plans forced --variants zero3 \
    --configs "$configs" --profile --out "$OUT/$mode" > "$OUT/$mode.log" 2>&1
  echo "=== $mode rc=$?"
  first=0
done
for mode in ${MODES:-scheduler none reorder}; do
  echo "## $mode"; sed -n '/^| config/,/^$/p' "$OUT/$mode/results.md" 2>/dev/null
done | tee "$OUT/summary.md"
