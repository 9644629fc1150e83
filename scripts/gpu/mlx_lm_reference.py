#!/usr/bin/env python3
"""mlx-lm as the oracle: logits of every prompt position and greedy tokens.

    mlx_lm_reference.py MODEL_DIR OUT_PREFIX [--prompt-ids 1,2,3] [--steps N] [--cpu]

Writes OUT_PREFIX.safetensors (`logits`: float32 [prompt_len, vocab]) and
OUT_PREFIX.json ({"prompt_ids", "greedy", "mlx", "mlx_lm", "device"}). The greedy tokens
come from mlx-lm's own generate_step with an argmax sampler.
"""
import argparse
import json

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompt-ids", default=None)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    if args.cpu:
        mx.set_default_device(mx.cpu)
    model, tokenizer = mlx_lm.load(args.model)
    if args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.split(",")]
    else:
        ids = tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=False)
    prompt = mx.array(ids)
    logits = model(prompt[None])[0].astype(mx.float32)
    mx.eval(logits)
    greedy = []
    for token, _ in generate_step(prompt, model, max_tokens=args.steps,
                                  sampler=lambda x: mx.argmax(x, axis=-1)):
        greedy.append(int(token))
    mx.save_safetensors(args.out + ".safetensors", {"logits": logits})
    info = {
        "prompt_ids": ids,
        "greedy": greedy,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device()),
    }
    with open(args.out + ".json", "w") as f:
        json.dump(info, f)
    print(f"{args.out}: {len(ids)} prompt tokens, greedy {greedy[:8]}...", flush=True)


if __name__ == "__main__":
    main()
