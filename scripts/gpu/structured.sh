#!/usr/bin/env bash
# H200, after stage1.sh made the random Qwen2.5-0.5B model (MAKE="qwen2.5-0.5b:bfloat16"):
# structured output on the MLX backend, JSON-schema-constrained against free streams
# (scripts/bench_structured.py), with greedy constrained rows masked on the device
# (`--structured-masks backend`, the GPU default) and sampled on the host (`host`, what
# every row did before), alternating.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT
M=$W/models/${MODEL:-qwen2.5-0.5b-bf16}
BENCH=${BENCH_STRUCTURED:-$G/../bench_structured.py}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > $OUT/gpu_state.txt 2>&1
for round in ${ROUNDS:-1 2}; do
  for place in backend host; do
    echo "== round $round, --structured-masks $place" | tee -a $OUT/structured.md
    timeout ${STRUCT_TIMEOUT:-240} python3 $BENCH --wick $W/wick --rounds 2 --gen-tokens 192 -- \
      $M --backend mlx --structured-masks $place 2>>$OUT/structured.err | tee -a $OUT/structured.md
  done
done
