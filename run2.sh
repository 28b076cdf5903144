export ROOT=$PWD PYTHON=python3; source benchmarks/gpu_env.sh; nvidia-smi -L | head -2
export CAL_DIR=.cal2 ISO_REPEATS=1 ISO_LIMIT=150
AUTOSHARD_OVERLAP_GRAD_SYNC=1 OUT=$OUT/blk_o1 ISO_ARGS=--profile ISO_RUNS="llama:1.3b=autoshard,fsdp2-noreshard-compiled" benchmarks/isolated.sh
AUTOSHARD_OVERLAP_GRAD_SYNC=0 OUT=$OUT/blk_o0 ISO_RUNS="llama:1.3b=autoshard" benchmarks/isolated.sh
AUTOSHARD_COMPILE_REGIONS=graph OUT=$OUT/graph_o0 ISO_RUNS="llama:1.3b=autoshard" benchmarks/isolated.sh
AUTOSHARD_OVERLAP_GRAD_SYNC=1 OUT=$OUT/gpt_blk_o1 ISO_ARGS=--profile ISO_RUNS="gpt:1.3b:sdpa=autoshard,fsdp2-noreshard" benchmarks/isolated.sh
