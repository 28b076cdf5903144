#!/usr/bin/env bash
# Run benchmarks/run.py on an offline GPU machine (docs/benchmarks.md).
#
#   benchmarks/gpu_run.sh [--calibrate] [--nproc N] -- [run.py arguments...]
#
# 1. installs the carried wheelhouse .whl/ (scripts/build_wheelhouse.py --baselines) into /tmp/site,
#    as README "Air-gapped GPU machines" says, except autoshard's own wheel: the working tree is used
#    instead, through a symlink shim that maps passes/ kernels/ search/ runtime/ into the autoshard
#    package the way pyproject.toml's package-dir does (no build, no network);
# 2. with --calibrate, runs `autoshard cluster calibrate` logic over every GPU into $OUT_DIR/calibration.json
#    and passes it to run.py as --calibration;
# 3. torchrun --standalone --nproc-per-node N benchmarks/run.py ARGS (N defaults to every visible GPU).
#
# Environment: OUT_DIR (default out/bench), SITE (default /tmp/site), SHIM (default /tmp/autoshard_src).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${SITE:-/tmp/site}"
SHIM="${SHIM:-/tmp/autoshard_src}"
OUT_DIR="${OUT_DIR:-$ROOT/out/bench}"
PYTHON="${PYTHON:-python3}"
CALIBRATE=0
NPROC=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --calibrate) CALIBRATE=1; shift ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

source "$ROOT/benchmarks/gpu_env.sh"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron SP overlap ordering

if [[ -z "$NPROC" ]]; then
  NPROC="$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')"
fi
mkdir -p "$OUT_DIR"
cd "$ROOT"
"$PYTHON" -c 'import autoshard.runtime, autoshard.search, torch; print("autoshard from", autoshard.__file__, "torch", torch.__version__)'

EXTRA=()
if [[ "$CALIBRATE" == 1 ]]; then
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m autoshard.calibrate \
    --out "$OUT_DIR/calibration.json" --raw "$OUT_DIR/calibration_raw.json"
  EXTRA=(--calibration "$OUT_DIR/calibration.json")
fi

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/run.py \
  --out "$OUT_DIR" ${EXTRA[@]+"${EXTRA[@]}"} "$@"
