#!/usr/bin/env python3
"""Turns one H200 run's files into the table of docs/lab/gpu-mlx.md ("Results").

    summarize.py RUN_DIR      (RUN_DIR holds bench.jsonl, ceilings.json, facts.jsonl)

Each figure is shown with mlx-lm's from the same run and as a fraction of its limit:
decode: bytes a token must read (weights once + KV cache at the mean context) over the
measured copy bandwidth; prefill: FLOPs per token (2 per parameter + attention) over the
measured bf16 matmul rate; batched decode: the lower of the two.
"""
import json
import os
import sys


def load(run):
    rows = [json.loads(l) for l in open(os.path.join(run, "bench.jsonl")) if l.startswith("{")]
    ceil = json.load(open(os.path.join(run, "ceilings.json")))
    facts = {}
    for l in open(os.path.join(run, "facts.jsonl")):
        if l.startswith("{"):
            f = json.loads(l)
            facts[f["name"]] = f
    return rows, ceil, facts


def limit(f, ceil, p, g, b, kind):
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_matmul_flops"]
    ctx = p + g / 2
    if kind == "prefill":
        flops = 2 * f["body_params"] + 2 * 2 * f["layers"] * (p / 2) * f["heads"] * f["head_dim"]
        return rate / flops
    step_bytes = f["decode_bytes"] + b * ctx * f["kv_bytes_per_token"]
    flops = 2 * (f["body_params"] + f["head_params"]) + 4 * f["layers"] * ctx * f["heads"] * f["head_dim"]
    return min(b * bw / step_bytes, rate / flops)


def main():
    run = sys.argv[1]
    rows, ceil, facts = load(run)
    print(f"Ceilings measured in this run: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s "
          f"(read + write), bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s "
          f"({ceil.get('device', '')}).\n")
    print("| model | measure | wick (MLX backend) | mlx-lm | wick / mlx-lm | wick / limit | limit |")
    print("|---|---|---|---|---|---|---|")
    for m in dict.fromkeys(r["model_dir"] for r in rows):
        f = facts.get(m)
        for r in rows:
            if r.get("model_dir") != m or r.get("engine") != "wick" or r.get("variant") != "default":
                continue
            p, g, b = r["prompt_tokens"], r["gen_tokens"], r["batch"]
            ref = next((x for x in rows if x.get("engine") == "mlx-lm" and x["model_dir"] == m
                        and (x["prompt_tokens"], x["gen_tokens"], x["batch"]) == (p, g, b)), None)
            measures = []
            if b == 1 and g >= 64:
                measures.append(("decode", f"decode b=1 (prompt {p})", "decode_tps"))
            if b == 1:
                measures.append(("prefill", f"prefill {p}", "prompt_tps"))
            if b > 1:
                measures.append(("decode", f"decode b={b} (prompt {p}, {g} new)", "decode_tps"))
            for kind, label, key in measures:
                ours = r[key]
                theirs = ref[key] if ref else None
                lim = limit(f, ceil, p, g, b, kind) if f else None
                print(f"| {m} | {label} | {ours:,.0f} tok/s | "
                      f"{f'{theirs:,.0f} tok/s' if theirs else '—'} | "
                      f"{f'{ours / theirs:.2f}×' if theirs else '—'} | "
                      f"{f'{ours / lim:.0%}' if lim else '—'} | "
                      f"{f'{lim:,.0f} tok/s' if lim else '—'} |")
    variants = [r for r in rows if r.get("engine") == "wick" and r.get("variant") != "default"]
    if variants:
        print("\nwick variants (batch-1 decode, prompt 512):\n")
        print("| model | settings | decode tok/s |")
        print("|---|---|---|")
        for r in variants:
            if r["batch"] == 1:
                print(f"| {r['model_dir']} | {r['variant']} | {r['decode_tps']:,.1f} |")


if __name__ == "__main__":
    main()
