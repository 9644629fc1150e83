#!/usr/bin/env bash
# H100/H200: the quantized products of batched decode and where the time goes on the paths
# issues 46 and 47 still miss, in one call:
#  1. (unless SKIP_TEST) cuda_reference's affine tests (TESTS: a filter; ALL_TESTS=1 runs the
#     whole suite), while the models are made;
#  2. the Llama-3-8B shape's MLX affine 8- and 4-bit copies (groups of 32, as GGUF Q8_0 and
#     Q4_K re-lay out): `wick bench` decode at 8, 16 and 64 streams for each of VARIANTS
#     (label=ENV pairs, commas between settings; default: the f16 tensor-core kernel, the
#     int8 one up to 16 rows, the int8 one up to 64 rows), then one decode run of 8 streams
#     kernel by kernel under Nsight Compute (graphs off, NCU_ENV set; kernel_profile.py sums
#     each step);
#  3. the prompt pass of a 4,096-token prompt on the Gemma 4 26B-A4B (and E4B) shapes under
#     Nsight Compute.
# The models are random-weight bf16 checkpoints made with transformers on the GPU
# (make_models.py; the 26B one in /dev/shm where it has room). PARTS picks a subset
# (quant, g26, e4b; default "quant g26"). Carry: carry/cuda/wick.xz and cuda_reference.xz.
# Results under $OUT: test.log, bench.jsonl, ncu-*.json (and their CSVs, xz), steps.log,
# env.txt.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
OUT=${OUT:?set OUT to the results folder}
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
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
PARTS=${PARTS:-quant g26}
tok_llama=crates/wick-engine/tests/goldens/hf/qwen2
tok_gemma=crates/wick-engine/tests/goldens/hf/gemma4_chat
shm_gib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')

# mk NAME SHAPE TOKENIZER [DIR]: the model folder $W/models/NAME (made in DIR if given).
mk() {
  local d=$W/models/$1 at=${4:-$W/models/$1}
  [ -d $d ] && return
  stamp "making $1"
  timeout 300 python3 $G/make_models.py $at.part $2 bfloat16 $3 > $OUT/make-$1.log 2>&1 \
    && mv $at.part $at && { [ $at = $d ] || ln -sfn $at $d; } || tail -3 $OUT/make-$1.log
}

# ncu_run LABEL MODEL CASE [--prompt]: one run under Nsight Compute, summed per step.
ncu_run() {
  [ -n "$NCU" ] || { echo "no ncu"; return; }
  stamp "Nsight Compute: $1"
  env WICK_CUDA_GRAPHS=0 ${NCU_ENV:-} timeout ${NCU_TIMEOUT:-200} $NCU --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-count ${NCU_KERNELS:-9000} $W/wick bench $2 --backend cuda \
    --synthetic-prompt --prefill-chunk 0 --json --warmup 0 --runs 1 --case $3 \
    > $OUT/ncu-$1.csv 2>>$OUT/ncu.err
  python3 $G/kernel_profile.py $OUT/ncu-$1.csv $1 ${4:-} > $OUT/ncu-$1.json
  head -c 1500 $OUT/ncu-$1.json; echo
  xz -T0 $OUT/ncu-$1.csv
}

bench() {  # bench LABEL ENV MODEL CASES...
  local label=$1 e=$2 m=$3
  shift 3
  stamp "wick bench $label"
  env $e timeout ${BENCH_TIMEOUT:-150} $W/wick bench $m --backend cuda --synthetic-prompt \
    --prefill-chunk 0 --json --warmup 1 --runs 2 "${@/#/--case=}" 2>>$OUT/bench.err \
    | sed -u "s/^{/{\"label\":\"$label\",/" | tee -a $OUT/bench.jsonl \
    | python3 $G/../bench/summarize_bench.py
}

if [ -z "${SKIP_TEST:-}" ] && [ -f $W/cuda_reference ]; then
  stamp "cuda_reference"
  filter=${TESTS:-affine}
  [ -n "${ALL_TESTS:-}" ] && filter=
  ( WICK_GOLDENS=crates/wick-engine/tests/goldens timeout 300 $W/cuda_reference --test-threads 1 \
      $filter > $OUT/test.log 2>&1; echo "test rc=$?" >> $OUT/test.log ) &
  tp=$!
fi
# The 8B first; the 26B and E4B shapes are made in the background while its copies are
# measured.
case " $PARTS " in *" quant "*) mk llama3-8b-bf16 llama3-8b $tok_llama ;; esac
(
  case " $PARTS " in *" g26 "*)
    if [ "${shm_gib:-0}" -ge 70 ]; then mk gemma4-26b-a4b-bf16 gemma4-26b-a4b $tok_gemma /dev/shm/g26
    else mk gemma4-26b-a4b-bf16 gemma4-26b-a4b $tok_gemma; fi ;;
  esac
  case " $PARTS " in *" e4b "*) mk gemma4-e4b-bf16 gemma4-e4b $tok_gemma ;; esac
) &
bg=$!

case " $PARTS " in *" quant "*)
  M=$W/models/llama3-8b-bf16
  for bits in 8 4; do
    q=$M-q$bits
    [ -d $q ] || timeout 300 python3 $G/quantize_mlx.py $M $q --bits $bits --group 32 \
      > $OUT/quantize-q$bits.log 2>&1 || tail -3 $OUT/quantize-q$bits.log
  done
  if [ -n "${tp:-}" ]; then wait $tp; tp=; grep -E "^test |test result|rc=|panicked" $OUT/test.log | tail -12; fi
  for round in $(seq 1 ${ROUNDS:-1}); do
    for bits in 8 4; do
      for v in ${VARIANTS:-f16=WICK_CUDA_QUANT_IMMA_ROWS=0 int8-16=WICK_CUDA_QUANT_IMMA_ROWS=16 int8-64=WICK_CUDA_QUANT_IMMA_ROWS=64}; do
        bench q$bits-${v%%=*} "$(echo ${v#*=} | tr ',' ' ')" $M-q$bits ${CASES:-512:64:8 512:32:16 512:16:64}
      done
    done
  done
  ncu_run q8-b8 $M-q8 128:10:8
  ;;
esac
[ -n "${tp:-}" ] && wait $tp && grep -E "test result|rc=|panicked" $OUT/test.log | tail -5
wait $bg
case " $PARTS " in *" g26 "*) ncu_run g26-prompt $W/models/gemma4-26b-a4b-bf16 4096:1:1 --prompt ;; esac
case " $PARTS " in *" e4b "*) ncu_run e4b-prompt $W/models/gemma4-e4b-bf16 4096:1:1 --prompt ;; esac
stamp "done"
