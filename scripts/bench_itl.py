#!/usr/bin/env python3
"""Inter-token latency of a running stream while a long prompt arrives (chunked prefill).

Against a running `wick serve` (standard library only):

    wick serve qwen2.5-coder --port 8090 --step-tokens 512 &
    python3 scripts/bench_itl.py --url http://127.0.0.1:8090 --long-tokens 16384

Stream A (`/v1/completions`, greedy, `ignore_eos`) decodes alone for a while; then request B
sends a prompt of about `--long-tokens` tokens (one token out). Every step of the engine
carries A's decode token first and then up to the step budget of B's prompt, so A's gaps
while B is prefilled should stay near the time of one prompt chunk, far below B's whole
prefill. The script prints A's gaps before B, while B is being prefilled (from B's send to
B's first token), and after, plus B's time to first token.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request


def stream(url, body, on_token):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                on_token(time.perf_counter())


def summary(gaps):
    if not gaps:
        return "none"
    gaps = sorted(gaps)
    p95 = gaps[min(len(gaps) - 1, int(0.95 * len(gaps)))]
    return (f"{len(gaps)} gaps, median {1e3 * statistics.median(gaps):.0f} ms, "
            f"p95 {1e3 * p95:.0f} ms, max {1e3 * gaps[-1]:.0f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--long-tokens", type=int, default=16384,
                    help="approximate length of the long prompt (9 tokens per sentence)")
    ap.add_argument("--stream-tokens", type=int, default=2000, help="max_tokens of stream A")
    ap.add_argument("--lead", type=int, default=20, help="A's tokens before B is sent")
    args = ap.parse_args()

    times = []
    started = threading.Event()

    def on_a(t):
        times.append(t)
        if len(times) == args.lead:
            started.set()

    a = threading.Thread(target=stream, args=(args.url, {
        "prompt": "Count from one to one thousand in words: one, two, three,",
        "max_tokens": args.stream_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True}, on_a), daemon=True)
    a.start()
    started.wait()
    b_sent = time.perf_counter()
    b_first = []
    text = "The quick brown fox jumps over the lazy dog. " * (args.long_tokens // 10)
    stream(args.url, {"prompt": text + "\nSummarize:", "max_tokens": 1, "temperature": 0,
                      "stream": True}, b_first.append)
    b_done = b_first[0] if b_first else time.perf_counter()
    # A goes on past B's first token; wait for a few more of its tokens, then stop looking.
    seen = len(times)
    while len(times) < seen + 10 and a.is_alive():
        time.sleep(0.05)
    gaps = [(t1 - t0, t1) for t0, t1 in zip(times, times[1:])]
    before = [g for g, t in gaps if t <= b_sent]
    during = [g for g, t in gaps if b_sent < t <= b_done]
    after = [g for g, t in gaps if t > b_done]
    print(f"long prompt: time to first token {b_done - b_sent:.1f} s")
    print(f"stream A before: {summary(before)}")
    print(f"stream A while the long prompt is prefilled: {summary(during)}")
    print(f"stream A after: {summary(after[:10])}")


if __name__ == "__main__":
    main()
