#!/bin/bash
# `autoshard run` on several nodes under SLURM: one launcher per node, c10d rendezvous on the first node.
#
#   sbatch docs/examples/slurm_run.sh plan.json train.py [ARGS...]
#
# The plan's world size must equal nodes × processes per node (8 GPUs a node here, so a plan searched
# for a `PRESET:2x8` cluster); `autoshard run` checks this on every node and exits 2 before any rank
# starts when it does not hold. Each node's launcher watches and reports its own ranks
# (docs/reliability.md, "Several nodes").
#SBATCH --job-name=autoshard
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one launcher per node; it starts that node's ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=04:00:00

set -euo pipefail

PLAN=${1:?usage: sbatch slurm_run.sh PLAN.json SCRIPT [ARGS...]}
shift

# The rendezvous store is served by the launcher on the first node of the allocation.
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${AUTOSHARD_RDZV_PORT:-29400}

# AUTOSHARD_TIMEOUT_S (default 300 s) bounds a silent rank and, in scripts that pass it to
# init_process_group, a collective waiting on a lost peer.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    autoshard run \
        --nnodes "$SLURM_JOB_NUM_NODES" \
        --nproc-per-node "${SLURM_GPUS_ON_NODE:-8}" \
        --rdzv-endpoint "$HEAD:$PORT" \
        --rdzv-id "$SLURM_JOB_ID" \
        "$PLAN" -- "$@"
