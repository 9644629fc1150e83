#!/usr/bin/env python3
"""Time to first token of long prompts through a running `wick serve` (streaming).

Standard library plus transformers' tokenizer (to size the prompts): builds prompts of
about `--tokens` tokens with MODEL_DIR's tokenizer (each a different text, so no prompt
cache can serve one from another), sends each as a streaming `/v1/completions` request
with one token out after a short warm-up request, and prints one JSON line per request:
the prompt's tokens, the client's time to its first streamed token, and the server's own
`wick_time_to_first_token_seconds` for that request (from `/metrics`).

    ttft.py --url http://127.0.0.1:8411 --model MODEL_DIR --tokens 18682 --repeat 2
"""
import argparse
import json
import re
import time
import urllib.request

import transformers


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    m = re.search(r"^" + name + r" ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def first_token(url, prompt):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if first is None and line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices"):
                    first = time.perf_counter() - t0
    return first


def prompt_of(tok, tokens, seed):
    words = [f"w{(seed * 7919 + i * 104729) % 100003}" for i in range(64)]
    unit = " ".join(words) + ". "
    n_unit = len(tok(unit)["input_ids"])
    text = unit * max(1, tokens // n_unit)
    while len(tok(text)["input_ids"]) < tokens:
        text += words[len(text) % 64] + " "
    return text, len(tok(text)["input_ids"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", required=True, help="model directory (its tokenizer)")
    ap.add_argument("--tokens", type=int, default=18682)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=2048)
    args = ap.parse_args()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    warm, _ = prompt_of(tok, args.warmup_tokens, 0)
    first_token(args.url, warm)
    for r in range(args.repeat):
        text, n = prompt_of(tok, args.tokens, r + 1)
        s0 = metric(args.url, "wick_time_to_first_token_seconds_sum")
        c0 = metric(args.url, "wick_time_to_first_token_seconds_count")
        t = first_token(args.url, text)
        s1 = metric(args.url, "wick_time_to_first_token_seconds_sum")
        c1 = metric(args.url, "wick_time_to_first_token_seconds_count")
        server = (s1 - s0) / (c1 - c0) if None not in (s0, s1, c0, c1) and c1 > c0 else None
        print(json.dumps({"prompt_tokens": n, "ttft_s": t, "server_ttft_s": server}), flush=True)


if __name__ == "__main__":
    main()
