#!/usr/bin/env bash
# H200: wick's own CUDA backend (issue 25), one call. Carry: carry/cuda/wick.xz and
# carry/cuda/cuda_reference.xz (built here with `--features cuda`; see docs/gpu.md).
#  1. the reference test: transformers' f32 goldens, agreement with the CPU backend, and
#     decode steps replayed as CUDA graphs (unless SKIP_TEST is set);
#  2. random-weight bf16 models of real shapes (MAKE, made with transformers on the GPU),
#     and MLX affine 4/8-bit copies of them (QUANT, quantize_mlx.py);
#  3. `wick bench --backend cuda` on each (CASES), with graphs on and off (GRAPHS), with
#     programmatic dependent launch on and/or off (PDL: 1 and/or 0; default on), with
#     quantized batches of 3-256 rows on the tensor-core kernel and/or on the bf16 copy
#     for cuBLAS (QMMA: 1 and/or 0; default 1), for
#     each KV cache type (KV: f32 and/or f16), and
#     PyTorch's eager and CUDA-graph decode of the same model (torch_graph_decode.py)
#     (unless SKIP_BENCH / SKIP_TORCH);
#  4. with SERVE=1, `wick serve --backend cuda --kv-type $SERVE_KV` (default f32) on the
#     last model and streaming chat load
#     at each concurrency of CURVE (`wick bench --concurrency`), to $OUT/curve.jsonl;
#  5. with NCU=1, an Nsight Compute pass over a short decode of each model that times every
#     kernel (`kernel_profile.py` sums them per step).
# Results: $OUT/test.log, $OUT/bench.jsonl, $OUT/ncu-*.json, $OUT/*.err.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
mkdir -p $W/models $OUT
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
for f in wick cuda_reference; do
  [ -f carry/cuda/$f.xz ] && xz -dc carry/cuda/$f.xz > $W/$f && chmod +x $W/$f
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > $OUT/env.txt 2>&1
if [ -z "${SKIP_TEST:-}" ]; then
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout ${TEST_TIMEOUT:-240} \
    $W/cuda_reference --test-threads 1 --nocapture ${TEST_FILTER:-} > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
  grep -E "^test |rc=|panicked|FAILED|Stats" $OUT/test.log | tail -40
fi
# The tiny Qwen2 golden's tokenizer (512 ids) goes with every model: `wick bench` feeds
# synthetic ids, and a model served to chat clients needs a vocabulary the tokenizer can
# decode (MAKE entries SHAPE:DTYPE:VOCAB, folder SHAPE-DTYPE-vVOCAB).
TOK=crates/wick-engine/tests/goldens/hf/qwen2
for sd in ${MAKE:-qwen2.5-0.5b:bfloat16 llama3-8b:bfloat16}; do
  IFS=: read -r shape dtype vocab <<< "$sd"
  case $dtype in bfloat16) tag=bf16 ;; float16) tag=f16 ;; *) tag=f32 ;; esac
  dir=$W/models/$shape-$tag${vocab:+-v$vocab}
  [ -d $dir ] || timeout 300 python3 $G/make_models.py $dir $shape $dtype $TOK \
    ${vocab:+--vocab $vocab} 2>&1 | tail -1
done
# MLX affine copies (QUANT entries MODEL:BITS, folder MODEL-qBITS), made with torch.
for mb in ${QUANT:-}; do
  IFS=: read -r src bits <<< "$mb"
  [ -d $W/models/$src-q$bits ] || timeout 300 python3 $G/quantize_mlx.py $W/models/$src \
    $W/models/$src-q$bits --bits $bits 2>&1 | tail -1
done
for m in ${MODELS:-qwen2.5-0.5b-bf16 llama3-8b-bf16}; do
  [ -n "${SKIP_BENCH:-}" ] && break
  for kv in ${KV:-f32}; do
  for g in ${GRAPHS:-1 0}; do
  for pdl in ${PDL:-1}; do
  for qm in ${QMMA:-1}; do
    args=(); for c in ${CASES:-512:128:1 512:64:8 2048:1:1}; do args+=(--case $c); done
    WICK_CUDA_GRAPHS=$g WICK_CUDA_PDL=$pdl WICK_CUDA_QUANT_MMA=$qm timeout ${BENCH_TIMEOUT:-240} $W/wick bench $W/models/$m --backend cuda \
      --kv-type $kv --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 3 "${args[@]}" \
      2>>$OUT/bench.err | sed -u "s/^{/{\"graphs\":$g,\"pdl\":$pdl,\"quant_mma\":$qm,\"model_dir\":\"$m\",/" | tee -a $OUT/bench.jsonl
  done
  done
  done
  done
  [ -n "${SKIP_TORCH:-}" ] || timeout ${TORCH_TIMEOUT:-200} python3 $G/torch_graph_decode.py \
    $W/models/$m --prompt 512 --gen 128 2>>$OUT/torch.err | tee -a $OUT/bench.jsonl
done
if [ -n "${SERVE:-}" ]; then
  m=${MODELS:-qwen2.5-0.5b-bf16 llama3-8b-bf16}; m=${m##* }; port=8411
  $W/wick serve $W/models/$m --backend cuda --kv-type ${SERVE_KV:-f32} --port $port --max-batch 64 --max-queue 512 \
    --kv-memory ${KV_MEMORY:-40G} --prompt-cache 0 > $OUT/serve.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" 2>/dev/null && break
    sleep 1
  done
  for n in ${CURVE:-1 8 64}; do
    timeout 180 $W/wick bench --concurrency $n --url http://127.0.0.1:$port --rounds 1 \
      --prompt-tokens ${PROMPT:-128} --gen-tokens ${GEN:-256} --json 2>> $OUT/curve.err \
      | sed -u "s/^{/{\"model_dir\":\"$m\",/" | tee -a $OUT/curve.jsonl
  done
  kill $pid; wait $pid 2>/dev/null
fi
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "${NCU:-}" ] && [ -n "$NCU_BIN" ]; then
  for m in ${NCU_MODELS:-${MODELS:-qwen2.5-0.5b-bf16 llama3-8b-bf16}}; do
    timeout ${NCU_TIMEOUT:-200} $NCU_BIN --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --print-units base --launch-count ${NCU_KERNELS:-20000} \
      $W/wick bench $W/models/$m --backend cuda --synthetic-prompt --prefill-chunk 0 --json --warmup 0 \
      --runs 1 --case 512:24:1 > $OUT/ncu-$m.csv 2>>$OUT/ncu.err
    python3 $G/kernel_profile.py $OUT/ncu-$m.csv $m | tee $OUT/ncu-$m.json
    xz -T0 $OUT/ncu-$m.csv
  done
fi
