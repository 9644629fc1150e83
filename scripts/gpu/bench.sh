#!/usr/bin/env bash
# H200: the benchmark cases on each model in "$@": wick (MLX backend), then mlx-lm, in
# the same run; JSON lines into $OUT/bench.jsonl. VARIANTS adds wick runs with
# environment settings (e.g. "WICK_MLX_KERNELS=0 WICK_MLX_FUSE=0").
set -uo pipefail
W=/tmp/wick
CASES=${CASES:-"512:128:1 2048:16:1 128:128:8 128:128:32 128:128:64"}
args=()
for c in $CASES; do args+=(--case "$c"); done
for m in "$@"; do
  echo "== $m"
  python3 scripts/gpu/model_facts.py $W/models/$m >> $OUT/facts.jsonl
  $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --json --warmup 1 --runs 2 "${args[@]}" \
    2>>$OUT/bench.err | sed "s/^{/{\"engine\":\"wick\",\"variant\":\"default\",\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
  for v in ${VARIANTS:-}; do
    env $(echo $v | tr ',' ' ') $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --json --warmup 1 --runs 2 \
      --case 512:128:1 2>>$OUT/bench.err | sed "s/^{/{\"engine\":\"wick\",\"variant\":\"$v\",\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
  done
  python3 scripts/gpu/mlx_lm_bench.py $W/models/$m "${args[@]}" 2>>$OUT/bench.err \
    | sed "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
done
