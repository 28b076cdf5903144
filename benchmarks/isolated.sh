#!/usr/bin/env bash
# Throughput with every config in its own process, repeated: what a single run.py process
# cannot separate (a config's step time moved by up to ±50% with what ran before it in the same
# process, and by ±25% between processes; docs/benchmarks.md).
#
#   OUT=/some/dir [NPROC=2] [CAL_DIR=.cal] benchmarks/isolated.sh
#
#   ISO_RUNS     "model[:attn]=config,config ..."   one torchrun per (repeat, model, config)
#                default "llama:350m=autoshard,fsdp2-noreshard-compiled"
#   ISO_REPEATS  rounds (default 2); each round runs every config once, in order, so a slow
#                period of the machine falls on all configs of a model alike
#   ISO_STEPS / ISO_WARMUP   steps per process (default 12 / 4)
#   ISO_LIMIT    seconds per process (default 120)
#   ISO_ARGS     extra run.py arguments (e.g. --optimizer sgd)
# AUTOSHARD_COMPILE (auto/1/0), AUTOSHARD_COMPILE_REGIONS, AUTOSHARD_GATHER_UNDER_UPDATE and
# AUTOSHARD_OVERLAP_GRAD_SYNC pass through to the autoshard rows (benchmarks/baselines/autoshard_trainer.py).
# Writes $OUT/iso/<model>/<config>_r<k>/results.{json,md} and $OUT/iso/summary.md (median over
# the rounds of each process's median step, and each config over the best baseline).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT}"
NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/iso"
device=(); [[ ${ISO_DEVICE:-cuda} == cpu ]] && device=(--device cpu --precision fp32)
for ((r = 1; r <= ${ISO_REPEATS:-2}; r++)); do
  for run in ${ISO_RUNS:-llama:350m=autoshard,fsdp2-noreshard-compiled}; do
    spec=${run%%=*}; configs=${run#*=}
    model_spec "$spec"; tag=$TAG
    shape=(--batch 16 --seq 1024 --precision bf16); [[ ${ISO_DEVICE:-cuda} == cpu ]] && shape=(--batch 8 --seq 16)
    for config in ${configs//,/ }; do
      dir="$OUT/iso/$tag/${config}_r$r"; mkdir -p "$OUT/iso/$tag"
      timeout "${ISO_LIMIT:-120}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        benchmarks/run.py "${MODEL_ARGS[@]}" "${shape[@]}" ${device[@]+"${device[@]}"} \
        --steps "${ISO_STEPS:-12}" --warmup "${ISO_WARMUP:-4}" --configs "$config" \
        ${ISO_ARGS:-} --out "$dir" > "$dir.log" 2>&1
      echo "=== $tag $config round $r rc=$?"
    done
  done
done
"$PYTHON" benchmarks/isolated_summary.py "$OUT/iso" | tee "$OUT/iso/summary.md"
