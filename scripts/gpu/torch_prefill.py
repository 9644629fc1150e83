#!/usr/bin/env python3
"""PyTorch's prompt speed on a model directory: the reference for `wick bench` prompts.

Needs torch + transformers (PyTorch's venv on the GPU machine). Loads MODEL_DIR in bf16
with transformers' `sdpa` attention on the GPU and times one forward pass over prompts of
each length (the synthetic ids `wick bench --synthetic-prompt` feeds, logits of the last
row only), then `scaled_dot_product_attention` alone on one layer's shapes (causal, the
model's query and KV heads). One JSON line per measurement:

    torch_prefill.py MODEL_DIR [--lengths 512 2048 8192 16384] [--runs 3]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
import transformers


def timed(fn, runs):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    name = args.model.rstrip("/").split("/")[-1]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    for n in args.lengths:
        ids = torch.tensor([[100 + (7919 * i + 13) % 32000 for i in range(n)]], device="cuda")
        with torch.no_grad():
            s = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), args.runs)
        print(json.dumps({"impl": "torch-sdpa", "model_dir": name, "prompt_tokens": n,
                          "prompt_tps": n / s, "seconds": s}), flush=True)
    for n in args.lengths:
        q = torch.randn(1, heads, n, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, kv_heads, n, hd, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True), args.runs)
        flops = 2 * n * n * hd * heads  # causal: half of 4·n²·hd per head
        print(json.dumps({"impl": "torch-sdpa-attention", "model_dir": name, "prompt_tokens": n,
                          "heads": heads, "kv_heads": kv_heads, "head_dim": hd,
                          "ms_per_layer": 1e3 * s, "tflops": flops / s / 1e12}), flush=True)


if __name__ == "__main__":
    main()
