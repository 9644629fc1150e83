#!/usr/bin/env python3
"""Summarizes a `scripts/gpu/prefill.sh` call: OUT/bench.jsonl (`wick bench`, tagged with
the flash mode and prefill chunk), OUT/torch.jsonl (torch_prefill.py) and OUT/ttft.jsonl
(ttft.py) into OUT/summary.json and OUT/summary.md (prompt tok/s by length; ratios to
PyTorch and to wick without flash attention, all from the same call).

    prefill_summary.py OUT
"""
import json
import os
import sys


def lines(path):
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def main():
    out = sys.argv[1]
    bench = lines(os.path.join(out, "bench.jsonl"))
    torch = lines(os.path.join(out, "torch.jsonl"))
    ttft = lines(os.path.join(out, "ttft.jsonl"))
    rows = {}
    for b in bench:
        key = f"wick {b.get('flash', '?')} kv {b.get('kv_type', '?')} chunk {b.get('chunk_arg', '?')}"
        rows.setdefault(key, {})[b["prompt_tokens"]] = b["prompt_tps"]
    for t in torch:
        if t.get("impl") == "torch-sdpa":
            rows.setdefault("torch sdpa", {})[t["prompt_tokens"]] = t["prompt_tps"]
    lengths = sorted({n for r in rows.values() for n in r})
    base = {k: v for k, v in rows.items() if k.startswith("wick off")}
    base = next(iter(base.values()), {})
    ref = rows.get("torch sdpa", {})
    md = ["| prompt tok/s | " + " | ".join(f"{n:,}" for n in lengths) + " |",
          "|---|" + "---|" * len(lengths)]
    for key, r in rows.items():
        cells = []
        for n in lengths:
            v = r.get(n)
            if v is None:
                cells.append("–")
                continue
            extra = []
            if ref.get(n) and not key.startswith("torch"):
                extra.append(f"{v / ref[n]:.2f}× torch")
            if base.get(n) and key.startswith("wick") and not key.startswith("wick off"):
                extra.append(f"{v / base[n]:.1f}× off")
            cells.append(f"{v / 1e3:.1f}k" + (f" ({', '.join(extra)})" if extra else ""))
        md.append(f"| {key} | " + " | ".join(cells) + " |")
    attn = [t for t in torch if t.get("impl") == "torch-sdpa-attention"]
    if attn:
        md += ["", "PyTorch sdpa attention alone (one layer): " + ", ".join(
            f"{a['prompt_tokens']:,}: {a['ms_per_layer']:.2f} ms ({a['tflops']:.0f} TFLOP/s)"
            for a in attn)]
    for t in ttft:
        label = f" ({t['label']})" if t.get("label") else ""
        server = t.get("server_ttft_s")
        server = f", {server:.2f} s in the server" if server is not None else ""
        streams = ""
        if t.get("streams"):
            streams = (f"; beside {t['streams']} decoding streams, whose gap went from "
                       f"{t['idle_itl_s'] * 1e3:.1f} ms (idle) to at most "
                       f"{t['max_itl_s'] * 1e3:.1f} ms ({t['max_itl_over_idle']:.2f}×, p95 "
                       f"{t['p95_itl_s'] * 1e3:.1f} ms)")
        md.append(f"\nServer TTFT, {t['prompt_tokens']:,}-token prompt{label}: "
                  f"{t['ttft_s']:.2f} s at the client{server}{streams}")
    summary = {"prompt_tps": {k: {str(n): v for n, v in r.items()} for k, r in rows.items()},
               "attention": attn, "ttft": ttft}
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
