#!/usr/bin/env bash
# The RL step on GPUs: measured against predicted, per rollout layout, with the floors to beat
# (docs/ppo.md "Rollout layout"; results in benchmarks/results/rl_step_*).
#
# On one machine of N = 1, 2 or 4 GPUs: calibrate once over N ranks (the only measured input the predictions
# read), then
#   runs4   `autoshard ppo MODEL --rollout-tp R` on 4 GPUs for each "MODEL:R" of RUNS4 (R = auto: co-planned;
#           skipped with N = 2)
#   runs2   the same on 2 GPUs for RUNS2 (two at a time on GPUs 0,1 and 2,3 when N = 4)
#   runs1   the same on GPU 0 alone for RUNS1 (default none; N = 1 runs only these)
#   floor   one GPU, Hugging Face generate with a KV cache, for each model of FLOOR (batch = BATCH)
#   reshard RolloutEngine.sync against bytes and NVLink, ZeRO-3 training over N ranks, for RESHARD models
# Every run: bf16, the bytes tokenizer (258 ids), PROMPT-byte prompts, NEW new tokens, BATCH sequences per RL
# step, STEPS steps (the first is warm-up), reward benchmarks/rl_bench.py:length_reward.
# Files: $OUT/<run>.jsonl (metrics), <run>.plan.json (plan with its rollout section), logs, cal.json,
# floor.jsonl, reshard.jsonl; benchmarks/rl_summary.py $OUT prints the table. PROFILE=1: every run records its
# second step (--profile) and benchmarks/trace_phases.py writes <run>.phases.md (per phase: compute,
# collectives and idle device time, top CPU ops); the traces themselves are not kept (size).
# A run still going 15 s before its limit gets SIGABRT in every rank (PYTHONFAULTHANDLER=1): each rank's Python
# stack lands in <run>.log, so a stalled run says where it stalled.
set -u
ROOT="$(pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:?set OUT}"
WORK="${WORK:-/tmp/rl_work}"
BUDGET_S="${BUDGET_S:-540}"
STEPS="${STEPS:-4}" BATCH="${BATCH:-64}" PROMPT="${PROMPT:-128}" NEW="${NEW:-128}"
RUNS4="${RUNS4-llama:1.3b:auto llama:1.3b:1 llama:1.3b:4 llama:7b:auto}"
RUNS2="${RUNS2-llama:1.3b:auto llama:7b:auto}"
RUNS1="${RUNS1-}"
FLOOR="${FLOOR-llama:1.3b llama:7b}"
RESHARD="${RESHARD-llama:1.3b}"
LIMIT="${LIMIT:-300}"
mkdir -p "$OUT" "$WORK"
source "$ROOT/benchmarks/gpu_env.sh"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"  # PPO's shapes vary per step
export PYTHONFAULTHANDLER=1  # a rank sent SIGABRT prints its Python stack (the stall watcher in ppo())
left() { echo $((BUDGET_S - SECONDS)); }

N="$(nvidia-smi -L 2>/dev/null | wc -l)"
[[ $N -ge 4 ]] && N=4
ALL="$(seq -s, 0 $((N - 1)))"
timeout 240 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$N" \
  -m autoshard.calibrate --out "$OUT/cal.json" > "$OUT/calibrate.log" 2>&1
echo "=== calibrate rc=$? at ${SECONDS}s"
"$PYTHON" benchmarks/rl_bench.py prompts --len "$PROMPT" --count 512 --out "$WORK/prompts.jsonl"
for n in $(printf '%s\n' 1 2 "$N" | sort -un); do  # this machine as detected, with n GPUs visible: the clusters
  [[ $n -le $N ]] || continue                         # the runs plan for
  CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((n - 1)))" "$PYTHON" -c \
    "import json; from autoshard.cluster_detect import detect_dict; print(json.dumps(detect_dict()))" > "$OUT/cluster_x$n.json"
done

ppo() {  # ppo NAME GPUS MODEL RTP
  local t0=$SECONDS lim=$(( $(left) < LIMIT ? $(left) : LIMIT ))
  [[ $lim -lt 30 ]] && { echo "=== $1 skipped: budget"; return; }
  local n=$(( $(tr -cd , <<< "$2" | wc -c) + 1 ))
  # the stall watcher: 15 s before the limit, every rank of this run dumps its stack (header note)
  ( sleep $((lim - 15)); pkill -ABRT -f "ppo_program.*--metrics $OUT/$1.jsonl" ) & local watcher=$!
  CUDA_VISIBLE_DEVICES="$2" timeout "$lim" "$PYTHON" -m autoshard ppo "$3" --cluster "$OUT/cluster_x$n.json" \
    --calibration "$OUT/cal.json" --precision bf16 --prompts "$WORK/prompts.jsonl" --tokenizer bytes --context $((PROMPT + NEW)) \
    --reward "$ROOT/benchmarks/rl_bench.py:length_reward" --max-new-tokens "$NEW" --batch "$BATCH" \
    --steps "$STEPS" --rollout-tp "$4" --metrics "$OUT/$1.jsonl" ${PROFILE:+--profile} -q > "$OUT/$1.log" 2>&1
  local rc=$?
  kill "$watcher" 2>/dev/null
  if [[ -n "${PROFILE:-}" ]]; then
    "$PYTHON" benchmarks/trace_phases.py "$OUT/$1".rank*.trace.json > "$OUT/$1.phases.md" 2>&1
    rm -f "$OUT/$1".rank*.trace.json
  fi
  echo "=== $1 rc=$rc in $((SECONDS - t0))s: $(tail -1 "$OUT/$1.log" | cut -c1-200)"
}

for run in $RUNS1; do
  model="${run%:*}"; rtp="${run##*:}"
  ppo "x1_${model/:/_}_r$rtp" 0 "$model" "$rtp"
done
[[ $N -lt 2 ]] && RUNS2=""
[[ $N -lt 4 ]] && RUNS4=""
for run in $RUNS4; do
  model="${run%:*}"; rtp="${run##*:}"
  ppo "x4_${model/:/_}_r$rtp" 0,1,2,3 "$model" "$rtp"
done
set -- $RUNS2
while [[ $# -gt 0 ]]; do
  a="$1"; b="${2:-}"
  ma="${a%:*}"; ppo "x2_${ma/:/_}_r${a##*:}" 0,1 "$ma" "${a##*:}" &
  if [[ $N -ge 4 && -n "$b" ]]; then
    mb="${b%:*}"; ppo "x2_${mb/:/_}_r${b##*:}" 2,3 "$mb" "${b##*:}" &
    shift
  fi
  wait
  shift
done
for model in $FLOOR; do
  [[ $(left) -lt 40 ]] && break
  CUDA_VISIBLE_DEVICES=0 timeout 120 "$PYTHON" benchmarks/rl_bench.py floor --model "$model" --batch "$BATCH" \
    --prompt "$PROMPT" --new "$NEW" >> "$OUT/floor.jsonl" 2> "$OUT/floor_${model/:/_}.log"
  echo "=== floor $model rc=$?"
done
for model in $RESHARD; do
  [[ $(left) -lt 40 ]] && break
  CUDA_VISIBLE_DEVICES="$ALL" timeout 150 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$N" \
    benchmarks/rl_bench.py reshard --model "$model" --rollout 1 2 4 >> "$OUT/reshard.jsonl" 2> "$OUT/reshard_${model/:/_}.log"
  echo "=== reshard $model rc=$?"
done
"$PYTHON" benchmarks/rl_summary.py "$OUT" > "$OUT/summary.md" 2> "$OUT/summary.err"
cat "$OUT/summary.md"
# one archive of everything (metrics, plans, logs, calibration) beside the summary
tar czf "$WORK/campaign.tgz" -C "$OUT" . && find "$OUT" -type f ! -name summary.md -delete && mv "$WORK/campaign.tgz" "$OUT/"
