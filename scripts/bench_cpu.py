#!/usr/bin/env python3
"""wick's CPU engine against llama.cpp (llama-cpp-python) on the same models, same
thread count, measured interleaved in one run so machine load hits both alike.

Run with a python that has llama-cpp-python, e.g. the venv scripts/goldens/regen.sh makes:

    target/goldens/venv/bin/python scripts/bench_cpu.py --threads 2 --rounds 3

Long prompts, against an older build of wick too (`--no-llama` when llama.cpp is absent):

    python3 scripts/bench_cpu.py --models qwen2.5-coder-0.5b-q4_k_m \
        --prompt-tokens 512,4096,8192,16384 --baseline path/to/old/wick --rounds 2

Lengths run in the order given, each a fresh process per side, so the first length is the
reference the "pp vs first length" column divides by, measured in the same round.

Each round runs, for every model, `wick bench MODEL --runs 1 --json` (a fresh process;
it feeds the prompt as `wick serve` feeds a lone prompt: on the CPU in chunks of 2,048, of
512 before 2026-12-07) and then llama.cpp in a fresh process (`Llama(path, n_threads=T,
n_batch=512)`; the prompt is one `eval()` of N tokens, which llama.cpp runs in batches of
512; decode is G single-token `eval()`s on top of it).
Both see the same prompt text ("The quick brown fox jumps over the lazy dog. " repeated,
cut to N tokens). llama.cpp runs with flash attention off and on, the better of each figure kept.
The table shows medians over rounds and the median of the per-round
ratios wick / llama.cpp (a ratio of two measurements taken seconds apart is steadier
than a ratio of medians when the machine's load drifts).

Note: wick's decode figure includes its sampler and detokenizer (a real generation
loop); llama.cpp's is bare `llama_decode` calls, slightly in llama.cpp's favour.
"""
import argparse
import json
import os
import resource
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
flash = sys.argv[5] == "1"
m = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_batch=512,
          n_ctx=n + g + 16, flash_attn=flash, verbose=False)
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
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [binary, "bench", str(path), "--prompt-tokens", str(n), "--gen-tokens", str(g),
         "--runs", "1", "--json"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads(out.strip().splitlines()[-1])
    # CPU seconds of the whole process (load, prompt, decode): on a machine shared with
    # other jobs, steadier than wall-clock rates.
    res["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res


def run_llama(path, n, g, threads, flash):
    out = subprocess.run(
        [sys.executable, "-c", LLAMA_RUNNER, str(path), str(n), str(g), str(threads),
         str(int(flash))],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def best_llama(path, n, g, threads):
    """llama.cpp with flash attention off and on: the faster of each figure."""
    runs = [run_llama(path, n, g, threads, flash) for flash in (False, True)]
    return {f: max(r[f] for r in runs) for f in ("prompt_tps", "decode_tps")}


def have_llama():
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    return probe.returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wick", default="target/release/wick", help="wick binary")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated keys")
    ap.add_argument("--prompt-tokens", default="512",
                    help="comma-separated prompt lengths, e.g. 512,4096,8192,16384")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None,
                    help="another wick binary (e.g. a build of an older commit) measured in the "
                         "same rounds and shown as extra columns")
    ap.add_argument("--no-llama", action="store_true",
                    help="wick only (also when this python has no llama_cpp)")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = ap.parse_args()

    keys = args.models.split(",")
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    llama = not args.no_llama and have_llama()
    if not args.no_llama and not llama:
        print("llama_cpp is not importable: wick only", file=sys.stderr)
    sides = ["wick"] + (["base"] if args.baseline else []) + (["llama"] if llama else [])
    results = {(k, n): {s: [] for s in sides} for k in keys for n in lengths}
    for r in range(args.rounds):
        for k in keys:
            path = wick_home() / "models" / MODELS[k]
            if not path.is_file():
                sys.exit(f"{path} is missing: run `wick pull` for it")
            for n in lengths:
                got = {"wick": lambda: run_wick(args.wick, path, n, args.gen_tokens, args.threads),
                       "base": lambda: run_wick(args.baseline, path, n, args.gen_tokens,
                                                args.threads),
                       "llama": lambda: best_llama(path, n, args.gen_tokens, args.threads)}
                line = f"round {r + 1} {k} {n}:"
                for side in sides:
                    x = got[side]()
                    results[(k, n)][side].append(x)
                    line += (f" | {side} pp {x['prompt_tps']:.1f} tg {x['decode_tps']:.1f}"
                             + (f" cpu {x['cpu_s']:.1f}s" if "cpu_s" in x else ""))
                print(line, file=sys.stderr, flush=True)

    load = os.getloadavg()
    print(f"\nthreads {args.threads}, decode {args.gen_tokens} tokens after the prompt, "
          f"{args.rounds} interleaved rounds (medians; ratios are medians of per-round "
          f"ratios); load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"on {os.cpu_count()} CPUs\n")
    med = lambda xs, f: statistics.median(x[f] for x in xs)
    ratio = lambda a, b, f: statistics.median(x[f] / y[f] for x, y in zip(a, b))
    head = "| model | prompt | wick pp tok/s | pp vs wick at first length |"
    if args.baseline:
        head += " baseline pp | pp / baseline |"
    if llama:
        head += " llama.cpp pp | pp / llama.cpp |"
    head += " wick tg tok/s |"
    if args.baseline:
        head += " baseline tg | tg / baseline |"
    if llama:
        head += " llama.cpp tg | tg / llama.cpp |"
    print(head)
    print("|" + "---|" * 2 + "---:|" * (head.count("|") - 3))
    for k in keys:
        first = results[(k, lengths[0])]["wick"]
        for n in lengths:
            res = results[(k, n)]
            w = res["wick"]
            row = (f"| {k} | {n} | {med(w, 'prompt_tps'):.1f} | "
                   f"{ratio(w, first, 'prompt_tps'):.2f} |")
            if args.baseline:
                row += (f" {med(res['base'], 'prompt_tps'):.1f} | "
                        f"{ratio(w, res['base'], 'prompt_tps'):.2f}× |")
            if llama:
                row += (f" {med(res['llama'], 'prompt_tps'):.1f} | "
                        f"{ratio(w, res['llama'], 'prompt_tps'):.2f}× |")
            row += f" {med(w, 'decode_tps'):.1f} |"
            if args.baseline:
                row += (f" {med(res['base'], 'decode_tps'):.1f} | "
                        f"{ratio(w, res['base'], 'decode_tps'):.2f}× |")
            if llama:
                row += (f" {med(res['llama'], 'decode_tps'):.1f} | "
                        f"{ratio(w, res['llama'], 'decode_tps'):.2f}× |")
            print(row)
        if args.baseline:
            base_first = results[(k, lengths[0])]["base"]
            for n in lengths[1:]:
                print(f"\n{k}: baseline pp at {n} vs {lengths[0]}: "
                      f"{ratio(results[(k, n)]['base'], base_first, 'prompt_tps'):.2f}")
    print("\nCPU seconds of each wick process (load + prompt + decode), medians:\n")
    print("| model | prompt | wick CPU s |" + (" baseline CPU s | baseline / wick |"
                                              if args.baseline else ""))
    print("|---|---|---:|" + ("---:|---:|" if args.baseline else ""))
    for k in keys:
        for n in lengths:
            res = results[(k, n)]
            row = f"| {k} | {n} | {med(res['wick'], 'cpu_s'):.1f} |"
            if args.baseline:
                row += (f" {med(res['base'], 'cpu_s'):.1f} | "
                        f"{ratio(res['base'], res['wick'], 'cpu_s'):.2f}× |")
            print(row)
    if args.json:
        print(json.dumps({f"{k}:{n}": v for (k, n), v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
