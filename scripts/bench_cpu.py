#!/usr/bin/env python3
"""wick's CPU engine against llama.cpp (llama-cpp-python) on the same models, same
thread count, measured interleaved in one run so machine load hits both alike.

Run with a python that has llama-cpp-python, e.g. the venv scripts/goldens/regen.sh makes:

    target/goldens/venv/bin/python scripts/bench_cpu.py --threads 2 --rounds 3

Each round runs, for every model, `wick bench MODEL --runs 1 --json` (a fresh process)
and then llama.cpp in a fresh process (`Llama(path, n_threads=T, n_batch=512)`; the
prompt is one `eval()` of N tokens, decode is G single-token `eval()`s on top of it).
Both see the same prompt text ("The quick brown fox jumps over the lazy dog. " repeated,
cut to N tokens). The table shows medians over rounds and the median of the per-round
ratios wick / llama.cpp (a ratio of two measurements taken seconds apart is steadier
than a ratio of medians when the machine's load drifts).

Note: wick's decode figure includes its sampler and detokenizer (a real generation
loop); llama.cpp's is bare `llama_decode` calls, slightly in llama.cpp's favour.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODELS = {
    "smollm2-135m-q4_1": "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-q4_k_m": "qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}

LLAMA_RUNNER = r"""
import json, sys, time
from llama_cpp import Llama
path, n, g, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_batch=512,
          n_ctx=n + g + 16, verbose=False)
text = "The quick brown fox jumps over the lazy dog. " * (n // 8 + 8)
toks = m.tokenize(text.encode())[:n]
m.reset()
t = time.perf_counter(); m.eval(toks); pp = time.perf_counter() - t
t = time.perf_counter()
for i in range(g):
    m.eval([toks[i % len(toks)]])
tg = time.perf_counter() - t
print(json.dumps({"prompt_tps": n / pp, "decode_tps": g / tg}))
"""


def wick_home() -> Path:
    return Path(os.environ.get("WICK_HOME", Path.home() / ".cache/wick"))


def run_wick(binary, path, n, g, threads):
    env = dict(os.environ, WICK_THREADS=str(threads), RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(
        [binary, "bench", str(path), "--prompt-tokens", str(n), "--gen-tokens", str(g),
         "--runs", "1", "--json"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_llama(path, n, g, threads):
    out = subprocess.run(
        [sys.executable, "-c", LLAMA_RUNNER, str(path), str(n), str(g), str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wick", default="target/release/wick", help="wick binary")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated keys")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None,
                    help="another wick binary (e.g. a build of an older commit) measured in the "
                         "same rounds and shown as extra columns")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = ap.parse_args()

    keys = args.models.split(",")
    results = {k: {"wick": [], "llama": [], "base": []} for k in keys}
    for r in range(args.rounds):
        for k in keys:
            path = wick_home() / "models" / MODELS[k]
            if not path.is_file():
                sys.exit(f"{path} is missing: run `wick pull` for it")
            w = run_wick(args.wick, path, args.prompt_tokens, args.gen_tokens, args.threads)
            l = run_llama(path, args.prompt_tokens, args.gen_tokens, args.threads)
            results[k]["wick"].append(w)
            results[k]["llama"].append(l)
            line = (f"round {r + 1} {k}: wick pp {w['prompt_tps']:.1f} tg {w['decode_tps']:.1f} | "
                    f"llama.cpp pp {l['prompt_tps']:.1f} tg {l['decode_tps']:.1f}")
            if args.baseline:
                b = run_wick(args.baseline, path, args.prompt_tokens, args.gen_tokens, args.threads)
                results[k]["base"].append(b)
                line += f" | baseline pp {b['prompt_tps']:.1f} tg {b['decode_tps']:.1f}"
            print(line, file=sys.stderr)

    load = os.getloadavg()
    print(f"\nthreads {args.threads}, prompt {args.prompt_tokens} tokens, decode "
          f"{args.gen_tokens} tokens, {args.rounds} interleaved rounds (medians); "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"on {os.cpu_count()} CPUs\n")
    print("| model | wick pp tok/s | llama.cpp pp tok/s | pp ratio | wick tg tok/s | "
          "llama.cpp tg tok/s | tg ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in keys:
        w, l = results[k]["wick"], results[k]["llama"]
        med = lambda xs, f: statistics.median(x[f] for x in xs)
        ratio = lambda f: statistics.median(a[f] / b[f] for a, b in zip(w, l))
        print(f"| {k} | {med(w, 'prompt_tps'):.1f} | {med(l, 'prompt_tps'):.1f} | "
              f"{ratio('prompt_tps'):.2f}× | {med(w, 'decode_tps'):.1f} | "
              f"{med(l, 'decode_tps'):.1f} | {ratio('decode_tps'):.2f}× |")
    if args.baseline:
        print("\n| model | baseline pp tok/s | baseline tg tok/s | wick / baseline pp | "
              "wick / baseline tg |")
        print("|---|---:|---:|---:|---:|")
        for k in keys:
            w, b = results[k]["wick"], results[k]["base"]
            med = lambda xs, f: statistics.median(x[f] for x in xs)
            ratio = lambda f: statistics.median(a[f] / c[f] for a, c in zip(w, b))
            print(f"| {k} | {med(b, 'prompt_tps'):.1f} | {med(b, 'decode_tps'):.1f} | "
                  f"{ratio('prompt_tps'):.2f}× | {ratio('decode_tps'):.2f}× |")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
