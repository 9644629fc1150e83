#!/usr/bin/env python3
"""mlx-lm's speed on the same cases as `wick bench --case P:G:B --synthetic-prompt`.

    mlx_lm_bench.py MODEL_DIR --case 512:128:1 --case 128:128:8 ... [--runs 2] [--warmup 1]

Uses mlx-lm's own generation loops as `mlx_lm.benchmark` does (stream_generate for
batch 1, batch_generate above, with all B sequences in one decode batch where
`mlx_lm.benchmark` would cap it at 32; prefill step 2048; end-of-sequence ignored) with the
synthetic prompt ids wick uses, and prints one JSON line per case with mlx-lm's own
prompt_tps / generation_tps (mean of the timed runs).
"""
import argparse
import json
import time

import mlx.core as mx
import mlx_lm
from mlx_lm import batch_generate, stream_generate


def synthetic_ids(n):
    return [100 + ((7919 * i + 13) % 32000) for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tokenizer = mlx_lm.load(args.model)
    load_s = time.perf_counter() - t0
    tokenizer._eos_token_ids = {}
    for case in args.case:
        p, g, b = (int(x) for x in case.split(":"))
        prompt = synthetic_ids(p)
        prompts = [prompt] * b

        def once():
            if b == 1:
                for r in stream_generate(model, tokenizer, prompt, max_tokens=g,
                                         prefill_step_size=args.prefill_step_size):
                    pass
                return r.prompt_tps, r.generation_tps
            # All b sequences decode together (mlx-lm's defaults cap a batch at 32).
            stats = batch_generate(model, tokenizer, prompts, max_tokens=g,
                                   prefill_step_size=args.prefill_step_size,
                                   completion_batch_size=b, prefill_batch_size=b).stats
            return stats.prompt_tps, stats.generation_tps

        for _ in range(args.warmup):
            once()
        pp, tg = [], []
        for _ in range(args.runs):
            a, c = once()
            pp.append(a)
            tg.append(c)
        print(json.dumps({
            "engine": "mlx-lm", "model": args.model, "prompt_tokens": p, "gen_tokens": g,
            "batch": b, "prompt_tps": sum(pp) / len(pp), "decode_tps": sum(tg) / len(tg),
            "runs": args.runs, "warmup": args.warmup, "load_seconds": load_s,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
