#!/usr/bin/env bash
# H200: the benchmark cases on each model in "$@": wick (MLX backend), then mlx-lm, in
# the same run; JSON lines appended to $OUT/bench.jsonl as each case ends. VARIANTS adds
# wick runs of the batch-1 case with environment settings (e.g. "WICK_MLX_KERNELS=0
# WICK_MLX_FUSE=0", commas within one variant); ONLY_VARIANTS=1 runs just those.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
CASES=${CASES:-"512:128:1 2048:16:1 128:128:8 128:128:32 128:128:64"}
args=()
for c in $CASES; do args+=(--case "$c"); done
for m in "$@"; do
  echo "== $m"
  python3 $G/model_facts.py $W/models/$m >> $OUT/facts.jsonl
  if [ -z "${ONLY_VARIANTS:-}" ]; then
    timeout ${BENCH_TIMEOUT:-200} $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --prefill-chunk 0 --json \
      --warmup 1 --runs 2 "${args[@]}" 2>>$OUT/bench.err \
      | sed -u "s/^{/{\"engine\":\"wick\",\"variant\":\"default\",\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
    timeout ${BENCH_TIMEOUT:-200} python3 $G/mlx_lm_bench.py $W/models/$m "${args[@]}" 2>>$OUT/bench.err \
      | sed -u "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
  fi
  for v in ${VARIANTS:-}; do
    env $(echo $v | tr ',' ' ') timeout 120 $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --prefill-chunk 0 \
      --json --warmup 1 --runs 2 --case 512:128:1 2>>$OUT/bench.err \
      | sed -u "s/^{/{\"engine\":\"wick\",\"variant\":\"$v\",\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
  done
done
