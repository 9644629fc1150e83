#!/usr/bin/env bash
# H100/H200: the quantized tensor-core products (3 to 256 rows: batched decode) beside
# llama.cpp 0.3.36 on the same GGUF files, in two calls back to back on one machine (each
# under the 10-minute call limit; the machine keeps /tmp/wick between them). STAGE picks:
#  1. in the background, niced: llama.cpp's build, the Llama-3-8B-shape bf16 model
#     (make_models.py, the real Llama 3 tokenizer), its bf16 GGUF and llama-quantize's Q8_0
#     and Q4_K_M copies (llamacpp.sh PREPARE_ONLY=1, then llama-quantize); meanwhile the
#     whole cuda_reference suite, and with PROFILE=1 the Gemma 4 E4B shape's decode kernel by
#     kernel under Nsight Compute (graphs off; kernel_profile.py sums it per step) and its
#     wick bench (decode at 1 and 8 streams, a 4,096-token prompt).
#  2. llama-batched-bench (512-token prompts, 128 tokens each at 1, 8 and 64 streams) and
#     llama-bench (512-token prompt) on the two GGUFs, then wick bench on the same files
#     with each variant of VARIANTS: `once` (x rounded to f16 once per product, the
#     default), `per-block` (x rounded by every block, WICK_CUDA_QUANT_MMA=per-block) and
#     `blas` (the matrix dequantized to bf16 for cuBLAS).
#  quick: one call without llama.cpp (when device time is short): the reference suite
#     (unless SKIP_TEST), the 8B's MLX affine 8- and 4-bit copies (BITS, default "8 4") with
#     each variant in ROUNDS interleaved rounds, and Gemma 4 E4B's bench (SKIP_GEMMA=1
#     leaves it out; PROFILE=1 adds its kernel profile). Without carry/llamacpp the models
#     take the goldens' tokenizers.
# Carry: carry/cuda/wick.xz and cuda_reference.xz; stage 1 also carry/llamacpp (the source).
# Results under $OUT: steps.log, test.log, llamacpp/ (its logs and results), wick.jsonl,
# ncu-*.json.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
LW=$W/llamacpp
OUT=${OUT:?set OUT to the results folder}
mkdir -p $W/models $OUT
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
shm_gib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${shm_gib:-0}" -ge 40 ]; then export GGUF_DIR=/dev/shm/gguf; else export GGUF_DIR=$LW/gguf; fi
mkdir -p $GGUF_DIR
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
M=${MODEL:-llama3-8b-bf16}
for f in wick cuda_reference; do
  [ -f carry/cuda/$f.xz ] && xz -dc carry/cuda/$f.xz > $W/$f && chmod +x $W/$f
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/env.txt 2>&1

# Gemma 4 E4B's decode kernel by kernel under Nsight Compute (graphs off), summed per step.
gemma_profile() {
  local d=$W/models/gemma4-e4b-bf16
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -d $d ] && [ -n "$NCU" ]; then
    stamp "Nsight Compute: gemma4-e4b decode"
    WICK_CUDA_GRAPHS=0 timeout ${NCU_TIMEOUT:-240} $NCU --clock-control none \
      --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
      --launch-count ${NCU_KERNELS:-12000} $W/wick bench $d --backend cuda \
      --synthetic-prompt --prefill-chunk 0 --json --warmup 0 --runs 1 --case 64:12:1 \
      > $OUT/ncu-gemma4.csv 2>>$OUT/ncu.err
    python3 $G/kernel_profile.py $OUT/ncu-gemma4.csv gemma4-e4b | tee $OUT/ncu-gemma4.json
    xz -T0 $OUT/ncu-gemma4.csv
  fi
}

case ${STAGE:?set STAGE to 1, 2 or quick} in
1)
  stamp "llama.cpp build, $M, its GGUFs (background; GGUFs in $GGUF_DIR)"
  ( MODELS=$M PREPARE_ONLY=1 OUT=$OUT/llamacpp JOBS=${JOBS:-14} nice -n 19 bash $G/llamacpp.sh \
      > $OUT/llamacpp-prepare.log 2>&1
    for q in Q8_0 Q4_K_M; do
      g=$GGUF_DIR/$M-${q,,}.gguf
      [ -s $g ] || nice -n 19 $LW/build/bin/llama-quantize $GGUF_DIR/$M-bf16.gguf $g.part $q 14 \
        > $OUT/quantize-$q.log 2>&1 && mv $g.part $g
    done
    echo "quantized: $(ls $GGUF_DIR)" >> $OUT/llamacpp-prepare.log ) &
  bp=$!
  stamp "cuda_reference"
  WICK_GOLDENS=crates/wick-engine/tests/goldens timeout 300 $W/cuda_reference --test-threads 1 \
    > $OUT/test.log 2>&1
  echo "test rc=$?" >> $OUT/test.log
  grep -E "FAILED|^test result|rc=|panicked" $OUT/test.log | tail -20
  if [ -n "${PROFILE:-}" ]; then
    d=$W/models/gemma4-e4b-bf16
    if [ ! -d $d ]; then
      stamp "making gemma4-e4b-bf16"
      for _ in $(seq 1 120); do [ -f $LW/tok/gemma-4/tokenizer.json ] && break; sleep 1; done
      timeout 300 python3 $G/make_models.py $d.part gemma4-e4b bfloat16 $LW/tok/gemma-4 \
        > $OUT/make-gemma4.log 2>&1 && mv $d.part $d || tail -3 $OUT/make-gemma4.log
    fi
    gemma_profile
    if [ -d $d ]; then
      stamp "wick bench gemma4-e4b"
      timeout 200 $W/wick bench $d --backend cuda --synthetic-prompt --prefill-chunk 0 --json \
        --warmup 1 --runs 3 --case 512:128:1 --case 512:64:8 --case 4096:1:1 2>>$OUT/wick.err \
        | sed -u 's/^{/{"label":"gemma4-e4b-bf16",/' | tee -a $OUT/wick-gemma4.jsonl \
        | python3 $G/../bench/summarize_bench.py
    fi
  fi
  stamp "waiting for llama.cpp"
  wait $bp
  tail -4 $OUT/llamacpp-prepare.log
  ;;
2)
  stamp "llama.cpp on the $M Q8_0 and Q4_K_M GGUFs"
  for q in q8_0 q4_k_m; do
    g=$GGUF_DIR/$M-$q.gguf
    [ -s $g ] || { echo "$g: missing"; continue; }
    timeout 240 $LW/build/bin/llama-batched-bench -m $g -fa on -ngl 99 -c $((64 * 640)) \
      -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8,64 --output-format jsonl \
      > $OUT/llamacpp-$q.batched.log 2>&1
    grep '^{' $OUT/llamacpp-$q.batched.log | sed "s/^{/{\"type\":\"$q\",/" \
      | tee -a $OUT/llamacpp-batched.jsonl
    timeout 120 $LW/build/bin/llama-bench -m $g -fa 1 -ngl 99 -r 3 -o jsonl -p 512 -n 0 \
      -b 2048 -ub 512 2>/dev/null | tee -a $OUT/llamacpp-bench.jsonl
  done
  stamp "wick on the same files"
  for q in q8_0 q4_k_m; do
    g=$GGUF_DIR/$M-$q.gguf
    [ -s $g ] || continue
    for v in ${VARIANTS:-once per-block}; do
      case $v in once) e=once ;; per-block) e=per-block ;; blas) e=0 ;; esac
      stamp "wick bench $q $v"
      WICK_CUDA_QUANT_MMA=$e timeout ${BENCH_TIMEOUT:-200} $W/wick bench $g --backend cuda \
        --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 2 \
        --case 512:128:1 --case 512:64:8 --case 512:32:64 --case 512:16:16 --case 512:1:1 \
        2>>$OUT/wick.err | sed -u "s/^{/{\"type\":\"$q\",\"variant\":\"$v\",/" \
        | tee -a $OUT/wick.jsonl | python3 $G/../bench/summarize_bench.py
      tail -2 $OUT/wick.err
    done
  done
  ;;
quick)
  # One call, no llama.cpp: the tests, the 8B's MLX affine 8- and 4-bit copies (groups of 32,
  # as GGUF's Q8_0 and Q4_K re-lay out) with each variant, and Gemma 4 E4B's bench.
  # The families' real tokenizers from the llama.cpp carry when it is there, else the
  # goldens' (the products do not care which).
  tok_llama=crates/wick-engine/tests/goldens/hf/qwen2
  tok_gemma=crates/wick-engine/tests/goldens/hf/gemma4_chat
  if [ -f carry/llamacpp/llamacpp.tar.xz ]; then
    mkdir -p $LW && tar -C $LW -xJf carry/llamacpp/llamacpp.tar.xz
    for v in llama-bpe gemma-4; do
      [ -f $LW/tok/$v/tokenizer.json ] || PYTHONPATH=$LW/llama.cpp/gguf-py python3 \
        $G/vocab_tokenizer.py $LW/llama.cpp/models/ggml-vocab-$v.gguf $LW/tok/$v > /dev/null 2>&1
    done
    tok_llama=$LW/tok/llama-bpe tok_gemma=$LW/tok/gemma-4
  fi
  # The models are made (on the GPU) while the tests run.
  pids=()
  models=$M:llama3-8b:$tok_llama
  [ -n "${SKIP_GEMMA:-}" ] || models+=" gemma4-e4b-bf16:gemma4-e4b:$tok_gemma"
  for m in $models; do
    IFS=: read -r name shape tok <<< "$m"
    d=$W/models/$name
    [ -d $d ] && continue
    stamp "making $name"
    ( timeout 300 python3 $G/make_models.py $d.part $shape bfloat16 $tok \
        > $OUT/make-$name.log 2>&1 && mv $d.part $d || tail -3 $OUT/make-$name.log ) &
    pids+=($!)
  done
  if [ -z "${SKIP_TEST:-}" ]; then
    stamp "cuda_reference"
    WICK_GOLDENS=crates/wick-engine/tests/goldens timeout 300 $W/cuda_reference \
      --test-threads 1 > $OUT/test.log 2>&1
    echo "test rc=$?" >> $OUT/test.log
    grep -E "FAILED|^test result|rc=|panicked" $OUT/test.log | tail -20
  fi
  for p in "${pids[@]}"; do wait $p; done
  [ -z "${PROFILE:-}" ] || [ -n "${SKIP_GEMMA:-}" ] || gemma_profile
  [ -n "${SKIP_GEMMA:-}" ] || stamp "wick bench gemma4-e4b"
  [ -n "${SKIP_GEMMA:-}" ] || timeout 200 $W/wick bench $W/models/gemma4-e4b-bf16 --backend cuda --synthetic-prompt \
    --prefill-chunk 0 --json --warmup 1 --runs 3 --case 512:128:1 --case 512:64:8 \
    --case 4096:1:1 2>>$OUT/wick.err | sed -u 's/^{/{"label":"gemma4-e4b-bf16",/' \
    | tee -a $OUT/wick-gemma4.jsonl | python3 $G/../bench/summarize_bench.py
  for bits in ${BITS:-8 4}; do
    q=$W/models/$M-q$bits
    [ -d $q ] || timeout 300 python3 $G/quantize_mlx.py $W/models/$M $q --bits $bits --group 32 \
      > $OUT/quantize-q$bits.log 2>&1 || tail -3 $OUT/quantize-q$bits.log
    for round in $(seq 1 ${ROUNDS:-1}); do
      for v in ${VARIANTS:-once per-block}; do
        case $v in once) e=once ;; per-block) e=per-block ;; blas) e=0 ;; esac
        stamp "wick bench q$bits $v (round $round)"
        WICK_CUDA_QUANT_MMA=$e timeout ${BENCH_TIMEOUT:-150} $W/wick bench $q --backend cuda \
          --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 2 \
          --case 512:64:8 --case 512:32:64 --case 512:16:16 2>>$OUT/wick.err \
          | sed -u "s/^{/{\"type\":\"mlx-q$bits\",\"variant\":\"$v\",\"round\":$round,/" \
          | tee -a $OUT/wick.jsonl | python3 $G/../bench/summarize_bench.py
      done
    done
  done
  ;;
esac
stamp "done"
