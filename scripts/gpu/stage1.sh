#!/usr/bin/env bash
# H200, first call (carry: carry/a). Keeps the first runtime part and the small files in
# /tmp/wick (the machine keeps /tmp while it stays warm: copy the middle part folders there
# next, one call each, then call stage2.sh or another script with the last folder),
# makes the random-weight models with transformers on the GPU, measures the ceilings.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder (scripts/gpu or a carried copy)
W=${WICK_GPU_DIR:-/tmp/wick}  # scratch folder on the GPU machine
mkdir -p $W/models $OUT
cp -r carry/a/. $W/
{ nvidia-smi; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv;
  python3 --version; uname -a; nproc; free -g; df -h /tmp;
  SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}; ls $SP $SP/cu13/lib | head -80;
  ls /usr/local/cuda*/include/cuda_bf16.h 2>&1; which nvcc; } > $OUT/env.txt 2>&1
tar -C $W -xJf $W/tokenizer.tar.xz
TOK=$W/$(tar -tJf $W/tokenizer.tar.xz | head -1 | cut -d/ -f1)
if [ -z "${SKIP_CEILINGS:-}" ]; then
  timeout 120 python3 $G/ceilings.py > $OUT/ceilings.json 2> $OUT/ceilings.err
  cat $OUT/ceilings.json
  cp $OUT/ceilings.json $W/
fi
# MAKE: SHAPE:DTYPE[:VOCAB]; the folder is SHAPE-bf16 / -f16 / -f32, with -vVOCAB when
# the vocabulary is not the shape's (the tokenizer's ids must fit it to serve chat).
for sd in ${MAKE:-llama3-8b:bfloat16 qwen2.5-0.5b:bfloat16}; do
  IFS=: read -r shape dtype vocab <<< "$sd"
  case $dtype in bfloat16) tag=bf16 ;; float16) tag=f16 ;; *) tag=f32 ;; esac
  dir=$W/models/$shape-$tag${vocab:+-v$vocab}
  timeout 300 python3 $G/make_models.py $dir $shape $dtype $TOK ${vocab:+--vocab $vocab} 2>&1 | tail -1
done
du -sh $W/models/* $W/*
