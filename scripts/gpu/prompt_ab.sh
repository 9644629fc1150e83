#!/usr/bin/env bash
# GPU: prompt speed of two builds and settings in the same minutes (issue 47). For each
# round of ROUNDS, each variant of VARIANTS ("label=binary[,VAR=value...]" separated by
# spaces; binaries under $W, carried as carry/cuda/<binary>.xz) runs `wick bench` at
# LENGTHS (one pass per prompt) on MODEL (a folder under $W/models). Results:
# $OUT/ab.jsonl (one line per case, with "variant" and "round") and a table on stdout.
set -uo pipefail
G=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=${WICK_GPU_DIR:-/tmp/wick}
mkdir -p $OUT
SP=${TORCH_NVIDIA_DIR:-$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')}
export LD_LIBRARY_PATH=$SP/cu13/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export WICK_HOME=$W
for x in carry/cuda/*.xz; do
  f=$(basename $x .xz)
  [ -f $W/$f ] || { xz -dc $x > $W/$f && chmod +x $W/$f; }
done
M=$W/models/${MODEL:-llama3-8b-bf16-32k}
cases=(); for n in ${LENGTHS:-512 2048 8192 16384}; do cases+=(--case $n:1:1); done
for round in $(seq 1 ${ROUNDS:-2}); do
  for v in ${VARIANTS:-prev=wick_prev new=wick}; do
    label=${v%%=*}; rest=${v#*=}; bin=${rest%%,*}
    envs=(); [ "$rest" != "$bin" ] && IFS=',' read -ra envs <<< "${rest#*,}"
    env "${envs[@]}" timeout ${BENCH_TIMEOUT:-150} $W/$bin bench $M --backend cuda \
      --kv-type ${KV:-f32} --synthetic-prompt --prefill-chunk 0 --json --warmup 1 --runs 1 \
      "${cases[@]}" 2>>$OUT/ab.err \
      | sed -u "s/^{/{\"variant\":\"$label\",\"round\":$round,/" >> $OUT/ab.jsonl
  done
done
python3 - $OUT/ab.jsonl <<'PY'
import collections, json, sys
best = collections.defaultdict(float)
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    key = (r["variant"], r.get("prompt_tokens", "?"))
    best[key] = max(best[key], r.get("prompt_tps") or 0.0)
variants = list(dict.fromkeys(k[0] for k in best))
lengths = sorted({k[1] for k in best}, key=lambda x: (isinstance(x, str), x))
print("| prompt tokens | " + " | ".join(variants) + " |")
print("|---|" + "---:|" * len(variants))
for n in lengths:
    print(f"| {n} | " + " | ".join(f"{best[(v, n)]:.0f}" for v in variants) + " |")
PY
