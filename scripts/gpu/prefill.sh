#!/usr/bin/env bash
# H200: prompt attention on the tensor cores (issue 47), one call of about 6 minutes.
# Carry: carry/cuda/wick.xz and carry/cuda/cuda_reference.xz (built here with
# `--features cuda`; see docs/gpu.md).
#  1. the reference test `cuda_reference` (unless SKIP_TEST; TEST_FILTER picks tests),
#     while a random-weight Llama-3-8B-shape bf16 model with a 32k context is made with
#     transformers on the GPU (make_models.py);
#  2. `wick bench --backend cuda` prompt speed at LENGTHS (one pass per prompt), with each
#     flash mode of FLASH (WICK_CUDA_FLASH: off is the CUDA-core kernel of before, the
#     baseline of the same call), and with fast flash in chunks of CHUNK (wick serve's
#     default step) unless CHUNK is empty; KV cache type KV;
#  3. PyTorch (transformers, sdpa) on the same model and lengths, and sdpa alone on one
#     layer's shapes (torch_prefill.py, unless SKIP_TORCH);
#  4. `wick serve --backend cuda` with each of SERVE_CONFIGS (flag sets separated by ';',
#     by default the 512-token steps of before and the defaults: lone prompts in long
#     steps, chunks paced beside decoding streams) and the time to first token of
#     TTFT_TOKENS-token prompts (ttft.py), alone and, unless STREAMS=0, while STREAMS
#     streams decode (their inter-token gaps), unless SKIP_SERVE;
#  5. OUT/summary.md and OUT/summary.json (prefill_summary.py).
# Results: $OUT/test.log, bench.jsonl, torch.jsonl, ttft.jsonl, summary.*, *.err.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
mkdir -p $W/models $OUT
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
for f in wick cuda_reference; do
  [ -f carry/cuda/$f.xz ] && xz -dc carry/cuda/$f.xz > $W/$f && chmod +x $W/$f
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt 2>&1
TOK=crates/wick-engine/tests/goldens/hf/qwen2
M=$W/models/llama3-8b-bf16-32k
stamp "making $M"
[ -d $M ] || timeout 400 python3 $G/make_models.py $M llama3-8b bfloat16 $TOK --context 32768 \
  > $OUT/make.log 2>&1 &
MAKE_PID=$!
if [ -z "${SKIP_TEST:-}" ]; then
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-300} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
  grep -E "^test |rc=|panicked|FAILED" $OUT/test.log | tail -20
fi
wait $MAKE_PID
tail -1 $OUT/make.log
LENGTHS=${LENGTHS:-512 2048 8192 16384}
cases=(); for n in $LENGTHS; do cases+=(--case $n:1:1); done
bench() {  # MODE CHUNK
  stamp "wick bench flash=$1 chunk=$2"
  WICK_CUDA_FLASH=$1 timeout ${BENCH_TIMEOUT:-150} $W/wick bench $M --backend cuda \
    --kv-type ${KV:-f32} --synthetic-prompt --prefill-chunk $2 --json --warmup 1 \
    --runs ${RUNS:-2} "${cases[@]}" 2>>$OUT/bench.err \
    | sed -u "s/^{/{\"flash\":\"$1\",\"chunk_arg\":$2,/" | tee -a $OUT/bench.jsonl
}
if [ -z "${SKIP_BENCH:-}" ]; then
  for mode in ${FLASH:-fast exact off}; do bench $mode 0; done
  [ -n "${CHUNK-512}" ] && bench fast ${CHUNK-512}
fi
if [ -z "${SKIP_TORCH:-}" ]; then
  stamp "torch"
  timeout ${TORCH_TIMEOUT:-200} python3 $G/torch_prefill.py $M --lengths $LENGTHS \
    2>>$OUT/torch.err | tee -a $OUT/torch.jsonl
fi
if [ -z "${SKIP_SERVE:-}" ]; then
  port=8411
  IFS=';' read -ra configs <<< "${SERVE_CONFIGS:---step-tokens 512 --prompt-step-tokens 512 --itl-factor 0;--step-tokens 512}"
  for i in "${!configs[@]}"; do
    args=${configs[$i]}
    stamp "wick serve $args"
    $W/wick serve $M --backend cuda --kv-type ${KV:-f32} --port $port $args \
      --max-batch 8 --prompt-cache 0 --kv-memory ${KV_MEMORY:-24G} > $OUT/serve-$i.log 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do
      python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
        2>/dev/null && break
      sleep 1
    done
    for streams in 0 ${STREAMS:-4}; do
      [ "$streams" = 0 ] && repeat=2 || repeat=1
      timeout ${TTFT_TIMEOUT:-120} python3 $G/ttft.py --url http://127.0.0.1:$port --model $M \
        --tokens ${TTFT_TOKENS:-18682} --repeat $repeat --streams $streams 2>>$OUT/ttft.err \
        | sed -u "s/^{/{\"label\":\"$args\",/" | tee -a $OUT/ttft.jsonl
      [ "${STREAMS:-4}" = 0 ] && break
    done
    kill $pid; wait $pid 2>/dev/null
  done
fi
stamp "summary"
python3 $G/prefill_summary.py $OUT
