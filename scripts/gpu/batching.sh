#!/usr/bin/env bash
# H200, after stage1.sh (models made) on the same warm machine: the continuous-batching
# curve through the scheduler. For each model in "$@": one `wick serve --backend mlx`,
# then the load tool at each concurrency in $CURVE (streaming chat requests, prompt
# ~$PROMPT tokens, $GEN output tokens, $ROUNDS requests per client), JSON lines appended
# to $OUT/curve.jsonl (greedy; then the sizes in $SAMPLED at temperature 0.8), the
# engine's step timings to $OUT/steps.jsonl; then the in-process greedy lockstep batch of
# the same sizes (the ceiling without HTTP, sampling or scheduling) to $OUT/lockstep.jsonl.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
source $G/env.sh || exit 1
mkdir -p $OUT
CURVE=${CURVE:-"1 2 4 8 16 32 64"}
PROMPT=${PROMPT:-128}
GEN=${GEN:-256}
ROUNDS=${ROUNDS:-1}
port=8411
for m in "$@"; do
  echo "== $m"
  $W/wick serve $W/models/$m --backend mlx --port $port --max-batch 64 --max-queue 512 \
    --kv-memory ${KV_MEMORY:-40G} --prompt-cache 0 > $OUT/serve-$m.log 2>&1 &
  pid=$!
  get() { python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1]).read().decode())" "$1"; }
  for _ in $(seq 1 180); do
    get http://127.0.0.1:$port/health > /dev/null 2>&1 && break
    sleep 1
  done
  # The engine's step counters after each run (curve.py takes the differences).
  steps() {
    get http://127.0.0.1:$port/stats | python3 -c "import json, sys; e = json.load(sys.stdin)['engine']; \
print(json.dumps({'model_dir': '$m', 'after': '$1', 'steps': e['steps'], \
'generated': e['generated_tokens_total'], 'seconds': e['step_seconds']}))" >> $OUT/steps.jsonl
  }
  $W/wick bench --concurrency 8 --url http://127.0.0.1:$port --prompt-tokens $PROMPT \
    --gen-tokens 16 > /dev/null 2>> $OUT/curve.err  # warm-up (kernel compilation)
  steps warmup
  for n in $CURVE; do
    timeout 180 $W/wick bench --concurrency $n --url http://127.0.0.1:$port --rounds $ROUNDS \
      --prompt-tokens $PROMPT --gen-tokens $GEN --json 2>> $OUT/curve.err \
      | sed -u "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/curve.jsonl
    steps $n
  done
  # The largest batch again with sampling (temperature > 0: logits go to the host).
  for n in ${SAMPLED:-64}; do
    timeout 180 $W/wick bench --concurrency $n --url http://127.0.0.1:$port --rounds $ROUNDS \
      --prompt-tokens $PROMPT --gen-tokens $GEN --temperature 0.8 --json 2>> $OUT/curve.err \
      | sed -u "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/curve.jsonl
    steps $n@0.8
  done
  kill $pid; wait $pid 2>/dev/null
  args=()
  for n in $CURVE; do args+=(--case "$PROMPT:$GEN:$n"); done
  timeout 300 $W/wick bench $W/models/$m --backend mlx --synthetic-prompt --prefill-chunk 0 --json --warmup 1 \
    --runs ${LOCKSTEP_RUNS:-2} "${args[@]}" 2>> $OUT/lockstep.err \
    | sed -u "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/lockstep.jsonl
done
python3 $G/curve.py $OUT | tee $OUT/curve.md
