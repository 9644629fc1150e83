#!/usr/bin/env bash
# H200: where a batch-1 decode step's time goes (issue 25). For each model folder in "$@"
# (made by stage1.sh): wick bench with the host's share of each step (time building and
# queuing a step, time waiting for ids), the same under MLX's CUDA-graph settings
# (VARIANTS, environment settings, commas within one variant), and an Nsight Compute pass
# over a short decode that times every kernel (`kernel_profile.py` sums them per step).
# With TORCH_REF=1, also PyTorch's eager and CUDA-graph decode of the same model
# (torch_graph_decode.py). Results: $OUT/profile.jsonl, $OUT/ncu-*.json (+ the raw CSV, xz).
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for m in "$@"; do
  for v in default ${VARIANTS:-}; do
    env $( [ "$v" = default ] || echo $v | tr ',' ' ') timeout ${BENCH_TIMEOUT:-150} \
      $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 3 \
      --case ${CASE:-512:128:1} 2>>$OUT/profile.err \
      | sed -u "s/^{/{\"variant\":\"$v\",\"model_dir\":\"$m\",/" | tee -a $OUT/profile.jsonl
  done
  if [ -n "${TORCH_REF:-}" ]; then
    IFS=: read -r P N B <<< "${CASE:-512:128:1}"
    timeout ${TORCH_TIMEOUT:-200} python3 $G/torch_graph_decode.py $W/models/$m --prompt $P --gen $N \
      2>>$OUT/profile.err | tee -a $OUT/profile.jsonl
  fi
  if [ -n "$NCU" ] && [ -z "${SKIP_NCU:-}" ]; then
    timeout ${NCU_TIMEOUT:-200} $NCU --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --print-units base --launch-count ${NCU_KERNELS:-20000} \
      $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --prefill-chunk 0 --json --warmup 0 --runs 1 \
      --case 64:24:1 > $OUT/ncu-$m.csv 2>>$OUT/profile.err
    python3 $G/kernel_profile.py $OUT/ncu-$m.csv $m | tee $OUT/ncu-$m.json
    xz -T0 $OUT/ncu-$m.csv
  fi
done
