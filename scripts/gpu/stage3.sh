#!/usr/bin/env bash
# H200, third call right after stage2.sh on the same (warm) machine; carries nothing:
# the quantized 8B models and the wick variants (kernels / fusion off) for comparison.
set -uo pipefail
W=/tmp/wick
source scripts/gpu/env.sh || exit 1
mkdir -p $OUT
cp $W/ceilings.json $OUT/ 2>/dev/null
VARIANTS=${VARIANTS:-"WICK_MLX_KERNELS=0 WICK_MLX_FUSE=0 WICK_MLX_KERNELS=0,WICK_MLX_FUSE=0"} \
  bash scripts/gpu/bench.sh ${MODELS:-llama3-8b-8bit llama3-8b-4bit}
python3 scripts/gpu/summarize.py $OUT | tee $OUT/summary.md
