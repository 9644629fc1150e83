#!/usr/bin/env bash
# Prompt processing on an AMX machine from a prebuilt wick binary: thread scaling (prompt
# tok/s at each thread count against the first), and AMX against the AVX-512 kernels of the
# same binary (`WICK_ISA=avx512`), in interleaved rounds. Needs no Rust toolchain and no
# network: the binary, a GGUF model given by path, python3 for the summary.
#
#   scripts/bench/amx_threads.sh WICK MODEL.gguf
#
# Environment:
#   THREADS="2 16"       thread counts (the first is the reference of the scaling column)
#   PROMPTS="512 8192"   prompt lengths (each one `wick bench --case N:GEN:1` in a loaded model)
#   GEN=16               decode tokens after each prompt
#   ROUNDS=3             interleaved rounds (medians are reported)
#   ISAS="amx avx512"    kernel families (WICK_ISA) measured in each round
#   TESTS="BIN[:FILTER] ..."  prebuilt test binaries to run first (only the tests whose
#                        names contain FILTER), e.g. the paths `cargo test --release -p
#                        wick-kernels --test equivalence --no-run` and `cargo test --release
#                        -p wick-engine --lib --no-run` print:
#                        TESTS="equivalence-HASH wick_engine-HASH:prefill" (the AMX tests
#                        say "skipped" and why where AMX is absent)
#   PYTHON=python3       a python 3 for the summary (the PyTorch venv's works)
#   OUT=amx-threads      where the raw JSON lines and the summary go
set -euo pipefail
wick=${1:?usage: amx_threads.sh WICK MODEL.gguf}
model=${2:?usage: amx_threads.sh WICK MODEL.gguf}
threads=${THREADS:-2 16}
prompts=${PROMPTS:-512 8192}
gen=${GEN:-16}
rounds=${ROUNDS:-3}
isas=${ISAS:-amx avx512}
out=${OUT:-amx-threads}
python=${PYTHON:-python3}
command -v "$python" >/dev/null || python=/opt/torch/.venv/bin/python
mkdir -p "$out"
raw="$out/runs.jsonl"
: >"$raw"

{
  echo "host: $(uname -n), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "AMX flags: $(grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | xargs)"
  echo "wick: $("$wick" --version)"
  echo "model: $model"
  echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out/summary.txt"

for spec in ${TESTS:-}; do
  bin=${spec%%:*}
  filter=""
  [ "$bin" != "$spec" ] && filter=${spec#*:}
  echo "== $bin $filter" | tee -a "$out/summary.txt"
  { "$bin" $filter --nocapture 2>&1 && echo "tests passed" || echo "TESTS FAILED"; } |
    tail -n 40 | tee -a "$out/summary.txt"
done

cases=()
for p in $prompts; do cases+=(--case "$p:$gen:1"); done
for r in $(seq 1 "$rounds"); do
  for t in $threads; do
    for isa in $isas; do
      WICK_THREADS=$t WICK_ISA=$isa "$wick" bench "$model" "${cases[@]}" --runs 1 --json 2>/dev/null |
        grep '^{' | sed "s/^{/{\"round\":$r,\"isa\":\"$isa\",\"pool_threads\":$t,/" | tee -a "$raw"
    done
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/summary.txt"

"$python" - "$raw" "$threads" <<'EOF' | tee -a "$out/summary.txt"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
threads = [int(t) for t in sys.argv[2].split()]
def med(isa, t, p, f):
    # `wick bench` reports the CPU count as "threads"; the pool size is what was set.
    xs = [r[f] for r in runs if r["isa"] == isa and r["pool_threads"] == t and r["prompt_tokens"] == p]
    return statistics.median(xs) if xs else float("nan")
isas = sorted({r["isa"] for r in runs}, key=lambda i: i != "amx")
prompts = sorted({r["prompt_tokens"] for r in runs})
print("\n| kernels | prompt | threads | prompt tok/s | vs %d threads | decode tok/s | vs avx512 (prompt) |" % threads[0])
print("|---|---:|---:|---:|---:|---:|---:|")
for isa in isas:
    for p in prompts:
        for t in threads:
            pp = med(isa, t, p, "prompt_tps")
            print(f"| {isa} | {p} | {t} | {pp:.1f} | {pp / med(isa, threads[0], p, 'prompt_tps'):.2f}x | "
                  f"{med(isa, t, p, 'decode_tps'):.1f} | {pp / med('avx512', t, p, 'prompt_tps'):.2f}x |")
EOF
echo "raw runs: $raw; summary: $out/summary.txt"
