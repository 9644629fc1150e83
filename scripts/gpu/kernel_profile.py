#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of a greedy decode run (`ncu --csv --metrics
gpu__time_duration.sum …`, see profile.sh): kernels are cut into steps at each argmax
kernel (the last kernel of a step: MLX's arg_reduce, wick's CUDA argmax_rows), and for the decode steps (all but the first, the
prefill) prints kernels per step, GPU time per step, and the kernels that take it. With
`--prompt` it prints the same for the first step, the prompt's pass, instead."""
import collections
import csv
import json
import statistics
import sys


def rows(path):
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own log lines are not CSV
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(r.get("Metric Unit"), 1e-3)
        yield r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale


def main(path, label, prompt=False):
    kernels = list(rows(path))
    steps, cur = [], []
    for name, us in kernels:
        cur.append((name, us))
        n = name.lower()
        # MLX's argmax is an "arg_reduce" kernel, the CUDA backend's `argmax_rows`.
        if ("arg" in n and "reduce" in n) or n.startswith("argmax_rows"):
            steps.append(cur)
            cur = []
    decode = steps[:1] if prompt else steps[1:]  # the first step holds the prompt
    if not decode:
        print(json.dumps({"label": label, "kernels": len(kernels), "error": "no argmax steps found"}))
        return
    per_step_us = [sum(us for _, us in s) for s in decode]
    per_step_n = [len(s) for s in decode]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for s in decode:
        for name, us in s:
            short = name.split("(")[0][:90]
            by_name[short][0] += 1
            by_name[short][1] += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    n = len(decode)
    print(json.dumps({
        "label": label,
        "decode_steps": n,
        "kernels_per_step": statistics.median(per_step_n),
        "gpu_us_per_step_median": statistics.median(per_step_us),
        "top": [{"kernel": k, "per_step": c / n, "us_per_step": round(t / n, 1)} for k, (c, t) in top],
    }, indent=1))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--prompt"]
    main(args[0], args[1] if len(args) > 1 else args[0], prompt="--prompt" in sys.argv)
