#!/usr/bin/env bash
# Sharded materialisation matrix on one machine with NPROC GPUs: each run its own torchrun of
# benchmarks/materialize_bench.py, rows appended to $OUT/materialize.jsonl, then the markdown summary.
#
#   OUT=/some/dir [NPROC=2] benchmarks/materialize_session.sh
#
# Runs (RUNS overrides, space-separated MODEL:WEIGHTS or MODEL:fsdp2, in this order):
#   for each model of MODELS (default "llama:7b hf-llama:7b"): MODEL:meta MODEL:safetensors MODEL:fsdp2
#   meta        autoshard, build_program initialising each rank's shards (seed 0)
#   safetensors autoshard, rank 0 first writes random bf16 weights to $WEIGHTS_ROOT/<model> (a Hugging
#               Face-style sharded directory, ~13.5 GB for 7B; reused by a later run of the same model),
#               then every rank loads its shards from it
#   fsdp2       the FSDP2 baseline built on meta (fully_shard, to_empty, init on shards); FSDP2=fsdp2-noreshard
#               or fsdp2-noreshard-compiled picks another variant
# Shape: SEQ (1024) x global BATCH (8), STEPS (20) of which WARMUP (3) untimed, bf16, AdamW; cluster
# h100-sxm:1x$NPROC (CLUSTER overrides). COMPILE (auto|on|off) goes to build_program's compile_graph.
# Time: each run is killed after RUN_LIMIT seconds (default 240) and gets a "killed" row; a run starts
# only while BUDGET_S (default 540, from the start: one 10-minute device call) leaves >= 60 s; the runs
# not started are named at the end (pass them as RUNS to a second call). Measured for 7B on 2 H200s
# (2026-11-26; no H100 came): start, imports, NCCL ~10 s; capture + search 3 s (llama) or 10-15 s
# (hf-llama: every block exported); build 11-17 s (meta) or 29 s (safetensors, plus 13-20 s for rank
# 0 to write 13.5 GB the first time); torch.compile in the first step (the searched ZeRO-1/2 plan)
# ~60 s (llama) to ~90 s (hf-llama); 20 steps ~9 s. A run: fsdp2 ~45 s, llama meta ~100 s, hf-llama
# meta ~155 s (COMPILE=off: llama meta 53 s, eager steps 1.3x slower); the whole matrix ~10 min.
# BENCH replaces the script torchrun starts (default benchmarks/materialize_bench.py; e.g. a wrapper that
# patches something first, with the same arguments). Logs: $OUT/logs/<model>_<kind>.log (the summary in
# $OUT/summary.md). KEEP_WEIGHTS=1 keeps the written checkpoints (default: removed at the end).
# DRY=1 rehearses the shell logic on the CPU: tiny models (llama:tiny hf-llama:tiny), gloo, fp32, seq 16,
# batch 4, 5 steps, cluster cpu:1x$NPROC.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT to the results folder}"
DRY="${DRY:-0}"
if [[ $DRY == 1 ]]; then
  NPROC="${NPROC:-2}"
else
  NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
fi
cd "$ROOT"
if [[ $DRY != 1 ]]; then
  source "$ROOT/benchmarks/gpu_env.sh"  # the carried wheels (.whl) and the working tree as `autoshard`
fi
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
mkdir -p "$OUT/logs"
RESULTS="$OUT/materialize.jsonl"
WEIGHTS_ROOT="${WEIGHTS_ROOT:-/tmp/autoshard_materialize}"
SHAPE=(--seq "${SEQ:-1024}" --batch "${BATCH:-8}" --steps "${STEPS:-20}" --warmup "${WARMUP:-3}" --precision bf16)
CLUSTER="${CLUSTER:-h100-sxm:1x$NPROC}"
MODELS="${MODELS:-llama:7b hf-llama:7b}"
EXTRA=(--compile "${COMPILE:-auto}")
if [[ $DRY == 1 ]]; then
  SHAPE=(--seq 16 --batch 4 --steps 5 --warmup 2 --precision fp32)
  CLUSTER="cpu:1x$NPROC"; MODELS="${MODELS_DRY:-llama:tiny hf-llama:tiny}"; EXTRA=(--device cpu)
  export OMP_NUM_THREADS=1
fi
if [[ -z ${RUNS:-} ]]; then
  RUNS=""
  for m in $MODELS; do RUNS+=" $m:meta $m:safetensors $m:fsdp2"; done
fi
END=$((SECONDS + ${BUDGET_S:-540}))
skipped=()

killed_row() {  # killed_row MODEL CONFIG WEIGHTS RC SECONDS LOG: a row for a run that wrote none
  "$PYTHON" - "$RESULTS" "$@" "$NPROC" "$CLUSTER" <<'PY'
import json, re, sys
path, model, config, weights, rc, seconds, log, world, cluster = sys.argv[1:]
# the first exception a rank printed (a rank that fails ends the job before rank 0 writes its row)
errors = re.findall(r"^(?:torch\.)?\w*(?:Error|Exception)\b.*$", open(log, errors="replace").read(), re.M)
reason = f": {errors[0][:200]}" if errors else ""
with open(path, "a") as f:
    f.write(json.dumps({"model": model, "config": config, "weights": weights, "world_size": int(world),
                        "cluster": cluster, "status": f"killed: exit {rc} after {seconds}s, no row written{reason}",
                        "wall_s": float(seconds)}) + "\n")
PY
}

for run in $RUNS; do
  kind=${run##*:}; model=${run%:*}
  left=$((END - SECONDS))
  if ((left < 60)); then skipped+=("$run"); continue; fi
  limit=$(( left < ${RUN_LIMIT:-240} ? left : ${RUN_LIMIT:-240} ))
  case "$kind" in
    meta|safetensors) args=(--weights "$kind" --weights-dir "$WEIGHTS_ROOT/${model/:/_}"); config=autoshard ;;
    fsdp2) args=(--baseline "${FSDP2:-fsdp2}"); config="${FSDP2:-fsdp2}"; kind=meta ;;
    *) echo "=== $run: unknown kind '$kind' (meta, safetensors, fsdp2)"; continue ;;
  esac
  log="$OUT/logs/${model/:/_}_${run##*:}.log"
  before=$(wc -l < "$RESULTS" 2>/dev/null || echo 0)
  echo "=== $run (limit ${limit}s) $(date -u +%H:%M:%S)"
  t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" "${BENCH:-benchmarks/materialize_bench.py}" --model "$model" --cluster "$CLUSTER" \
    "${SHAPE[@]}" "${EXTRA[@]}" "${args[@]}" --out "$OUT" > "$log" 2>&1
  rc=$?
  echo "=== $run rc=$rc in $((SECONDS - t0))s"
  grep '^\[materialize' "$log" | tail -n 12
  after=$(wc -l < "$RESULTS" 2>/dev/null || echo 0)
  ((after > before)) || killed_row "$model" "$config" "$kind" "$rc" "$((SECONDS - t0))" "$log"
done
((${#skipped[@]} == 0)) || echo "=== not started (budget): RUNS=\"${skipped[*]}\""
[[ ${KEEP_WEIGHTS:-0} == 1 ]] || rm -rf "$WEIGHTS_ROOT"
"$PYTHON" benchmarks/materialize_summary.py "$RESULTS" | tee "$OUT/summary.md"
