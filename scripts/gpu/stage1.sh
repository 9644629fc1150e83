#!/usr/bin/env bash
# H200, first call (carry: carry/a). Keeps the first wheel half and the small files in
# /tmp/wick (the machine keeps /tmp while it stays warm: call stage2.sh right after),
# makes the random-weight models with transformers on the GPU, measures the ceilings.
set -uo pipefail
W=/tmp/wick
mkdir -p $W/models $OUT
cp -r carry/a/. $W/
{ nvidia-smi; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv;
  python3 --version; uname -a; nproc; free -g; df -h /tmp;
  SP=/opt/torch/.venv/lib/python3.12/site-packages/nvidia; ls $SP $SP/cu13/lib | head -80;
  ls /usr/local/cuda*/include/cuda_bf16.h 2>&1; which nvcc; } > $OUT/env.txt 2>&1
tar -C $W -xJf $W/tokenizer.tar.xz
TOK=$W/$(tar -tJf $W/tokenizer.tar.xz | head -1 | cut -d/ -f1)
python3 scripts/gpu/ceilings.py > $OUT/ceilings.json 2> $OUT/ceilings.err
cat $OUT/ceilings.json
cp $OUT/ceilings.json $W/
python3 scripts/gpu/make_models.py $W/models/llama3-8b-bf16 llama3-8b bfloat16 $TOK 2>&1 | tail -2
python3 scripts/gpu/make_models.py $W/models/qwen2.5-0.5b-bf16 qwen2.5-0.5b bfloat16 $TOK 2>&1 | tail -2
du -sh $W/models/* $W/*
