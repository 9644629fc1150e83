#!/usr/bin/env bash
# H200, after stage1.sh (models made) on the same warm machine: memory admission on the
# GPU. For each fraction in $FRACTIONS, one `wick serve MODEL --backend mlx
# --gpu-memory-utilization F` (prompt cache as given by $PROMPT_CACHE, GiB): the KV pool
# it sized (/stats), its log line on where the figure came from, and what nvidia-smi
# reports before and after; with the first fraction also a 64-stream load, so the pool is
# used. Output: $OUT/admission.jsonl, $OUT/admission-*.log.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT
m=${1:-qwen2.5-0.5b-bf16}
port=8421
gpu() { nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits | head -1; }
get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }
first=1
for f in ${FRACTIONS:-0.5 0.9}; do
  before=$(gpu)
  $W/wick serve $W/models/$m --backend mlx --port $port --max-batch 64 \
    --gpu-memory-utilization $f --prompt-cache ${PROMPT_CACHE:-0} > $OUT/admission-$f.log 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do
    get http://127.0.0.1:$port/health > /dev/null 2>&1 && break
    sleep 1
  done
  loaded=$(gpu)
  if [ $first = 1 ]; then
    timeout 180 $W/wick bench --concurrency 64 --url http://127.0.0.1:$port \
      --prompt-tokens 128 --gen-tokens 64 --json > $OUT/admission-load-$f.json 2>> $OUT/admission.err
    first=0
  fi
  get http://127.0.0.1:$port/stats | python3 -c "import json, sys; s = json.load(sys.stdin); \
print(json.dumps({'model_dir': '$m', 'fraction': $f, 'gpu_mib_before': '$before', \
'gpu_mib_loaded': '$loaded', 'kv_pool': s['engine']['kv_pool'], 'memory': s['memory'], \
'completed': s['engine']['completed'], 'failed': s['engine']['failed']}))" | tee -a $OUT/admission.jsonl
  kill $pid; wait $pid
  grep -E "KV pool|GPU" $OUT/admission-$f.log | sed 's/\x1b\[[0-9;]*m//g'
done
