#!/usr/bin/env bash
# Every GPU measurement this project records, in one call on a 2-GPU machine (no network).
#
#   OUT=/some/dir benchmarks/gpu_session.sh [STEP...]
#
# Steps (default: all, in this order; each is time-boxed so one failure cannot eat the call):
#   env       card, driver, torch/triton versions
#   nccl      NCCL numerics of the autoshard:: collectives (tests/test_collectives_gpu.py)
#   overlap   ZeRO-3 step time with schedule_overlap on vs off, plus profiler overlap evidence
#   bench     autoshard's searched + forced plans vs FSDP2 / Megatron-Core / DeepSpeed, calibrated
#   ppo       PPO on a >= 350m reference policy under its searched plan
# Results land in $OUT (json/md/log); commit them under benchmarks/results/ with the card and date.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/out/gpu}"
# Work in a scratch folder and re-pack it into one archive after every step: the device tool
# returns at most 8 files, and a step killed by the call's limit still leaves the earlier ones.
RESULTS="$OUT"
OUT="$(mktemp -d /tmp/gpu_session.XXXX)"
mkdir -p "$RESULTS"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 PYTHONUNBUFFERED=1
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(env overlap ppo bench nccl)
TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 2)

step() {  # step NAME SECONDS CMD...
  local name="$1" limit="$2"; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$OUT/$name.log"
  tar czf "$RESULTS/gpu_session.tgz" -C "$OUT" .
}

for s in "${STEPS[@]}"; do
  case "$s" in
    env) step env 30 bash -c "nvidia-smi; nvidia-smi topo -m; $PYTHON -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))'" ;;
    nccl) step nccl 60 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/test_collectives_gpu.py ;;
    overlap) step overlap 170 "${TORCHRUN[@]}" benchmarks/overlap_bench.py --device cuda --out "$OUT/overlap.json" ;;
    bench) step bench 330 env OUT_DIR="$OUT/bench" benchmarks/gpu_run.sh --calibrate --nproc 2 -- \
        --model llama:350m --batch 16 --seq 1024 --plans forced --max-plans "${BENCH_PLANS:-12}" --steps 6 --warmup 2 \
        --configs "${BENCH_CONFIGS:-autoshard,fsdp2,fsdp2-noreshard,megatron-tp,megatron-tp-sp,deepspeed-z2,deepspeed-z3}" ;;
    ppo) step ppo 110 "$PYTHON" -m autoshard.cli ppo llama:350m --cluster h100-sxm:1x2 --task arithmetic --steps "${PPO_STEPS:-10}" --precision bf16 \
        --metrics "$OUT/ppo_gpu.jsonl" ;;
    *) echo "unknown step $s" ;;
  esac
done
ls -laR "$OUT"
