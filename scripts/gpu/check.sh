#!/usr/bin/env bash
# H200: wick (MLX backend, GPU) against mlx-lm (GPU) for each model in "$@": logits of a
# prompt and 24 greedy tokens (candle too on models under 2B parameters, on the CPU).
set -uo pipefail
W=/tmp/wick
mkdir -p $W/mlx-reference $OUT
for m in "$@"; do
  ln -sfn $W/models/$m $W/mlx-reference/$m
  python3 scripts/gpu/mlx_lm_reference.py $W/models/$m $W/models/$m/mlx_lm_reference --steps 24 2>&1 | tail -1
done
WICK_MLX_REFERENCE_MODELS="$*" $W/mlx_reference --ignored --nocapture --test-threads 1 \
  listed_models_match_mlx_lm 2>&1 | tee $OUT/check.txt | grep -E "mlx vs|test result|panicked|FAILED"
