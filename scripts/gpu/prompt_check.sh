#!/usr/bin/env bash
# H200/H100: one call that checks and measures a change to the prompt path (issue 47) beside
# PyTorch, in the same minutes. Carry: carry/cuda/wick.xz and carry/cuda/cuda_reference.xz
# (built here with `--features cuda`, docs/gpu.md) and optionally more builds named in
# VARIANTS (prompt_ab.sh's syntax; by default this build with and without the wide flash
# kernels, `WICK_CUDA_FLASH_WIDE=0`).
#  1. the whole `cuda_reference` suite (unless SKIP_TEST), while the random-weight
#     Llama-3-8B-shape bf16 model with a 32k context is made with transformers on the GPU,
#     then the SHAPES models (for the stage after this one);
#  2. prompt_ab.sh: each variant's one-pass prompt speed at LENGTHS, ROUNDS interleaved rounds;
#  3. PyTorch (transformers, sdpa) on the same model and lengths, and sdpa alone on one
#     layer's shapes (torch_prefill.py, unless SKIP_TORCH);
#  4. `wick serve --backend cuda` with each variant's settings: the time to first token of an
#     18,682-token prompt, twice (ttft.py, unless SKIP_SERVE).
# Results under $OUT: test.log, ab.md (the A/B table), torch.jsonl, ttft.jsonl, steps.log,
# env.txt and details.tgz (the raw lines and logs). With STAGE=2 (same warm machine) it runs
# decode_ab.sh on SHAPES instead, profiling a PROFILE_CASE pass of the first.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
mkdir -p $W/models $OUT
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
VARIANTS=${VARIANTS:-narrow=wick,WICK_CUDA_FLASH_WIDE=0 wide=wick}
SHAPES=${SHAPES:-gemma4-e4b qwen3.5-4b}
if [ "${STAGE:-1}" = 2 ]; then
  SKIP_TEST=1 VARIANTS=${STAGE2_VARIANTS:-wide=wick} SHAPES="$SHAPES" \
    PROFILE_CASE=${PROFILE_CASE:-4096:1:1} exec bash $G/decode_ab.sh
fi
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
for x in carry/cuda/*.xz; do
  f=$(basename $x .xz)
  xz -dc $x > $W/$f && chmod +x $W/$f
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt 2>&1
M=$W/models/llama3-8b-bf16-32k
(
  [ -d $M ] || timeout 400 python3 $G/make_models.py $M llama3-8b bfloat16 \
    crates/wick-engine/tests/goldens/hf/qwen2 --context 32768 > $OUT/make-llama3.log 2>&1
  touch $W/models/.made-llama3
  for s in $SHAPES; do  # for STAGE=2 (decode_ab.sh waits for .made-<shape>)
    case $s in gemma4*) tok=gemma4_chat ;; *) tok=qwen2 ;; esac
    [ -d $W/models/$s-bf16 ] || timeout ${MAKE_TIMEOUT:-240} python3 $G/make_models.py \
      $W/models/$s-bf16 $s bfloat16 crates/wick-engine/tests/goldens/hf/$tok > $OUT/make-$s.log 2>&1
    touch $W/models/.made-$s
  done
) &
if [ -z "${SKIP_TEST:-}" ]; then
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-300} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
fi
stamp "waiting for the 8B model"
while [ ! -e $W/models/.made-llama3 ]; do sleep 2; done
stamp "prompt A/B"
OUT=$OUT/ab MODEL=llama3-8b-bf16-32k ROUNDS=${ROUNDS:-2} LENGTHS="${LENGTHS:-512 2048 8192 16384}" \
  VARIANTS="$VARIANTS" bash $G/prompt_ab.sh | tee $OUT/ab.md
if [ -z "${SKIP_TORCH:-}" ]; then
  stamp "torch"
  timeout ${TORCH_TIMEOUT:-200} python3 $G/torch_prefill.py $M \
    --lengths ${LENGTHS:-512 2048 8192 16384} 2>>$OUT/torch.err | tee -a $OUT/torch.jsonl
fi
if [ -z "${SKIP_SERVE:-}" ]; then
  port=8411
  for v in $VARIANTS; do
    label=${v%%=*}; rest=${v#*=}; bin=${rest%%,*}
    envs=(); [ "$rest" != "$bin" ] && IFS=',' read -ra envs <<< "${rest#*,}"
    stamp "wick serve ($label)"
    env "${envs[@]}" $W/$bin serve $M --backend cuda --port $port --max-batch 8 \
      --prompt-cache 0 --kv-memory ${KV_MEMORY:-24G} > $OUT/serve-$label.log 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do
      python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
        2>/dev/null && break
      sleep 1
    done
    timeout ${TTFT_TIMEOUT:-120} python3 $G/ttft.py --url http://127.0.0.1:$port --model $M \
      --tokens ${TTFT_TOKENS:-18682} --repeat 2 --streams 0 2>>$OUT/ttft.err \
      | sed -u "s/^{/{\"variant\":\"$label\",/" | tee -a $OUT/ttft.jsonl
    kill $pid; wait $pid 2>/dev/null
  done
fi
stamp "waiting for the models of SHAPES"  # so that STAGE=2 never reads a half-made one
wait
stamp "done"
# The device tool returns at most 8 files: the per-run logs and JSON lines go in one archive.
( cd $OUT && tar czf details.tgz --remove-files $(ls -d ab make-*.log serve-*.log *.err 2>/dev/null) )
# Last, so the end of the output (what the device tool shows) always holds the verdict.
if [ -f $OUT/test.log ]; then
  grep -E "^test |panicked" $OUT/test.log | grep -v " ok$" | tail -20
  grep -E "^test result|rc=" $OUT/test.log
fi
