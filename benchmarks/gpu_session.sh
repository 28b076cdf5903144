#!/usr/bin/env bash
# Every GPU measurement this project records, in one call on a GPU machine (no network).
#
#   OUT=/some/dir [NPROC=2] benchmarks/gpu_session.sh [STEP...]
#
# NPROC: processes (GPUs) of the torchrun steps (overlap, bench), default 2.
# Steps (default: env overlap ppo bench nccl, in this order; each is time-boxed so one failure
# cannot eat the call):
#   env       card, driver, torch/triton versions
#   nccl      NCCL numerics of the autoshard:: collectives (tests/test_collectives_gpu.py)
#   overlap   ZeRO-3 step time with schedule_overlap on vs off, plus profiler overlap evidence
#   bench     autoshard's searched + forced plans vs FSDP2 / Megatron-Core / DeepSpeed, calibrated
#   ppo       PPO on a >= 350m reference policy under its searched plan
#   matrix    (4 GPUs) one benchmarks/run.py per (model, world), below; not in the default list
#   kernels   quantize/dequantize kernels vs copy bandwidth on one GPU (KERNEL_GPU, default 0)
#   qcomm     qwZ all-gather of 1 GiB bf16 over 2 GPUs: bf16 vs int8/fp8 (PAIR_GPUS, default 0,1)
#   side      kernels on GPU 0 while qcomm then overlap run on GPUs 2,3 (a 4-GPU machine); QCOMM=0 skips
#             qcomm, OVERLAP_RUNS="MODEL:BATCH ..." picks the overlap runs (default gpt:1.3b:8)
#   calibrate `autoshard cluster calibrate` over NPROC GPUs with the llama:350m model probe, then the
#             probes of the other matrix models one per GPU in parallel; writes $OUT/cal/<model>.json
#             (the NPROC-GPU measurements + that model's probe), which matrix runs pass as --calibration
#             (CAL_DIR overrides $OUT/cal, so a later call on the same or a fresh machine can reuse the files);
#             CAL_COMPILE=1 scales the layer probes to the model's step compiled whole (calibrate --compile:
#             1 and 3 blocks per micro-batch; the runtime compiles on CUDA by default; this version not yet
#             run on a GPU: raise CAL_PROBE_LIMIT, default 120 s per model);
#             CAL_LAYERS_FROM=DIR reuses DIR's layer probes when its card is this machine's (single-GPU
#             timings) and measures only matmul, AdamW and collectives over NPROC GPUs
# Results land in $OUT (json/md/log, packed into $OUT/gpu_session.tgz after every step and every
# matrix run); commit them under benchmarks/results/ with the card and date.
#
# matrix: autoshard's searched plan next to fsdp2, fsdp2-noreshard, fsdp2-noreshard-compiled,
# megatron-tp, megatron-tp-sp, deepspeed-z2, deepspeed-z3 (MATRIX_CONFIGS), seq 1024, global batch
# 16, 10 steps of which 3 are untimed, bf16, calibrated with $CAL_DIR/<model>.json when present; every row records its per-step losses, and results.md ends with
# the loss agreement (autoshard's TP plan vs megatron-tp*, ZeRO-3 vs ZeRO-3). Runs, in priority
# order (MATRIX_RUNS picks a comma-separated subset, in this order):
#   llama350m_x4   4 GPUs, best + 11 forced plans (--variants: TP 4 and TP 4 + SP first, so the
#                  Megatron rows have a same-degree autoshard TP plan; >= 10 plans predicted and
#                  measured)
#   gpt1.3b_x4     4 GPUs, best (GPT: tied embedding/head, vocabulary padded for Megatron)
#   1.3b_x2        llama:1.3b (+ tp2) on GPUs 0,1 and gpt:1.3b on GPUs 2,3 at the same time (two
#                  independent 2-GPU jobs on disjoint NVLink pairs; MATRIX_PARALLEL2=0, the default
#                  when NPROC < 4, runs them one after the other on GPUs 0,1)
#   llama350m_x2, gpt350m_x2   2 GPUs (0,1), best + tp2 / best; with 1.3b_x2 the default list
#                  when NPROC < 4 (a 2-GPU machine)
#   llama1.3b_x4   4 GPUs, best + tp4 (TP plan for the loss agreement)
#   gpt350m_x4     4 GPUs, best
#   gpt1.3b_x4_sdpa  (only when named in MATRIX_RUNS) gpt1.3b_x4 with --attn sdpa
# Time budget (estimate from the code, H100 host; see docs/benchmarks.md "Matrix"): per torchrun
# ~25 s (start, imports, NCCL, capture, search), per autoshard plan ~10-13 s (build_program exports
# the model) + steps, per baseline 5-15 s + steps (DeepSpeed import ~8 s once), steps 0.2-1 s each:
# llama350m_x4 ~250 s, gpt1.3b_x4 ~125 s, 1.3b_x2 ~150 s, llama1.3b_x4 ~140 s, gpt350m_x4 ~95 s,
# ~760 s in all: more than one 10-minute call. A run starts only while MATRIX_BUDGET_S (default
# 480, counted from the matrix step's start) leaves >= 90 s, and is killed at the budget's end
# (results.json is rewritten after every config, so a killed run keeps its finished rows); the
# rest is named in the log for a second call with MATRIX_RUNS. MATRIX_DRY=1 rehearses the step on
# the CPU (tiny models, gloo, fp32; what CI cannot do for the shell logic).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out/gpu}"
NPROC="${NPROC:-2}"
# Work in a scratch folder and re-pack it into one archive after every step: the device tool
# returns at most 8 files, and a step killed by the call's limit still leaves the earlier ones.
RESULTS="$OUT"
OUT="$(mktemp -d /tmp/gpu_session.XXXX)"
mkdir -p "$RESULTS"
GPT_ATTN="${GPT_ATTN:-sdpa}"  # GPT's attention in the matrix, calibrate and probe steps (math: the explicit path)
CAL_DIR="${CAL_DIR:-$OUT/cal}"  # calibration files (calibrate step); point it outside $OUT to reuse them in a later call
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron SP overlap ordering
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(env overlap ppo bench nccl)
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
ALL_CONFIGS=autoshard,fsdp2,fsdp2-noreshard,fsdp2-noreshard-compiled,megatron-tp,megatron-tp-sp,deepspeed-z2,deepspeed-z3

pack() { tar czf "$RESULTS/gpu_session.tgz" -C "$OUT" .; }

timed() {  # timed NAME SECONDS CMD...: run CMD into $OUT/NAME.log under a time limit
  local name="$1" limit="$2"; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
}

step() { timed "$@"; pack; }  # step NAME SECONDS CMD...

bench_cmd() {  # bench_cmd NAME GPUS ARGS...: sets CMD to one matrix run's torchrun line on GPUS (e.g. 0,1)
  local name="$1" gpus="$2"; shift 2
  local n; n=$(awk -F, '{print NF}' <<< "$gpus")
  local shape=(--seq 1024 --batch 16 --precision bf16) args=("$@")
  if [[ "${MATRIX_DRY:-0}" == 1 ]]; then  # CPU rehearsal of the shell logic: tiny models, gloo
    shape=(--seq 16 --batch 8 --precision fp32 --device cpu)
    args=("${args[@]/%:350m/:tiny}"); args=("${args[@]/%:1.3b/:tiny}")
  fi
  local cal=() model i
  for ((i = 0; i < ${#args[@]} - 1; i++)); do [[ ${args[i]} == --model ]] && model=${args[i + 1]}; done
  [[ -n ${model:-} && -f "$CAL_DIR/${model/:/_}.json" ]] && cal=(--calibration "$CAL_DIR/${model/:/_}.json")
  CMD=(env CUDA_VISIBLE_DEVICES="$gpus" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$n"
    benchmarks/run.py --out "$OUT/matrix/$name" "${shape[@]}" --steps "${MATRIX_STEPS:-10}"
    --warmup "${MATRIX_WARMUP:-3}" --configs "${MATRIX_CONFIGS:-$ALL_CONFIGS}" ${cal[@]+"${cal[@]}"} "${args[@]}")
  [[ ",${MATRIX_PROFILE:-}," == *",$name,"* ]] && CMD+=(--profile)  # MATRIX_PROFILE: runs that profile a step per config
  [[ ",${MATRIX_MEMORY:-}," == *",$name,"* ]] && CMD+=(--memory-snapshot)  # MATRIX_MEMORY: runs that record what is live at the peak
}

matrix_limit() {  # matrix_limit NAME CAP: sets LIMIT, the seconds the next run may take (0: do not start it)
  local left=$((MATRIX_END - SECONDS))
  LIMIT=$(( left < 90 ? 0 : (left < $2 ? left : $2) ))
  ((LIMIT > 0)) || echo "=== matrix $1 not started: ${left}s of the budget left (run it with MATRIX_RUNS=$1)"
}

matrix_run() {  # matrix_run NAME CAP GPUS ARGS...
  local name="$1" cap="$2" gpus="$3"; shift 3
  matrix_limit "$name" "$cap"
  ((LIMIT > 0)) || return 0
  bench_cmd "$name" "$gpus" "$@"
  timed "matrix_$name" "$LIMIT" "${CMD[@]}"
  pack
}

matrix_pair() {  # llama:1.3b and gpt:1.3b on 2 GPUs each; at the same time on disjoint pairs on 4 GPUs
  local parallel=${MATRIX_PARALLEL2:-$((NPROC >= 4))}
  matrix_limit 1.3b_x2 $((parallel == 1 ? 220 : 440))
  ((LIMIT > 0)) || return 0
  local llama gpt
  bench_cmd llama1.3b_x2 0,1 --model llama:1.3b --variants tp2; llama=("${CMD[@]}")
  if [[ $parallel == 1 ]]; then
    bench_cmd gpt1.3b_x2 2,3 --model gpt:1.3b --attn "$GPT_ATTN"; gpt=("${CMD[@]}")
    timed matrix_llama1.3b_x2 "$LIMIT" "${llama[@]}" &
    timed matrix_gpt1.3b_x2 "$LIMIT" "${gpt[@]}" &
    wait
  else
    bench_cmd gpt1.3b_x2 0,1 --model gpt:1.3b --attn "$GPT_ATTN"; gpt=("${CMD[@]}")
    timed matrix_llama1.3b_x2 "$((LIMIT / 2))" "${llama[@]}"
    timed matrix_gpt1.3b_x2 "$((LIMIT / 2))" "${gpt[@]}"
  fi
  pack
}

matrix() {
  MATRIX_END=$((SECONDS + ${MATRIX_BUDGET_S:-480}))
  local default=llama350m_x4,gpt1.3b_x4,1.3b_x2,llama1.3b_x4,gpt350m_x4
  ((NPROC >= 4)) || default=1.3b_x2,llama350m_x2,gpt350m_x2  # a 2-GPU machine
  local runs=",${MATRIX_RUNS:-$default},"
  local forced=free,replicate,zero3,tp4,tp4-sp,tp2,pp2-1f1b,zero3-int8w,zero2-int8g,zero3-selective,tp2-sp,zero3-rep2
  mkdir -p "$OUT/matrix"
  [[ $runs == *,llama350m_x4,* ]] && matrix_run llama350m_x4 330 0,1,2,3 --model llama:350m --plans forced \
      --variants "$forced" --max-plans 12
  [[ $runs == *,gpt1.3b_x4,* ]] && matrix_run gpt1.3b_x4 200 0,1,2,3 --model gpt:1.3b --attn "$GPT_ATTN"
  [[ $runs == *,1.3b_x2,* ]] && matrix_pair
  [[ $runs == *,llama350m_x2,* ]] && matrix_run llama350m_x2 150 0,1 --model llama:350m --variants tp2
  [[ $runs == *,gpt350m_x2,* ]] && matrix_run gpt350m_x2 150 0,1 --model gpt:350m --attn "$GPT_ATTN" --variants tp2
  [[ $runs == *,llama1.3b_x4,* ]] && matrix_run llama1.3b_x4 200 0,1,2,3 --model llama:1.3b --variants tp4
  [[ $runs == *,gpt350m_x4,* ]] && matrix_run gpt350m_x4 150 0,1,2,3 --model gpt:350m --attn "$GPT_ATTN"
  # opt-in (not in the default list): the searched plans of llama1.3b_x4 and gpt1.3b_x4 again with the
  # gradient sync after backward (the runtime before overlapped syncs), next to the same baseline rows
  [[ $runs == *,llama1.3b_x4_blocking,* ]] && AUTOSHARD_OVERLAP_GRAD_SYNC=0 \
      matrix_run llama1.3b_x4_blocking 120 0,1,2,3 --model llama:1.3b --configs autoshard,fsdp2-noreshard
  [[ $runs == *,gpt1.3b_x4_blocking,* ]] && AUTOSHARD_OVERLAP_GRAD_SYNC=0 \
      matrix_run gpt1.3b_x4_blocking 120 0,1,2,3 --model gpt:1.3b --attn "$GPT_ATTN" --configs autoshard,fsdp2-noreshard
  # opt-in (not in the default list): GPT-1.3B with the explicit math attention, as recorded before
  # GPT_ATTN defaulted to sdpa
  [[ $runs == *,gpt1.3b_x4_math,* ]] && matrix_run gpt1.3b_x4_math 200 0,1,2,3 --model gpt:1.3b --attn math
  "$PYTHON" benchmarks/matrix_summary.py "$OUT/matrix" > "$OUT/matrix/summary.md" 2>&1
  cat "$OUT/matrix/summary.md"
  pack
}

calibrate_all() {  # calibration files per matrix model (header); each probe at seq 1024, micro-batches 1..16
  mkdir -p "$CAL_DIR"
  local tps=1 t=2; while ((t <= NPROC)); do tps+=",$t"; t=$((t * 2)); done  # TP shards up to the world
  local probe=(--seq 1024 --micro-batch 1,2,4,8,16 --probe-tp "$tps")
  [[ ${CAL_COMPILE:-0} == 1 ]] && probe+=(--compile)  # layer times scaled to the compiled step, as the runtime runs
  if [[ -n ${CAL_LAYERS_FROM:-} ]] && "$PYTHON" - "$CAL_LAYERS_FROM/llama_350m.json" <<'PY'
import json, sys, torch
sys.exit(json.load(open(sys.argv[1]))["device"] != torch.cuda.get_device_name(0))
PY
  then  # same card as the reused layer probes (single-GPU timings): measure only matmul and collectives
    timed calibrate "${CAL_LIMIT:-150}" "${TORCHRUN[@]}" -m autoshard.calibrate --out "$CAL_DIR/base.json" \
      --raw "$CAL_DIR/raw.json"
    "$PYTHON" - "$CAL_DIR" "$CAL_LAYERS_FROM" <<'PY'
import json, pathlib, sys
cal, src = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
base = json.loads((cal / "base.json").read_text())
for f in sorted(src.glob("*_*.json")):
    if f.name.startswith(("single_", "raw")) or "layer_times" not in (old := json.loads(f.read_text())):
        continue
    (cal / f.name).write_text(json.dumps(dict(base, layer_times=old["layer_times"]), indent=2) + "\n")
    print("calibration", f.name, f"= collectives/matmul measured now + the layer probe of {f} (same card)")
PY
  else
    timed calibrate "${CAL_LIMIT:-150}" "${TORCHRUN[@]}" -m autoshard.calibrate --out "$CAL_DIR/llama_350m.json" \
      --raw "$CAL_DIR/raw.json" --model llama:350m "${probe[@]}"
    local i=0 m gpu lists=()
    for m in gpt:350m llama:1.3b gpt:1.3b; do  # the other models' probes, one GPU each, round robin
      lists[i % NPROC]+=" $m"; i=$((i + 1))
    done
    for gpu in "${!lists[@]}"; do  # GPUs in parallel; the probes of one GPU one after the other
      (for m in ${lists[gpu]}; do
        local attn=(); [[ $m == gpt:* ]] && attn=(--attn "$GPT_ATTN")
        timed "probe_${m/:/_}" "${CAL_PROBE_LIMIT:-120}" env CUDA_VISIBLE_DEVICES=$gpu "$PYTHON" -m autoshard.calibrate \
          --out "$CAL_DIR/single_${m/:/_}.json" --model "$m" "${probe[@]}" "${attn[@]}"
      done) &
    done
    wait
    "$PYTHON" - "$CAL_DIR" <<'PY'
import json, pathlib, sys
cal = pathlib.Path(sys.argv[1])
base = json.loads((cal / "llama_350m.json").read_text())
for single in sorted(cal.glob("single_*.json")):
    merged = dict(base, layer_times=json.loads(single.read_text())["layer_times"])
    (cal / single.name.removeprefix("single_")).write_text(json.dumps(merged, indent=2) + "\n")
    print("calibration", single.name.removeprefix("single_"), "= collectives/matmul of llama_350m.json + its probe")
PY
  fi
  [[ "$CAL_DIR" == "$OUT/cal" ]] || cp -r "$CAL_DIR" "$OUT/cal"
  pack
}

side() {  # kernels on one GPU while the 2-GPU qcomm and overlap runs share another pair
  timed kernels 170 env CUDA_VISIBLE_DEVICES="${KERNEL_GPU:-0}" "$PYTHON" benchmarks/kernels_bench.py \
    --blocks 512 2048 --world 0 --deadline 120 --out "$OUT/kernels_h100.json" &
  ( PAIR_GPUS=2,3 run_pair ) &
  wait
  pack
}

run_pair() {  # qcomm then overlap on PAIR_GPUS
  local pair=(env CUDA_VISIBLE_DEVICES="${PAIR_GPUS:-0,1}" "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2)
  [[ "${QCOMM:-1}" == 1 ]] && timed qcomm 90 "${pair[@]}" benchmarks/qcomm_bench.py --out "$OUT/qcomm_h100x2.json"
  local run model batch
  for run in ${OVERLAP_RUNS:-gpt:1.3b:8}; do  # MODEL:GLOBAL_BATCH, one overlap_bench run each
    model=${run%:*}; batch=${run##*:}
    timed "overlap_${model/:/_}_b$batch" 200 "${pair[@]}" benchmarks/overlap_bench.py --device cuda --model "$model" \
      --global-batch "$batch" --out "$OUT/overlap_${model/:/_}_b$batch.json" ${OVERLAP_ARGS:-}
  done
}

for s in "${STEPS[@]}"; do
  case "$s" in
    env) step env 30 bash -c "nvidia-smi; nvidia-smi topo -m; $PYTHON -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'" ;;
    nccl) step nccl 60 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_collectives_gpu.py ;;
    overlap) step overlap 170 "${TORCHRUN[@]}" benchmarks/overlap_bench.py --device cuda --out "$OUT/overlap.json" ;;
    bench) step bench 330 env OUT_DIR="$OUT/bench" benchmarks/gpu_run.sh --calibrate --nproc "$NPROC" -- \
        --model llama:350m --batch 16 --seq 1024 --plans forced --max-plans "${BENCH_PLANS:-12}" --steps 6 --warmup 2 \
        --configs "${BENCH_CONFIGS:-$ALL_CONFIGS}" ;;
    ppo) step ppo 110 "$PYTHON" -m autoshard.cli ppo llama:350m --cluster h100-sxm:1x2 --task arithmetic --steps "${PPO_STEPS:-10}" --precision bf16 \
        --metrics "$OUT/ppo_gpu.jsonl" ;;
    matrix) matrix ;;
    kernels) step kernels 170 env CUDA_VISIBLE_DEVICES="${KERNEL_GPU:-0}" "$PYTHON" benchmarks/kernels_bench.py \
        --blocks 512 2048 --world 0 --deadline 120 --out "$OUT/kernels_h100.json" ;;
    qcomm) step qcomm 90 env CUDA_VISIBLE_DEVICES="${PAIR_GPUS:-0,1}" "$PYTHON" -m torch.distributed.run --standalone \
        --nproc-per-node 2 benchmarks/qcomm_bench.py --out "$OUT/qcomm_h100x2.json" ;;
    side) side ;;
    calibrate) calibrate_all ;;
    *) echo "unknown step $s" ;;
  esac
done
ls -laR "$OUT"
