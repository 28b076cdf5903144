export ROOT=$PWD PYTHON=python3; source benchmarks/gpu_env.sh; nvidia-smi -L | head -2
export CAL_DIR=.cal2 ISO_REPEATS=1 ISO_LIMIT=110
L="llama:1.3b"; O=$OUT
OUT=$O/r1on ISO_ARGS=--profile ISO_RUNS="$L=autoshard" benchmarks/isolated.sh
AUTOSHARD_GATHER_UNDER_UPDATE=0 OUT=$O/r1off ISO_RUNS="$L=autoshard" benchmarks/isolated.sh
OUT=$O/r1base ISO_RUNS="$L=fsdp2-noreshard-compiled" benchmarks/isolated.sh
OUT=$O/r2on ISO_RUNS="$L=autoshard" benchmarks/isolated.sh
OUT=$O/r2base ISO_RUNS="$L=fsdp2-noreshard-compiled" benchmarks/isolated.sh
OUT=$O/gpt ISO_RUNS="gpt:1.3b:sdpa=autoshard,fsdp2-noreshard" benchmarks/isolated.sh
