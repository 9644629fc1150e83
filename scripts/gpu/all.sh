#!/usr/bin/env bash
# H200/H100: the GPU issues' checks in one call of about 6 minutes, so every ratio comes from
# the same minutes. Carry: carry/cuda/wick.xz and carry/cuda/cuda_reference.xz (built here
# with `--features cuda`; docs/gpu.md), and TEMPLATES for the agent loops.
#  1. while random-weight bf16 models of the Qwen 3.5 4B, Gemma 4 E4B and Llama-3-8B shapes
#     are made with transformers on the GPU: the whole `cuda_reference` suite
#     (TEST_FILTER narrows it);
#  2. qwen35.sh's bench on Qwen 3.5 4B (decode at batch 1 and 8, prompts of 2,048 and 8,192
#     tokens; with DELTA_COMPARE=1 also on the CUDA-core DeltaNet state pass);
#  3. gemma4.sh's bench on Gemma 4 E4B (decode at batch 1 and 8, a 4,096-token prompt);
#  4. prefill.sh's server part on the 8B: time to first token of an 18.7k-token prompt alone
#     and beside 4 decoding streams (their gaps), with the default prompt steps and pacing;
#  5. the 8B quantized to MLX affine QUANT_BITS (default "4 8"; quantize_mlx.py): decode at
#     batch 8 and 64 with the tensor-core quantized products (WICK_CUDA_QUANT_MMA=1) and
#     with the dequantize + cuBLAS path (the default), same minutes.
#  6. unless SKIP_FAMILY_QUANT, 4- and 8-bit affine copies of the Qwen 3.5 and Gemma 4 models
#     made in this call: decode at batch 1 and 8.
# Each part's results land in $OUT/<part>/ (SKIP_<PART>=1 skips a part: TEST, QWEN, GEMMA,
# SERVE, QUANT, FAMILY_QUANT); the last lines of each are printed.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
ROOT=$OUT
mkdir -p $W/models $ROOT/test
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
for f in wick cuda_reference; do
  for x in carry/*/$f.xz; do [ -f "$x" ] && xz -dc "$x" > $W/$f && chmod +x $W/$f; done
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GD=crates/wick-engine/tests/goldens/hf
make() {  # DIR SHAPE TOKENIZER [ARGS]
  [ -d $W/models/$1 ] || timeout ${MAKE_TIMEOUT:-300} python3 $G/make_models.py \
    $W/models/$1 $2 bfloat16 $3 "${@:4}" > $ROOT/make-$1.log 2>&1
}
pids=()
[ -z "${SKIP_QWEN:-}" ] && { make qwen3.5-4b-bf16 qwen3.5-4b $GD/qwen2 & pids+=($!); }
[ -z "${SKIP_GEMMA:-}" ] && { make gemma4-e4b-bf16 gemma4-e4b $GD/gemma4_chat & pids+=($!); }
if [ -z "${SKIP_SERVE:-}" ] || [ -z "${SKIP_QUANT:-}" ]; then
  make llama3-8b-bf16-32k llama3-8b $GD/qwen2 --context 32768 & pids+=($!)
fi
if [ -z "${SKIP_TEST:-}" ]; then
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-300} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $ROOT/test/test.log 2>&1
  echo "test rc=$?" >> $ROOT/test/test.log
  grep -E "^test .*(FAILED|ok)$|^test result|rc=|panicked" $ROOT/test/test.log | tail -60
fi
for p in "${pids[@]}"; do wait $p; done
tail -qn1 $ROOT/make-*.log 2>/dev/null
export SKIP_TEST=1 SKIP_AGENT=${SKIP_AGENT-1} SKIP_TORCH=${SKIP_TORCH-1}
if [ -z "${SKIP_QWEN:-}" ]; then
  stamp "Qwen 3.5 4B"
  OUT=$ROOT/qwen PROMPTS="2048 8192" bash $G/qwen35.sh > $ROOT/qwen.log 2>&1
  python3 $G/../bench/summarize_bench.py < $ROOT/qwen/bench.jsonl
  if [ -f $ROOT/qwen/bench_cuda_cores.jsonl ]; then
    echo "the same prompts, DeltaNet state pass on the CUDA cores:"
    python3 $G/../bench/summarize_bench.py < $ROOT/qwen/bench_cuda_cores.jsonl
  fi
fi
if [ -z "${SKIP_GEMMA:-}" ]; then
  stamp "Gemma 4 E4B"
  OUT=$ROOT/gemma bash $G/gemma4.sh > $ROOT/gemma.log 2>&1
  python3 $G/../bench/summarize_bench.py < $ROOT/gemma/bench.jsonl
fi
if [ -z "${SKIP_SERVE:-}" ]; then
  stamp "serve: 18.7k-token prompts"
  OUT=$ROOT/serve SKIP_BENCH=1 SERVE_CONFIGS="${SERVE_CONFIGS:---step-tokens 512}" \
    bash $G/prefill.sh > $ROOT/serve.log 2>&1
  cat $ROOT/serve/ttft.jsonl
fi
if [ -z "${SKIP_FAMILY_QUANT:-}" ]; then
  # Issue 46: 4- and 8-bit copies of both families load and run on CUDA.
  mkdir -p $ROOT/family-quant
  for m in ${FAMILY_QUANT_MODELS:-qwen3.5-4b-bf16 gemma4-e4b-bf16}; do
    [ -d $W/models/$m ] || continue
    for bits in ${FAMILY_QUANT_BITS:-4 8}; do
      Q=$W/models/${m%-bf16}-q$bits
      stamp "$m, $bits-bit"
      [ -d $Q ] || timeout 300 python3 $G/quantize_mlx.py $W/models/$m $Q --bits $bits \
        > $ROOT/family-quant/make-${m}-q$bits.log 2>&1
      timeout ${BENCH_TIMEOUT:-150} $W/wick bench $Q --backend cuda --synthetic-prompt \
        --prefill-chunk 0 --json --warmup 1 --runs 2 --case 512:64:1 --case 512:32:8 \
        2>>$ROOT/family-quant/bench.err | tee -a $ROOT/family-quant/bench.jsonl \
        | python3 $G/../bench/summarize_bench.py
      tail -2 $ROOT/family-quant/bench.err
      rm -rf $Q  # the machine's disk holds the bf16 models and one copy at a time
    done
  done
fi
if [ -z "${SKIP_QUANT:-}" ]; then
  mkdir -p $ROOT/quant
  for bits in ${QUANT_BITS:-4 8}; do
    Q=$W/models/llama3-8b-q$bits
    stamp "8B, $bits-bit"
    [ -d $Q ] || timeout 300 python3 $G/quantize_mlx.py $W/models/llama3-8b-bf16-32k $Q \
      --bits $bits > $ROOT/quant/make-q$bits.log 2>&1
    for mma in 1 0; do
      WICK_CUDA_QUANT_MMA=$mma timeout ${BENCH_TIMEOUT:-150} $W/wick bench $Q --backend cuda \
        --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 2 \
        --case 512:64:8 --case 512:32:64 --case 2048:1:1 2>>$ROOT/quant/bench.err \
        | sed -u "s/^{/{\"label\":\"q$bits mma=$mma\",/" | tee -a $ROOT/quant/bench.jsonl \
        | python3 $G/../bench/summarize_bench.py
    done
    rm -rf $Q
  done
fi
stamp "done"
