#!/usr/bin/env bash
# GPU: `wick serve --backend cuda` with and without the KV preallocation of a prompt
# (WICK_KV_PREALLOCATE=0), or two builds, in the same call (issue 47's agent path):
# an 18,682-token prompt's first token alone and beside 4 decoding streams (their gaps,
# ttft.py), with the CUDA allocator's debug log (`allocation of ... failed` lines: the
# device ran out and the pool gave its cached buffers back). Carry carry/cuda/wick.xz and
# cuda_reference.xz (the KV and batching reference tests run first when it is there);
# VARIANTS lists `label=binary[,ENV=value]` (default: wick and wick with
# WICK_KV_PREALLOCATE=0; a wick_prev.xz carried is run as the build before).
# Results: $OUT/ttft.jsonl (one line per build and load), serve-*.log, t/test.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
W=/tmp/wick; G=scripts/gpu; mkdir -p $W/models $OUT/t
for f in wick wick_prev cuda_reference; do
  [ -f carry/cuda/$f.xz ] && xz -dc carry/cuda/$f.xz > $W/$f && chmod +x $W/$f
done
if [ -z "${VARIANTS:-}" ]; then
  VARIANTS="wick=wick wick-no-prealloc=wick,WICK_KV_PREALLOCATE=0"
  [ -f carry/cuda/wick_prev.xz ] && VARIANTS+=" wick_prev=wick_prev"
fi
SP=$(python3 -c 'import nvidia;print(list(nvidia.__path__)[0])')
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64 WICK_HOME=$W
M=$W/models/llama3-8b-bf16-32k
[ -d $M ] || timeout 150 python3 $G/make_models.py $M llama3-8b bfloat16 \
  crates/wick-engine/tests/goldens/hf/qwen2 --context 32768 > $OUT/make.log 2>&1 &
if [ -x $W/cuda_reference ]; then
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout 120 $W/cuda_reference --test-threads 1 \
    batched f16_caches greedy_decoding_with_graphs > $OUT/t/test.log 2>&1
  grep -E "^test result|FAILED|panicked" $OUT/t/test.log
fi
wait
for v in $VARIANTS; do
  label=${v%%=*}; spec=${v#*=}; b=${spec%%,*}; envs=()
  [ "$spec" != "$b" ] && IFS=, read -ra envs <<< "${spec#*,}"
  env "${envs[@]}" RUST_LOG=info,wick_cuda=debug $W/$b serve $M --backend cuda --port 8411 \
    --step-tokens 512 --max-batch 8 --prompt-cache 0 --kv-memory 24G > $OUT/serve-$label.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8411/health')" 2>/dev/null && break
    sleep 1
  done
  for s in 0 4; do
    timeout 100 python3 $G/ttft.py --url http://127.0.0.1:8411 --model $M --tokens 18682 \
      --repeat 1 --streams $s 2>>$OUT/ttft.err | sed -u "s/^{/{\"bin\":\"$label\",/" \
      | tee -a $OUT/ttft.jsonl
  done
  echo "$label: $(grep -c 'allocation of' $OUT/serve-$label.log) allocation failures"
  grep 'allocation of' $OUT/serve-$label.log | head -2 | cut -c1-220
  kill $pid; wait $pid 2>/dev/null
done
