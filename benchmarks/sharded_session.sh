#!/usr/bin/env bash
# autoshard's searched plan against hand-written FSDP2 and DeepSpeed ZeRO-3, side by side on one machine of
# NPROC GPUs: every (model, round, config) its own torchrun of benchmarks/run.py, then medians over processes.
#
#   OUT=/some/dir [NPROC=2] benchmarks/sharded_session.sh
#
# Models (MODELS, priority order; default "llama:7b hf-llama:7b llama:1.3b"; hf-llama:7b is a Hugging Face
# Llama-2-7B config with random weights, and every hf-* spec of the zoo benchmarks/hf_zoo.py runs too:
# hf-qwen2:1.5b, hf-gpt2:350m, hf-gemma:2b, hf-phi:2.7b, hf-mixtral:1.5b, ...). Configs (CONFIGS, default
# autoshard,fsdp2-compiled,fsdp2-noreshard-compiled,fsdp2,deepspeed-z3): the plan searched for
# CLUSTER (default h100-sxm:1x$NPROC: 80 GB cards, also when H200s come), FSDP2 compiled per block with
# reshard_after_forward True and False (torchtitan's recipe), FSDP2 eager, DeepSpeed ZeRO-3.
# Shape: seq SEQ (2048), bf16, AdamW (lr LR, 1e-5: 1e-4 diverged on 7B in every framework), STEPS (10) of
# which WARMUP (3) untimed; global batch = NPROC × sequences per GPU (80 GB cards at seq 2048): 2 for *:7b,
# 8 for *:1.3b and the zoo's models below 1.5B (hf-llama:1b, hf-qwen2:0.5b, hf-gpt2:350m/774m, hf-phi:1.3b,
# hf-mixtral:1.5b: 1.5B in all, 0.4B active), 4 for hf-gemma:2b, hf-phi:2.7b, hf-qwen2:1.5b and hf-gpt2:1.5b
# (at 8 the last two predict 84-86 GiB for FSDP2's nearest plan: a 152k vocabulary, 48 GPT-2
# blocks), 4 otherwise (BATCH_PER_GPU overrides all). Folder tags drop the colon (llama7b_x2), or make it an
# underscore after a family ending in a digit (hf-qwen2_1.5b_x2).
# Order: for each model, rounds FIRST_ROUND (1) to ROUNDS (3), each round every config once: a session cut short keeps
# complete rounds of the first model, and a slow period of the machine falls on all its configs alike.
# Profile: the processes of round PROFILE_ROUND (default 1; 0: none) add run.py --profile: one more step
# under torch.profiler after the timed ones (so their timing is untouched) gives rank 0's GPU idle fraction.
# Round 1 so that a session cut short still has it.
# Time: a process starts only while BUDGET_S (default 560, from the start: one 10-minute device call with
# the wheel install and the summary) leaves MIN_START s (60) or, once the same model and config ran in this
# call, the seconds that process took (round 1 compiles cold: an over-estimate of later rounds); it gets
# min(RUN_LIMIT (300), what is left); one killed at its limit is a row "killed at its limit". The rest is
# named at the end (run it in another call with MODELS/ROUNDS; sharded_summary.py takes several session
# folders and pools their processes).
# Configs whose package is missing are recorded as skipped without starting a process (deepspeed for
# deepspeed-*, transformers for hf-*:*).
# CLUSTER=detected plans for this machine as Cluster.detect() sees it (no --cluster); CALIBRATION=FILE passes
# run.py --calibration FILE (its calibrated prediction, and the search on the calibrated cluster); RUN_ARGS adds
# run.py arguments to every process (benchmarks/zoo_campaign.sh: --plans forced --variants ...).
# Compile cache: Inductor's default on-disk cache (/tmp/torchinductor_$USER; FX graph and AOTAutograd
# caches, on by default in torch 2.11) is shared by every process of the session, so rounds 2+ compile from
# it; a fresh machine starts it empty. Captured graphs are shared the same way (run.py --graph-cache).
# Writes: the tree below $WORK (default a fresh /tmp/sharded.XXXX): <tag>_x<N>/<config>_r<k>/{results.json,
# results.md,proc.json} and <config>_r<k>.log, packed into $OUT/sharded.tgz after every process (the
# device tool returns only files <= 2 folders down); $OUT/summary.md (benchmarks/sharded_summary.py) and
# $OUT/session.log. AUTOSHARD_COMPILE & co. pass through to the autoshard rows (baselines/autoshard_trainer.py).
# DRY=1 rehearses on the CPU: gloo, fp32, MODELS llama:tiny hf-llama:tiny, CONFIGS autoshard,fsdp2,
# deepspeed-z3 (8 processes of ~10 s on 2 idle cores; CONFIGS=...,fsdp2-compiled adds the compiled rows, which
# also run there), 2 rounds, seq 16, 2 sequences per rank, 4 steps (2 warm-up), cluster cpu:1x$NPROC, the
# tree in $OUT/sharded.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT to the results folder}"
DRY="${DRY:-0}"
cd "$ROOT"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
TEE_PID=$!
if [[ $DRY == 1 ]]; then
  NPROC="${NPROC:-2}"
  MODELS="${MODELS:-llama:tiny hf-llama:tiny}"
  CONFIGS="${CONFIGS:-autoshard,fsdp2,deepspeed-z3}"
  ROUNDS="${ROUNDS:-2}"
  SHAPE=(--device cpu --precision fp32 --seq "${SEQ:-16}" --steps "${STEPS:-4}" --warmup "${WARMUP:-2}")
  CLUSTER="${CLUSTER:-cpu:1x$NPROC}"
  WORK="${WORK:-$OUT/sharded}"
  export OMP_NUM_THREADS=1
else
  NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
  MODELS="${MODELS:-llama:7b hf-llama:7b llama:1.3b}"
  CONFIGS="${CONFIGS:-autoshard,fsdp2-compiled,fsdp2-noreshard-compiled,fsdp2,deepspeed-z3}"
  ROUNDS="${ROUNDS:-3}"
  SHAPE=(--precision bf16 --seq "${SEQ:-2048}" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}")
  CLUSTER="${CLUSTER:-h100-sxm:1x$NPROC}"
  WORK="${WORK:-$(mktemp -d /tmp/sharded.XXXX)}"
  source "$ROOT/benchmarks/gpu_env.sh"  # the carried wheels (.whl) and the working tree as `autoshard`
fi
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
cluster_args=(--cluster "$CLUSTER")
[[ $CLUSTER == detected ]] && cluster_args=()  # plan and predict for this machine as detected
read -r -a run_args <<< "${RUN_ARGS:-}"  # more run.py arguments for every process (e.g. --plans forced ...)
[[ -n ${CALIBRATION:-} ]] && run_args+=(--calibration "$CALIBRATION")
END=${BUDGET_S:-560}  # on $SECONDS, which counts from the script's start (the wheel install included)
PROFILE_ROUND="${PROFILE_ROUND:-1}"
mkdir -p "$WORK"
not_started=()
procs=0
declare -A took  # seconds of the last process of each model:config in this call

per_gpu() {  # per_gpu MODEL: sequences per GPU in a step (the header says which)
  if [[ -n ${BATCH_PER_GPU:-} ]]; then echo "$BATCH_PER_GPU"; return; fi
  case "$1" in
    *:7b) echo 2 ;;
    hf-gemma:2b | hf-phi:2.7b | hf-qwen2:1.5b | hf-gpt2:1.5b) echo 4 ;;
    *:1.3b | hf-llama:1b | hf-qwen2:0.5b | hf-gpt2:350m | hf-gpt2:774m | hf-mixtral:1.5b) echo 8 ;;
    *) echo "${DEFAULT_PER_GPU:-$([[ $DRY == 1 ]] && echo 2 || echo 4)}" ;;
  esac
}

tag_of() {  # tag_of MODEL: the folder tag, llama:7b → llama7b, hf-qwen2:1.5b → hf-qwen2_1.5b
  local family="${1%%:*}" size="${1#*:}"
  if [[ $family == *[0-9] ]]; then echo "${family}_$size"; else echo "$family$size"; fi
}

have() {  # have MODULE: whether MODULE is importable here (found, not imported: deepspeed takes ~8 s)
  "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null
}

missing() {  # missing MODEL CONFIG: the status of a row that needs a package not installed here, else nothing
  if [[ $1 == hf-*:* ]] && ! have transformers; then echo "skipped: transformers not installed"; return; fi
  if [[ $2 == deepspeed-* ]] && ! have deepspeed; then echo "skipped: deepspeed not installed"; return; fi
  if [[ $2 == megatron-* ]] && ! have megatron; then echo "skipped: megatron-core not installed"; fi
}

record() {  # record DIR FIELDS...: DIR/proc.json from "key": value pairs (values already JSON)
  local dir="$1"; shift
  local IFS=,
  mkdir -p "$dir"
  printf '{%s}\n' "$*" > "$dir/proc.json"
}

pack() {  # the tree into one archive under $OUT (skipped when the tree is under $OUT itself: DRY)
  [[ $WORK == "$OUT"/* ]] || tar czf "$OUT/sharded.tgz" -C "$WORK" .
}

run_one() {  # run_one MODEL CONFIG ROUND: one torchrun of run.py (or a skipped record), its proc.json
  local model="$1" config="$2" round="$3"
  local group; group="$(tag_of "$model")_x$NPROC"
  local dir="$WORK/$group/${config}_r$round"
  local common=("\"model\": \"$model\"" "\"config\": \"$config\"" "\"round\": $round" "\"nproc\": $NPROC"
    "\"started\": $(date +%s)")
  local left=$((END - SECONDS)) need=${took[$model:$config]:-${MIN_START:-60}}
  if ((left < need)); then not_started+=("$model:$config:r$round"); return; fi
  local why; why="$(missing "$model" "$config")"
  if [[ -n $why ]]; then
    record "$dir" "${common[@]}" "\"status\": \"$why\""
    echo "=== $group $config r$round: $why"
    return
  fi
  local limit=$(( left < ${RUN_LIMIT:-300} ? left : ${RUN_LIMIT:-300} ))
  local profile=() batch=$(( $(per_gpu "$model") * NPROC ))
  [[ $round == "$PROFILE_ROUND" ]] && profile=(--profile)
  mkdir -p "$dir"
  echo "=== $group $config r$round (batch $batch, limit ${limit}s${profile:+, profiled}) $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc-per-node "$NPROC" benchmarks/run.py --model "$model" --configs "$config" --batch "$batch" \
    "${SHAPE[@]}" --lr "${LR:-1e-5}" --optimizer adamw ${cluster_args[@]+"${cluster_args[@]}"} \
    --graph-cache "$WORK/graphs" ${profile[@]+"${profile[@]}"} ${run_args[@]+"${run_args[@]}"} --out "$dir" \
    > "$dir.log" 2>&1
  local rc=$? wall=$((SECONDS - t0))
  procs=$((procs + 1)); took[$model:$config]=$(( wall > ${MIN_START:-60} ? wall : ${MIN_START:-60} ))
  record "$dir" "${common[@]}" "\"rc\": $rc" "\"wall_s\": $wall" "\"limit_s\": $limit" \
    "\"profiled\": $([[ ${#profile[@]} -gt 0 ]] && echo true || echo false)"
  echo "=== $group $config r$round rc=$rc in ${wall}s"
  grep -E "^\| $config \|" "$dir/results.md" 2>/dev/null | cut -c1-220
  pack
}

echo "=== sharded session: NPROC=$NPROC MODELS=\"$MODELS\" CONFIGS=$CONFIGS ROUNDS=$ROUNDS cluster $CLUSTER" \
  "budget ${BUDGET_S:-560}s, tree $WORK $(date -u +%H:%M:%S)"
[[ $DRY == 1 ]] || nvidia-smi -L
for model in $MODELS; do
  for ((round = ${FIRST_ROUND:-1}; round <= ROUNDS; round++)); do
    for config in ${CONFIGS//,/ }; do
      run_one "$model" "$config" "$round"
    done
  done
done
CACHE="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(id -un)}"
echo "=== $procs processes in ${SECONDS}s; Inductor cache $CACHE: $(du -sh "$CACHE" 2>/dev/null | cut -f1)"
((${#not_started[@]} == 0)) || echo "=== not started (budget): ${not_started[*]} (another call: MODELS and" \
  "ROUNDS for these, then benchmarks/sharded_summary.py over both trees)"
"$PYTHON" benchmarks/sharded_summary.py "$WORK" > "$OUT/summary.md"
cp "$OUT/summary.md" "$WORK/summary.md" 2>/dev/null
pack
cat "$OUT/summary.md"
exec >&- 2>&-
wait "$TEE_PID"  # session.log complete before the call returns
