#!/usr/bin/env bash
# H200: wick (MLX backend, GPU) against mlx-lm (GPU) for each model in "$@": logits of a
# prompt and 24 greedy tokens (candle too on models under 4 GiB, on the CPU). One test
# run per model, so a failure on one still checks the others; output in $OUT/check.txt.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
mkdir -p $W/mlx-reference $OUT
for m in "$@"; do
  ln -sfn $W/models/$m $W/mlx-reference/$m
  timeout 300 python3 $G/mlx_lm_reference.py $W/models/$m $W/models/$m/mlx_lm_reference \
    --steps 24 2>&1 | tail -1
  WICK_MLX_REFERENCE_MODELS="$m" timeout 300 $W/mlx_reference --ignored --nocapture \
    --test-threads 1 listed_models_match_mlx_lm 2>&1 | tee -a $OUT/check.txt \
    | grep -E "mlx vs|candle vs|test result|panicked|FAILED"
done
