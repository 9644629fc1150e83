#!/usr/bin/env bash
# H200, after stage1.sh and the copies of the middle parts (carry: the last folder). Installs the MLX runtime,
# checks wick against mlx-lm on the GPU (and candle on the 0.5B model), then runs the
# benchmark cases of $MODELS (wick, then mlx-lm, same run). Results go to $OUT as they
# come, so a timeout still returns what was measured.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT
cp $W/ceilings.json $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.txt 2>&1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>&1 | tee $OUT/mlx.txt
$W/wick --version
bash $G/check.sh ${CHECK_MODELS:-qwen2.5-0.5b-bf16 llama3-8b-bf16}
bash $G/bench.sh ${MODELS:-llama3-8b-bf16 qwen2.5-0.5b-bf16}
python3 $G/summarize.py $OUT | tee $OUT/summary.md
