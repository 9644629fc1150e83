#!/usr/bin/env bash
# H200, second call right after stage1.sh (carry: carry/b). Installs the MLX runtime,
# quantizes the 8B model with mlx-lm, checks wick against mlx-lm (and candle on the
# 0.5B model), then runs the benchmark cases of $MODELS (wick, then mlx-lm, same run).
set -uo pipefail
W=/tmp/wick
source scripts/gpu/env.sh || exit 1
mkdir -p $OUT
cp $W/ceilings.json $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.txt 2>&1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" 2>&1 | tee $OUT/mlx.txt
$W/wick --version
for q in 8 4; do
  [ -d $W/models/llama3-8b-${q}bit ] || python3 -m mlx_lm convert --hf-path $W/models/llama3-8b-bf16 \
    --mlx-path $W/models/llama3-8b-${q}bit -q --q-bits $q --q-group-size 64 2>&1 | tail -1
done
bash scripts/gpu/check.sh ${CHECK_MODELS:-qwen2.5-0.5b-bf16 llama3-8b-bf16 llama3-8b-4bit}
bash scripts/gpu/bench.sh ${MODELS:-llama3-8b-bf16 qwen2.5-0.5b-bf16}
python3 scripts/gpu/summarize.py $OUT | tee $OUT/summary.md
