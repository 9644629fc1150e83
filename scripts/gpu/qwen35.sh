#!/usr/bin/env bash
# H200/H100: Qwen 3.5 on the CUDA backend (issue 46), one call of about 6 minutes; the steps
# gemma4.sh runs on Gemma 4's shapes too.
# Carry: carry/cuda/wick.xz and carry/cuda/cuda_reference.xz (built here with
# `--features cuda`; see docs/gpu.md).
#  1. the reference test `cuda_reference` (unless SKIP_TEST; TEST_FILTER picks tests), while
#     a random-weight bf16 model of SHAPE (make_models.py; default qwen3.5-4b; gemma4.sh runs
#     these steps on Gemma 4's shapes) is made with transformers on the GPU (MAKE_TIMEOUT);
#  2. `wick bench --backend cuda` on it: decode after a 512-token prompt at batch 1 and 8,
#     and prompt speed at PROMPTS tokens (DELTA_COMPARE=1: the prompts again with the
#     chunked DeltaNet's state pass on the CUDA cores, WICK_CUDA_DELTA_MMA=0, to
#     $OUT/bench_cuda_cores.jsonl);
#  3. transformers' own decode of the same model (eager, its PyTorch DeltaNet fallbacks:
#     the image has no flash-linear-attention), batch 1, and its prompt speed at PROMPTS
#     tokens, unless SKIP_TORCH;
#  4. unless SKIP_AGENT, agent loops through `wick serve --backend cuda` (agent_cache.py) on
#     the tiny Qwen 3.5 and Gemma 4 goldens with the chat templates in TEMPLATES (a folder
#     of the llama.cpp test assets' .jinja files, carried), to $OUT/agent.jsonl;
#     AGENT_MODELS picks golden:template pairs.
# Results: $OUT/test.log, bench.jsonl, torch.jsonl, steps.log, *.err.
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
python3 -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)' >> $OUT/env.txt 2>&1
TOK=${TOK:-crates/wick-engine/tests/goldens/hf/qwen2}
SHAPE=${SHAPE:-qwen3.5-4b}
M=$W/models/$SHAPE-bf16
stamp "making $M"
[ -d $M ] || timeout ${MAKE_TIMEOUT:-300} python3 $G/make_models.py $M $SHAPE bfloat16 $TOK > $OUT/make.log 2>&1 &
MAKE_PID=$!
if [ -z "${SKIP_TEST:-}" ]; then
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-300} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
  grep -E "^test |rc=|panicked|FAILED|skipped" $OUT/test.log | tail -40
fi
wait $MAKE_PID
tail -2 $OUT/make.log
[ -d $M ] || { stamp "no model"; exit 1; }
stamp "wick bench"
args=(); for c in ${CASES:-512:128:1 512:64:8}; do args+=(--case $c); done
for n in ${PROMPTS:-2048 8192}; do args+=(--case $n:1:1); done
timeout ${BENCH_TIMEOUT:-200} $W/wick bench $M --backend cuda --synthetic-prompt \
  --prefill-chunk 0 --json --warmup 1 --runs 3 "${args[@]}" 2>>$OUT/bench.err | tee -a $OUT/bench.jsonl
tail -3 $OUT/bench.err
if [ -n "${DELTA_COMPARE:-}" ]; then
  # The same prompts with the chunked DeltaNet's state pass on the CUDA cores, for the
  # ratio against the tensor-core pass above (same card, same minutes).
  stamp "wick bench, WICK_CUDA_DELTA_MMA=0"
  pargs=(); for n in ${PROMPTS:-2048 8192}; do pargs+=(--case $n:1:1); done
  WICK_CUDA_DELTA_MMA=0 timeout ${BENCH_TIMEOUT:-200} $W/wick bench $M --backend cuda \
    --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 3 "${pargs[@]}" \
    2>>$OUT/bench.err | tee -a $OUT/bench_cuda_cores.jsonl
fi
if [ -z "${SKIP_TORCH:-}" ]; then
  stamp "transformers decode"
  timeout ${TORCH_TIMEOUT:-150} python3 - $M ${PROMPTS:-2048 8192} <<'EOF' 2>>$OUT/torch.err | tee -a $OUT/torch.jsonl
import json, sys, time
import torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda().eval()
ids = torch.randint(100, 1000, (1, 512), device="cuda")
def prompt(n):
    x = torch.randint(100, 1000, (1, n), device="cuda")
    torch.cuda.synchronize(); t = time.perf_counter()
    m(input_ids=x, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(); return time.perf_counter() - t
def run(gen):
    torch.cuda.synchronize(); t = time.perf_counter()
    m.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    torch.cuda.synchronize(); return time.perf_counter() - t
with torch.no_grad():
    run(8)
    short, full = run(1), run(129)
print(json.dumps({"peer": "transformers eager", "prompt": 512, "gen": 128,
                  "decode_tok_s": 128 / (full - short), "prompt_s": short}), flush=True)
with torch.no_grad():
    for n in map(int, sys.argv[2:]):
        prompt(n)
        print(json.dumps({"peer": "transformers eager", "prompt": n,
                          "prompt_tok_s": n / prompt(n)}), flush=True)
EOF
fi
if [ -z "${SKIP_AGENT:-}" ]; then
  stamp "agent loops"
  T=${TEMPLATES:-carry/templates}
  GD=crates/wick-engine/tests/goldens/hf
  for mt in ${AGENT_MODELS:-qwen35:Qwen3.5-4B.jinja qwen35:Qwen-Qwen3-0.6B.jinja gemma4_chat:google-gemma-4-31B-it.jinja}; do
    IFS=: read -r golden tpl <<< "$mt"
    timeout 120 python3 $G/agent_cache.py --wick $W/wick --model $GD/$golden \
      --template $T/$tpl --backend cuda 2>>$OUT/agent.err | tee -a $OUT/agent.jsonl
  done
fi
stamp "done"
