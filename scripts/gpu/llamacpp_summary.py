#!/usr/bin/env python3
"""One markdown table of llamacpp.sh's results: for each model and weight type, llama-bench's
prompt speed at each prompt length (the best ubatch, named), its decode speed from an empty
cache and after DEPTH tokens, and llama-batched-bench's decode speed of 1..N streams.

    llamacpp_summary.py OUT_DIR     (reads OUT_DIR/*.bench.json and *.batched.jsonl)
"""
import glob
import json
import os
import sys


def tok_s(x):
    return f"{x / 1000:.1f}k" if x >= 10000 else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def read(path, lines):
    """The results in PATH (a JSON array, or one JSON object a line); none if it is missing
    or cut short (a crashed run)."""
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()] if lines else json.load(f)
    except FileNotFoundError:
        return []
    except ValueError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return []


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    runs = sorted({os.path.basename(p).rsplit(".", 2)[0]
                   for p in glob.glob(os.path.join(out, "*.bench.json"))
                   + glob.glob(os.path.join(out, "*.batched.jsonl"))})
    if not runs:
        sys.exit(f"{out}: no llama-bench results")
    rows, prompts, depths, streams = [], set(), set(), set()
    for run in runs:
        pp, tg, bt, gpu = {}, {}, {}, ""
        for r in read(os.path.join(out, run + ".bench.json"), lines=False):
            gpu = r.get("gpu_info", gpu)
            if r["n_prompt"] > 0 and r["n_gen"] == 0:
                best = pp.get(r["n_prompt"])
                if best is None or r["avg_ts"] > best[0]:
                    pp[r["n_prompt"]] = (r["avg_ts"], r["n_ubatch"])
            elif r["n_gen"] > 0 and r["n_prompt"] == 0:
                tg[r["n_depth"]] = r["avg_ts"]
        for r in read(os.path.join(out, run + ".batched.jsonl"), lines=True):
            bt[r["pl"]] = r["speed_tg"]
        prompts |= pp.keys()
        depths |= tg.keys()
        streams |= bt.keys()
        rows.append((run, pp, tg, bt, gpu))
    prompts, depths, streams = sorted(prompts), sorted(depths), sorted(streams)
    head = (["model-type"] + [f"prompt {p} (ub)" for p in prompts]
            + [f"decode @{d}" for d in depths] + [f"{b} streams" for b in streams])
    print(f"llama.cpp, tok/s ({rows[0][4] or 'no GPU named'}):\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for run, pp, tg, bt, _ in rows:
        cells = [run.replace("-bf16-", "-", 1)]  # qwen3.5-4b-bf16-q8_0: qwen3.5-4b-q8_0
        cells += [f"{tok_s(pp[p][0])} ({pp[p][1]})" if p in pp else "-" for p in prompts]
        cells += [tok_s(tg[d]) if d in tg else "-" for d in depths]
        cells += [tok_s(bt[b]) if b in bt else "-" for b in streams]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
