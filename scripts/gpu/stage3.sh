#!/usr/bin/env bash
# H200, third call right after stage2.sh on the same (warm) machine; carries nothing:
# quantizes the 8B model with mlx-lm (8- and 4-bit, group 64), checks the 4-bit one
# against mlx-lm, benchmarks both, then wick variants (own kernels / fusion off) on the
# bf16 model for comparison.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT
cp $W/ceilings.json $OUT/ 2>/dev/null
for q in ${QUANTS:-8 4}; do
  [ -d $W/models/llama3-8b-${q}bit ] || timeout 240 python3 -m mlx_lm convert \
    --hf-path $W/models/llama3-8b-bf16 --mlx-path $W/models/llama3-8b-${q}bit \
    -q --q-bits $q --q-group-size 64 2>&1 | tail -1
  cp $W/models/llama3-8b-bf16/tokenizer* $W/models/llama3-8b-${q}bit/ 2>/dev/null
done
bash $G/check.sh ${CHECK_MODELS:-llama3-8b-4bit}
bash $G/bench.sh ${MODELS:-llama3-8b-8bit llama3-8b-4bit}
python3 $G/summarize.py $OUT | tee $OUT/summary.md
[ -n "${VARIANTS-x}" ] && VARIANTS=${VARIANTS:-"WICK_MLX_KERNELS=0 WICK_MLX_FUSE=0"} \
  ONLY_VARIANTS=1 bash $G/bench.sh ${VARIANT_MODELS:-llama3-8b-bf16}
python3 $G/summarize.py $OUT | tee $OUT/summary.md
