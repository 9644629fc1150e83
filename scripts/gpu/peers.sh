#!/usr/bin/env bash
# H100/H200: wick beside llama.cpp 0.3.36 (built on the card) on the GPU issues' shapes, in
# three calls back to back on one machine (each under the 10-minute call limit; the machine
# keeps /tmp/wick between them). STAGE picks the call:
#  1. the llama.cpp build (in the background, niced) while serve_ab.sh checks the KV
#     preallocation (`wick serve --backend cuda` with and without it: TTFT of an 18.7k prompt
#     alone and beside 4 streams); then the Qwen 3.5 4B and Gemma 4 E4B shapes are made with their
#     families' real tokenizers, and all three models are converted to bf16 GGUFs.
#  2. llama.cpp: llama-bench and llama-batched-bench on the three bf16 GGUFs, and on the Q8_0
#     and Q4_K_M copies of the 8B and of Qwen 3.5 (kept for stage 3).
#  3. wick on the same models and the same quantized GGUFs: prompts of 512 to 16,384 tokens, decode at
#     batch 1, 8 and 64 after 512 tokens (llama-batched-bench's shape); then MLX affine 4/8-bit
#     copies of both families (all.sh's FAMILY_QUANT part).
# Carry: carry/cuda/wick.xz and cuda_reference.xz; stage 1 also carry/llamacpp (the source).
# Results under $OUT (stage 1: serve/, llamacpp-build/, llamacpp/; 2: llamacpp/, llamacpp-8b/;
# 3: wick.jsonl, family-quant/), steps.log with each step's time.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
LW=$W/llamacpp
OUT=${OUT:?set OUT to the results folder}
mkdir -p $W/models $OUT
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
# The GGUFs go to memory when /dev/shm has room for all of them (the disk holds ~40 GB of
# safetensors), else next to the build, where llamacpp.sh deletes benchmarked ones for room.
shm_gib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${shm_gib:-0}" -ge 60 ]; then export GGUF_DIR=/dev/shm/gguf; else export GGUF_DIR=$LW/gguf; fi
mkdir -p $GGUF_DIR
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
FAMILIES="qwen3.5-4b-bf16 gemma4-e4b-bf16"
LLAMA=llama3-8b-bf16-32k

case ${STAGE:?set STAGE to 1, 2 or 3} in
1)
  stamp "llama.cpp build in the background; GGUFs in $GGUF_DIR (/dev/shm: ${shm_gib:-?} GiB free)"
  ( MODELS=" " PREPARE_ONLY=1 OUT=$OUT/llamacpp-build JOBS=${JOBS:-14} \
      nice -n 19 bash $G/llamacpp.sh > $OUT/llamacpp-build.log 2>&1 ) &
  bp=$!
  stamp "serve_ab.sh"
  OUT=$OUT/serve bash $G/serve_ab.sh > $OUT/serve.log 2>&1
  cat $OUT/serve.log
  stamp "making $FAMILIES"
  pids=()
  for m in $FAMILIES; do
    case $m in gemma4*) v=gemma-4 ;; *) v=qwen2 ;; esac
    d=$W/models/$m
    [ -d $d ] && continue
    ( for _ in $(seq 1 120); do [ -f $LW/tok/$v/tokenizer.json ] && break; sleep 1; done
      rm -rf $d.part
      timeout 300 python3 $G/make_models.py $d.part ${m%-bf16} bfloat16 $LW/tok/$v \
        > $OUT/make-$m.log 2>&1 && mv $d.part $d || tail -3 $OUT/make-$m.log ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait $p; done
  stamp "waiting for the llama.cpp build"
  wait $bp
  tail -3 $OUT/llamacpp-build/build.log
  stamp "bf16 GGUFs"
  PREPARE_ONLY=1 MODELS="$FAMILIES $LLAMA" OUT=$OUT/llamacpp bash $G/llamacpp.sh \
    > $OUT/llamacpp.log 2>&1
  tail -5 $OUT/llamacpp.log
  ls -la $GGUF_DIR
  ;;
2)
  stamp "llama.cpp on $FAMILIES (and Qwen 3.5's Q8_0 and Q4_K_M copies, kept for stage 3)"
  MODELS=${FAMILIES%% *} QUANTS="Q8_0 Q4_K_M" KEEP_GGUF=1 OUT=$OUT/llamacpp-qwen \
    bash $G/llamacpp.sh > $OUT/llamacpp-qwen.log 2>&1
  tail -8 $OUT/llamacpp-qwen.log
  MODELS=${FAMILIES#* } OUT=$OUT/llamacpp bash $G/llamacpp.sh > $OUT/llamacpp.log 2>&1
  tail -6 $OUT/llamacpp.log
  stamp "llama.cpp on $LLAMA: bf16, Q8_0, Q4_K_M"
  MODELS=$LLAMA QUANTS="Q8_0 Q4_K_M" KEEP_GGUF=1 PROMPTS=512,2048,8192,16384 \
    OUT=$OUT/llamacpp-8b bash $G/llamacpp.sh > $OUT/llamacpp-8b.log 2>&1
  tail -8 $OUT/llamacpp-8b.log
  ;;
3)
  for f in wick; do xz -dc carry/cuda/$f.xz > $W/$f && chmod +x $W/$f; done
  bench() {  # LABEL MODEL CASE...
    local label=$1 m=$2; shift 2
    local args=(); for c in "$@"; do args+=(--case $c); done
    stamp "wick bench $label"
    timeout ${BENCH_TIMEOUT:-240} $W/wick bench $m --backend cuda --synthetic-prompt \
      --prefill-chunk 0 --json --warmup 1 --runs 3 "${args[@]}" 2>>$OUT/wick.err \
      | sed -u "s/^{/{\"label\":\"$label\",/" | tee -a $OUT/wick.jsonl \
      | python3 $G/../bench/summarize_bench.py
    tail -2 $OUT/wick.err
  }
  decode="512:128:1 512:64:8 512:32:64"
  bench qwen3.5-4b-bf16 $W/models/qwen3.5-4b-bf16 $decode 512:1:1 2048:1:1 4096:1:1 8192:1:1
  bench gemma4-e4b-bf16 $W/models/gemma4-e4b-bf16 $decode 512:1:1 2048:1:1 4096:1:1 8192:1:1
  bench llama3-8b-bf16 $W/models/$LLAMA $decode 512:1:1 2048:1:1 8192:1:1 16384:1:1
  for q in q8_0 q4_k_m; do
    g=$GGUF_DIR/$LLAMA-$q.gguf
    [ -s $g ] && bench llama3-8b-$q $g $decode 512:1:1 2048:1:1 8192:1:1 16384:1:1
    g=$GGUF_DIR/qwen3.5-4b-bf16-$q.gguf
    [ -s $g ] && bench qwen3.5-4b-$q $g $decode 512:1:1 2048:1:1 8192:1:1
  done
  stamp "MLX affine copies of both families"
  OUT=$OUT SKIP_TEST=1 SKIP_QWEN=1 SKIP_GEMMA=1 SKIP_SERVE=1 SKIP_QUANT=1 \
    bash $G/all.sh > $OUT/family-quant.log 2>&1
  tail -20 $OUT/family-quant.log
  ;;
esac
stamp "done"
