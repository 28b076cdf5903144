#!/usr/bin/env bash
# The sharded-regime campaign on one 4-GPU machine, in device calls of at most 10 minutes each:
# phases of benchmarks/sharded_session.sh, each writing under $OUT/<phase>-<name>/.
#
#   OUT=/some/dir benchmarks/sharded_campaign.sh PHASE
#
# PHASE
#   x4        llama:7b on all 4 GPUs, every config, ROUNDS (3) rounds within BUDGET_S (560 s)
#   pairs     two 2-GPU sessions at once on disjoint GPU pairs (0,1 and 2,3): PAIR_A (default llama:7b) and
#             PAIR_B (hf-llama:7b), every config, 3 rounds each within BUDGET_S
#   rest      X4_REST (default: llama:7b, the three leading configs, rounds 3) on 4 GPUs, then PAIR_A_REST
#             (llama:1.3b) and PAIR_B_REST (empty) on the pairs; BUDGET_S split by REST_SPLIT_S (240) for the
#             4-GPU part
#
# Two sessions on disjoint pairs share the host's CPUs (64 cores), memory and the Inductor cache;
# each compares its configs side by side on its own pair, one process at a time. Their tables say
# so (summary header "pair"). benchmarks/sharded_summary.py pools several phase folders of one
# (model, world) into one table.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:?set OUT to the results folder}"
PHASE="${1:?phase: x4 | pairs | rest}"
BUDGET_S="${BUDGET_S:-560}"
ALL=autoshard,fsdp2-compiled,fsdp2-noreshard-compiled,fsdp2,deepspeed-z3
LEAD=autoshard,fsdp2-compiled,fsdp2-noreshard-compiled

session() {  # session NAME GPUS NPROC MODELS CONFIGS ROUNDS BUDGET [FIRST_ROUND]
  local name="$1" gpus="$2" nproc="$3" models="$4" configs="$5" rounds="$6" budget="$7"
  CUDA_VISIBLE_DEVICES="$gpus" NPROC="$nproc" MODELS="$models" CONFIGS="$configs" ROUNDS="$rounds" \
    BUDGET_S="$budget" FIRST_ROUND="${8:-1}" OUT="$OUT/$name" bash "$ROOT/benchmarks/sharded_session.sh" \
    > /dev/null 2>&1
}

case "$PHASE" in
  x4)
    session x4 0,1,2,3 4 "${X4_MODELS:-llama:7b}" "${CONFIGS:-$ALL}" "${ROUNDS:-3}" "$BUDGET_S" ;;
  pairs)
    session pairA 0,1 2 "${PAIR_A:-llama:7b}" "${CONFIGS:-$ALL}" "${ROUNDS:-3}" "$BUDGET_S" &
    session pairB 2,3 2 "${PAIR_B:-hf-llama:7b}" "${CONFIGS:-$ALL}" "${ROUNDS:-3}" "$BUDGET_S" &
    wait ;;
  rest)
    split="${REST_SPLIT_S:-240}"
    [[ -n ${X4_REST-llama:7b} ]] && session x4rest 0,1,2,3 4 "${X4_REST-llama:7b}" "${X4_REST_CONFIGS:-$LEAD}" \
      "${X4_REST_ROUNDS:-3}" "$split" "${X4_REST_FIRST:-3}"
    left=$((BUDGET_S - SECONDS))
    [[ -n ${PAIR_A_REST-llama:1.3b} ]] && session pairArest 0,1 2 "${PAIR_A_REST-llama:1.3b}" \
      "${CONFIGS:-$ALL}" "${ROUNDS:-3}" "$left" &
    [[ -n ${PAIR_B_REST:-} ]] && session pairBrest 2,3 2 "$PAIR_B_REST" "${CONFIGS:-$ALL}" "${ROUNDS:-3}" "$left" &
    wait ;;
  *) echo "unknown phase $PHASE (x4 | pairs | rest)" >&2; exit 2 ;;
esac
for dir in "$OUT"/*/; do
  [[ -f $dir/summary.md ]] && { echo "## $(basename "$dir")"; sed -n '1,40p' "$dir/summary.md"; }
done
