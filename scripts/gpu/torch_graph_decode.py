#!/usr/bin/env python3
"""PyTorch reference for batch-1 greedy decode with the whole step captured in one CUDA
graph (the gpt-fast recipe: a static KV cache, fixed input buffers, the graph replayed per
token), on a model folder made by make_models.py. Prints one JSON line: eager and graph
decode tok/s after a PROMPT-token prompt.

    torch_graph_decode.py MODEL_DIR [--prompt 512] [--gen 128]
"""
import argparse
import json
import os
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    a = ap.parse_args()
    dev = "cuda"
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(dev).eval()
    max_len = a.prompt + a.gen + 8
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    ids = torch.randint(100, 1000, (1, a.prompt), device=dev)

    def prefill():
        cache.reset()
        pos = torch.arange(a.prompt, device=dev)
        out = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    tok = torch.zeros((1, 1), dtype=torch.long, device=dev)
    pos = torch.zeros((1,), dtype=torch.long, device=dev)

    def step():
        out = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    result = {"engine": "pytorch", "model_dir": os.path.basename(os.path.normpath(a.model)), "prompt_tokens": a.prompt, "gen_tokens": a.gen}
    with torch.inference_mode():
        # Eager, for the record.
        tok.copy_(prefill())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(a.gen):
            pos.fill_(a.prompt + i)
            tok.copy_(step())
        torch.cuda.synchronize()
        result["eager_decode_tps"] = a.gen / (time.perf_counter() - t)
        try:
            result["graph_decode_tps"] = graph_decode(a, prefill, step, tok, pos)
        except Exception as e:  # capture can fail on host syncs inside the model
            result["graph_error"] = repr(e)[:400]
    print(json.dumps(result), flush=True)


def graph_decode(a, prefill, step, tok, pos):
    """Captures one decode step in a CUDA graph (after warm-up on a side stream, as
    PyTorch asks) and replays it per token; the best of two timed runs."""
    tok.copy_(prefill())
    pos.fill_(a.prompt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    tok.copy_(prefill())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nxt = step()
    best = 0.0
    for _ in range(2):
        tok.copy_(prefill())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(a.gen):
            pos.fill_(a.prompt + i)
            graph.replay()
            tok.copy_(nxt)
        torch.cuda.synchronize()
        best = max(best, a.gen / (time.perf_counter() - t))
    return best


if __name__ == "__main__":
    main()
