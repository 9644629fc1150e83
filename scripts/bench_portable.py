#!/usr/bin/env python3
"""Speed of two wick builds on this machine, measured alternately in one run: the default
(portable) build against one built with `RUSTFLAGS="-C target-cpu=native"`.

    cargo build --release -p wick
    RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=target-native cargo build --release -p wick
    python3 scripts/bench_portable.py --rounds 5

Each round runs, for every model, `A bench MODEL --runs 1 --json` and then the same with B,
each in a fresh process, the order of A and B swapped every round. The table shows both
builds' medians over rounds and the median of the per-round ratios A / B (a ratio of two
measurements taken seconds apart is steadier than a ratio of medians when the machine's
load drifts). Standard library only.
"""
import argparse
import json
import statistics
import subprocess
import sys


def bench(wick, model, prompt, gen):
    """One `wick bench` run: (prompt tok/s, decode tok/s)."""
    out = subprocess.run(
        [wick, "bench", model, "--runs", "1", "--json",
         "--prompt-tokens", str(prompt), "--gen-tokens", str(gen)],
        check=True, capture_output=True, text=True,
    ).stdout
    row = json.loads(out.strip().splitlines()[-1])
    return row["prompt_tps"], row["decode_tps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default="target/release/wick", help="the default build")
    ap.add_argument("--b", default="target-native/release/wick", help="the native build")
    ap.add_argument("--models", nargs="+", default=["default", "qwen2.5-coder"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    args = ap.parse_args()

    runs = {(m, side): [] for m in args.models for side in "ab"}
    for r in range(args.rounds):
        for model in args.models:
            order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
            for side in order:
                wick = args.a if side == "a" else args.b
                runs[(model, side)].append(bench(wick, model, args.prompt_tokens, args.gen_tokens))
            pa, pb = runs[(model, "a")][-1], runs[(model, "b")][-1]
            print(f"round {r + 1} {model}: prompt {pa[0]:.1f} / {pb[0]:.1f}, "
                  f"decode {pa[1]:.1f} / {pb[1]:.1f} tok/s", file=sys.stderr)

    med = statistics.median
    print(f"| model | prompt A / B (tok/s) | ratio | decode A / B (tok/s) | ratio |")
    print("|---|---|---:|---|---:|")
    for model in args.models:
        a, b = runs[(model, "a")], runs[(model, "b")]
        cells = []
        for i in (0, 1):
            ratio = med([x[i] / y[i] for x, y in zip(a, b)])
            cells.append(f"{med(x[i] for x in a):.1f} / {med(y[i] for y in b):.1f} | {ratio:.3f}")
        print(f"| {model} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
