#!/usr/bin/env bash
# GPU: prompt and decode speed of two builds and settings in the same minutes (issues 46,
# 47). For each round of ROUNDS, each variant of VARIANTS ("label=binary[,VAR=value...]"
# separated by spaces; binaries under $W, carried as carry/cuda/<binary>.xz) runs `wick
# bench` on MODEL (a folder under $W/models): prompts of LENGTHS tokens (one pass each),
# or the `wick bench --case` cases of CASES (prompt:gen:batch) where that is set. Results:
# $OUT/ab.jsonl (one line per case, with "variant" and "round") and tables on stdout (the
# best round of each).
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
cases=()
if [ -n "${CASES:-}" ]; then
  for c in $CASES; do cases+=(--case $c); done
else
  for n in ${LENGTHS:-512 2048 8192 16384}; do cases+=(--case $n:1:1); done
fi
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
    case = (r.get("prompt_tokens", 0), r.get("gen_tokens", 1), r.get("batch", 1))
    for what in ("prompt_tps", "decode_tps"):
        if what == "decode_tps" and case[1] < 2:
            continue  # one generated token is no decode figure
        key = (what, case, r["variant"])
        best[key] = max(best[key], r.get(what) or 0.0)
variants = list(dict.fromkeys(k[2] for k in best))
for what in ("prompt_tps", "decode_tps"):
    cases = sorted({k[1] for k in best if k[0] == what})
    if not cases:
        continue
    print(f"\n{what} (prompt:gen:batch)")
    print("| case | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for c in cases:
        cells = " | ".join(f"{best[(what, c, v)]:.1f}" for v in variants)
        print(f"| {c[0]}:{c[1]}:{c[2]} | {cells} |")
PY
