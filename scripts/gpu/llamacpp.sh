#!/usr/bin/env bash
# H100/H200: llama.cpp 0.3.36 (the version llama-cpp-python pins) as the GPU issues' peer,
# built on the card and run on the random-weight models of make_models.py.
# Carry: carry/llamacpp/llamacpp.tar.xz (scripts/gpu/llamacpp_carry.sh: a stripped copy of
# the source with the converter and three vocab GGUFs, ~7 MB).
#  1. unpacks it into $W/llamacpp and builds llama-bench, llama-batched-bench and
#     llama-quantize with CUDA for sm_90 only (ninja, -j$JOBS; kept for later calls on the
#     same machine: a call whose build is there skips this step), while
#  2. the Hugging Face tokenizers of the Llama 3, Qwen and Gemma 4 vocabularies are written
#     from the vocab GGUFs (vocab_tokenizer.py) and each missing model of MODELS named
#     `<shape>-bf16` (or `<shape>-bf16-32k`: a 32k context) is made with make_models.py and
#     its family's tokenizer, then
#  3. each model is converted to a bf16 GGUF by llama.cpp's convert_hf_to_gguf.py: from a
#     folder of links to its weights beside its family's real tokenizer (the converter
#     identifies a BPE tokenizer by its hash and wants Gemma 4's 262,144 ids; stand-in
#     tokenizers make it refuse), Qwen 3.5 with --no-mtp (the stand-ins have no MTP layer
#     and llama-bench would not run it); QUANTS adds llama-quantize copies (Q8_0, Q4_K_M, ...);
#  4. llama-bench -fa 1 -ngl 99: prompts of PROMPTS tokens at each ubatch of UBATCH, GEN
#     tokens of decode from an empty cache and after DEPTH tokens; llama-batched-bench:
#     BATCHES streams of a BATCH_PROMPT-token prompt decoding GEN tokens each
#     (LLAMA_BENCH_ARGS and BATCHED_ARGS add arguments to each).
# MODELS: folders made by make_models.py, as paths or names under $W/models (default:
#   qwen3.5-4b-bf16 gemma4-e4b-bf16 llama3-8b-bf16-32k).
# GGUF_DIR: where the GGUFs go (default $W/llamacpp/gguf). When the disk is short, the
#   GGUFs of models already benchmarked (and of other calls' models) are deleted, oldest
#   first; gemma4-26b-a4b-bf16 is 50 GB of safetensors and 50 GB of GGUF, more than a
#   64 GiB disk holds: GGUF_DIR=/dev/shm/gguf keeps its GGUF in memory instead (where
#   /dev/shm has the room: the script checks before converting).
# PREPARE_ONLY=1 stops after step 3 (the build, the models, their bf16 GGUFs): a call of its
# own when everything would not fit in one; the next call on the same machine keeps them.
# CPU_ONLY=1 builds without CUDA (to try the script on a machine without a GPU).
# Results in $OUT: summary.md (one line per model and type), <model>-<type>.bench.json
# (llama-bench), .batched.jsonl (llama-batched-bench), build.log, convert and make logs,
# steps.log with each step's time.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
OUT=${OUT:?set OUT to the results folder}
LW=$W/llamacpp
L=$LW/llama.cpp
GD=${GGUF_DIR:-$LW/gguf}
mkdir -p $W/models $GD $LW/tok $OUT
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.log; }
MODELS=${MODELS:-qwen3.5-4b-bf16 gemma4-e4b-bf16 llama3-8b-bf16-32k}
QUANTS=${QUANTS:-}
PROMPTS=${PROMPTS:-512,2048,4096,8192}
UBATCH=${UBATCH:-512,2048}
GEN=${GEN:-128}
DEPTH=${DEPTH:-512}
BATCHES=${BATCHES:-1,8,64}
BATCH_PROMPT=${BATCH_PROMPT:-512}
REPS=${REPS:-3}
JOBS=${JOBS:-$(nproc)}
TARBALL=${LLAMACPP_TARBALL:-carry/llamacpp/llamacpp.tar.xz}
# The driver's libcuda.so.1 where the GPU machine keeps it (as the other GPU scripts do).
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  { command -v nvcc || ls /usr/local/cuda/bin/nvcc; } | head -1 | xargs -r -I{} {} --version | tail -2
  cmake --version | head -1; } > $OUT/env.txt 2>&1

# 1. the source (stamps hold the tarball's checksum: a new carry unpacks and builds anew; a
# build cut short by the call's time limit goes on where it stopped), then the build in the
# background.
sum=$( [ -f $TARBALL ] && sha256sum < $TARBALL | cut -c1-16 || cat $LW/unpacked 2>/dev/null )
if [ -n "$sum" ] && [ "$(cat $LW/unpacked 2>/dev/null)" != "$sum" ]; then
  rm -rf $L $LW/build $LW/built $LW/unpacked && tar -C $LW -xJf $TARBALL \
    && echo "$sum" > $LW/unpacked
fi
[ -f $L/CMakeLists.txt ] || { echo "no llama.cpp source in $L: carry $TARBALL"; exit 1; }
build() {
  if [ "$(cat $LW/built 2>/dev/null)" = "$sum" ] && [ -x $LW/build/bin/llama-bench ]; then
    echo "build: kept from an earlier call"; return 0
  fi
  local cuda=(-DGGML_CUDA=OFF) nvcc b0 gen
  if [ -z "${CPU_ONLY:-}" ]; then
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
    [ -n "$nvcc" ] || { echo "no nvcc"; return 1; }
    # sm_90 only, and only the flash-attention kernels of f16/q8_0/q4_0 caches.
    cuda=(-DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER=$nvcc
          -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_CUDA_FA_ALL_QUANTS=OFF)
  fi
  b0=$(date +%s)
  gen=$(command -v ninja > /dev/null && echo Ninja || echo "Unix Makefiles")
  cmake -S $L -B $LW/build -G "$gen" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF || return 1
  cmake --build $LW/build -j $JOBS --target llama-bench llama-batched-bench llama-quantize \
    || return 1
  echo "build: $(( $(date +%s) - b0 )) s"
  echo "$sum" > $LW/built
}
stamp "build llama.cpp (log: build.log)"
build > $OUT/build.log 2>&1 &
BUILD_PID=$!

# 2. tokenizers from the vocab GGUFs, then the missing models (the GPU makes them while the
# CPU builds).
declare -A tpids
for v in qwen2 llama-bpe gemma-4; do
  [ -f $LW/tok/$v/tokenizer.json ] && continue
  PYTHONPATH=$L/gguf-py python3 $G/vocab_tokenizer.py $L/models/ggml-vocab-$v.gguf \
    $LW/tok/$v > $OUT/tok-$v.log 2>&1 &
  tpids[$v]=$!
done
for v in "${!tpids[@]}"; do wait ${tpids[$v]} || tail -3 $OUT/tok-$v.log; done
family() {  # MODEL_DIR -> the vocab its family's tokenizer comes from
  python3 - "$1/config.json" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1])).get("model_type", "")
print("llama-bpe" if t == "llama" else "gemma-4" if t.startswith("gemma4")
      else "qwen2" if t.startswith(("qwen2", "qwen3")) else "")
EOF
}
dirs=()
for m in $MODELS; do
  case $m in /*|./*) d=$m ;; *) d=$W/models/$m ;; esac
  dirs+=($d)
  [ -d $d ] && continue
  name=$(basename $d); shape=${name%-bf16*}; extra=()
  [ "${name##*-}" = 32k ] && extra=(--context 32768)
  case $shape in llama*) v=llama-bpe ;; gemma4*) v=gemma-4 ;; *) v=qwen2 ;; esac
  stamp "making $name"
  rm -rf $d.part  # a model cut short by an earlier call's time limit
  timeout ${MAKE_TIMEOUT:-400} python3 $G/make_models.py $d.part $shape bfloat16 $LW/tok/$v \
    "${extra[@]}" > $OUT/make-$name.log 2>&1 && mv $d.part $d \
    || { tail -3 $OUT/make-$name.log; rm -rf $d.part; }
done

# 3. conversion to bf16 GGUF, one model after the other (the disk is the limit), while the
# build runs; a model the disk has no room for yet waits for step 4.
kib() { du -Lsk --exclude='tokenizer*' "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
free_kib() { df -Pk $GD | awk 'NR == 2 {print $4}'; }
names=" "; for d in "${dirs[@]}"; do names+="$(basename $d) "; done
benched=" "
room() {  # KIB: frees room for KIB KiB (and SPARE_MIB to spare) by deleting the GGUFs of
  # other calls' models and of this call's models already benchmarked, oldest first
  local g
  while [ $(free_kib) -lt $(( $1 + ${SPARE_MIB:-2048} * 1024 )) ]; do
    g=$(ls -tr $GD/*.gguf 2>/dev/null | while read -r f; do
          n=$(basename $f .gguf); n=${n%-*}
          case "$names" in *" $n "*) ;; *) echo $f; break ;; esac
          case "$benched" in *" $n "*) echo $f; break ;; esac
        done)
    [ -n "$g" ] || return 1
    echo "deleting $g for room"; rm -f $g
  done
}
convert() {  # MODEL_DIR NAME
  local d=$1 name=$2 v stage mtp=() gguf=$GD/$2-bf16.gguf need
  [ -s $gguf ] && { echo "kept $gguf"; return 0; }
  need=$(kib $d)
  room $need || { echo "$name: $((need >> 10)) MiB to write, $(( $(free_kib) >> 10 )) MiB free"; return 2; }
  v=$(family $d)
  stage=$LW/stage/$name; rm -rf $stage; mkdir -p $stage
  for f in $d/*; do
    case $(basename $f) in
      tokenizer*|special_tokens_map.json|*.jinja) [ -n "$v" ] || ln -s $f $stage/ ;;
      *) ln -s $f $stage/ ;;
    esac
  done
  [ -n "$v" ] && cp $LW/tok/$v/* $stage/
  grep -q '"model_type": "qwen3_5' $d/config.json && mtp=(--no-mtp)
  PYTHONPATH=$L/gguf-py python3 $L/convert_hf_to_gguf.py $stage --outtype bf16 \
    --outfile $gguf.part "${mtp[@]}" && mv $gguf.part $gguf || { rm -f $gguf.part; return 1; }
  return 0
}
convert_logged() {  # MODEL_DIR: convert, its log in $OUT/convert-NAME.log
  local n s rc; n=$(basename $1); s=$(date +%s)
  convert $1 $n >> $OUT/convert-$n.log 2>&1; rc=$?
  echo "rc=$rc $(( $(date +%s) - s )) s" >> $OUT/convert-$n.log
  echo "convert $n: $(tail -2 $OUT/convert-$n.log | tr '\n' ' ')"
  return $rc
}
for d in "${dirs[@]}"; do
  [ -d $d ] || { echo "$d: missing"; continue; }
  stamp "convert $(basename $d) to bf16 GGUF"
  convert_logged $d
done
stamp "waiting for the build"
wait $BUILD_PID; rc=$?
tail -3 $OUT/build.log
[ $rc -eq 0 ] || { stamp "build failed (rc=$rc)"; exit 1; }
[ -n "${PREPARE_ONLY:-}" ] && { stamp "prepared"; exit 0; }
B=$LW/build/bin

# 4. for each model: its bf16 GGUF (if step 3 had no room), quantized copies, the benchmarks.
maxpl=$(tr , '\n' <<< "$BATCHES" | sort -n | tail -1)
for d in "${dirs[@]}"; do
  [ -d $d ] || continue
  n=$(basename $d); bf=$GD/$n-bf16.gguf
  [ -s $bf ] || { stamp "convert $n to bf16 GGUF"; convert_logged $d || continue; }
  for q in bf16 $QUANTS; do
    g=$GD/$n-${q,,}.gguf; r=$OUT/$n-${q,,}
    if [ ! -s $g ]; then
      stamp "quantize $n to $q"
      room $(( $(kib $bf) * 11 / 20 )) || { echo "no room for $g"; continue; }
      $B/llama-quantize $bf $g.part $q $JOBS > $OUT/quantize-$n-$q.log 2>&1 \
        && mv $g.part $g || { rm -f $g.part; tail -3 $OUT/quantize-$n-$q.log; continue; }
    fi
    stamp "llama-bench $n $q"
    timeout ${BENCH_TIMEOUT:-300} $B/llama-bench -m $g -fa 1 -ngl 99 -r $REPS -o json \
      -p $PROMPTS -n 0 -b 2048 -ub $UBATCH ${LLAMA_BENCH_ARGS:-} > $r.prompt.json 2>> $r.err \
      || echo "llama-bench (prompts) rc=$?"
    timeout ${BENCH_TIMEOUT:-300} $B/llama-bench -m $g -fa 1 -ngl 99 -r $REPS -o json \
      -p 0 -n $GEN -d 0,$DEPTH ${LLAMA_BENCH_ARGS:-} > $r.decode.json 2>> $r.err \
      || echo "llama-bench (decode) rc=$?"
    python3 - $r.prompt.json $r.decode.json > $r.bench.json <<'EOF'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: no results ({e})", file=sys.stderr)
print(json.dumps(rows, indent=1))
EOF
    rm -f $r.prompt.json $r.decode.json
    stamp "llama-batched-bench $n $q"
    timeout ${BENCH_TIMEOUT:-300} $B/llama-batched-bench -m $g -fa on -ngl 99 \
      -c $(( maxpl * (BATCH_PROMPT + GEN) )) -b 2048 -ub 512 -npp $BATCH_PROMPT -ntg $GEN \
      -npl $BATCHES --output-format jsonl ${BATCHED_ARGS:-} > $r.batched.log 2>&1 \
      || echo "llama-batched-bench rc=$?"
    grep '^{' $r.batched.log > $r.batched.jsonl || tail -3 $r.batched.log
    [ $q = bf16 ] || [ -n "${KEEP_GGUF:-}" ] || rm -f $g  # quantized copies: remade if wanted
  done
  benched+="$n "
done
python3 $G/llamacpp_summary.py $OUT | tee $OUT/summary.md
stamp "done"
