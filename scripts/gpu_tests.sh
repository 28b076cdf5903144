#!/usr/bin/env bash
# The `gpu`-marked tests (never in CI) on a CUDA machine without network: `pytest -m gpu`.
#
#   scripts/gpu_tests.sh [pytest arguments...]
#
# Sources benchmarks/gpu_env.sh as the GPU benchmark scripts do (the carried wheelhouse .whl/ into
# $SITE, the working tree through a symlink shim, PYTHONPATH). pytest must already be installed on
# the machine: the wheelhouse does not carry it. Only the test files that mark tests `gpu` are
# collected, so the CPU suite's extras (hypothesis, transformers, ...) need not be there.
# Prints pytest's output, then one line: `gpu tests: <pytest summary> (rc N, S s, G GPUs)`.
# Environment: PYTHON (default python3); SITE and SHIM as in gpu_env.sh.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
source "$ROOT/benchmarks/gpu_env.sh"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1 PYTHONUNBUFFERED=1

mapfile -t FILES < <(grep -lE 'pytest\.mark\.gpu|mark\.gpu' tests/test_*.py)
if [[ ${#FILES[@]} -eq 0 ]]; then
  echo "gpu tests: no test file marks tests gpu"
  exit 1
fi
GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo '?')"
LOG="$(mktemp /tmp/gpu_tests.XXXX)"
start=$SECONDS
"$PYTHON" -m pytest "${FILES[@]}" -m gpu -p no:cacheprovider -o addopts="" -rs "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# pytest's last line: "3 passed, 1 skipped in 12.3s" (between '=' rules when it is not quiet)
summary="$(grep -E '[0-9]+ (passed|failed|skipped|error|deselected)|no tests ran' "$LOG" | tail -n 1 | tr -d '=' | xargs)"
echo "gpu tests: ${summary:-no pytest summary} (rc $rc, $((SECONDS - start)) s, $GPUS GPUs)"
exit "$rc"
