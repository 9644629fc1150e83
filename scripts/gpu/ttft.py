#!/usr/bin/env python3
"""Time to first token of long prompts through a running `wick serve` (streaming).

Standard library plus transformers' tokenizer (to size the prompts): builds prompts of
about `--tokens` tokens with MODEL_DIR's tokenizer (each a different text, so no prompt
cache can serve one from another), sends each as a streaming `/v1/completions` request
with one token out after a short warm-up request, and prints one JSON line per request:
the prompt's tokens, the client's time to its first streamed token, and the server's own
`wick_time_to_first_token_seconds` for that request (from `/metrics`).

With `--streams N`, N short-prompt streams decode while the long prompt arrives: each line
then also gives their inter-token gap before the prompt came (median, "idle"), the longest
gap and the 95th percentile while it was being read (from its sending to its first token),
and the ratio of the longest to idle (issue 47's bound: at most 2).

    ttft.py --url http://127.0.0.1:8411 --model MODEL_DIR --tokens 18682 --repeat 2 --streams 4
"""
import argparse
import json
import re
import statistics
import threading
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


def decode_stream(url, prompt, max_tokens, stamps, stop):
    """Streams a reply, appending each token's arrival time to `stamps` until `stop`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
            if stop.is_set():
                break


def gaps_between(stamps, lo, hi):
    return [b - a for a, b in zip(stamps, stamps[1:]) if lo <= b <= hi]


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
    ap.add_argument("--streams", type=int, default=0,
                    help="short-prompt streams decoding while each long prompt arrives")
    ap.add_argument("--stream-tokens", type=int, default=2000,
                    help="tokens each stream asks for (more than it decodes meanwhile)")
    args = ap.parse_args()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    warm, _ = prompt_of(tok, args.warmup_tokens, 0)
    first_token(args.url, warm)
    for r in range(args.repeat):
        text, n = prompt_of(tok, args.tokens, r + 1)
        s0 = metric(args.url, "wick_time_to_first_token_seconds_sum")
        c0 = metric(args.url, "wick_time_to_first_token_seconds_count")
        stop, streams = threading.Event(), []
        for i in range(args.streams):
            stamps = []
            short, _ = prompt_of(tok, 64, 1000 * (r + 1) + i)
            th = threading.Thread(target=decode_stream,
                                  args=(args.url, short, args.stream_tokens, stamps, stop), daemon=True)
            th.start()
            streams.append((th, stamps))
        if streams:
            # Let the streams settle into plain decoding and measure their idle gap.
            time.sleep(3.0)
        sent = time.perf_counter()
        t = first_token(args.url, text)
        arrived = sent + t
        if streams:
            time.sleep(1.0)
        stop.set()
        s1 = metric(args.url, "wick_time_to_first_token_seconds_sum")
        c1 = metric(args.url, "wick_time_to_first_token_seconds_count")
        server = (s1 - s0) / (c1 - c0) if None not in (s0, s1, c0, c1) and c1 > c0 else None
        line = {"prompt_tokens": n, "ttft_s": t, "server_ttft_s": server}
        if streams:
            idle = [g for _, st in streams for g in gaps_between(st, sent - 2.0, sent)]
            busy = sorted(g for _, st in streams for g in gaps_between(st, sent, arrived + 0.05))
            if idle and busy:
                base = statistics.median(idle)
                line.update({
                    "streams": args.streams, "idle_itl_s": base, "max_itl_s": busy[-1],
                    "p95_itl_s": busy[int(0.95 * (len(busy) - 1))],
                    "max_itl_over_idle": busy[-1] / base,
                })
        print(json.dumps(line), flush=True)
        for th, _ in streams:
            th.join(timeout=30)


if __name__ == "__main__":
    main()
