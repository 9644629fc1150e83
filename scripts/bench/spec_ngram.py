#!/usr/bin/env python3
"""A/B of speculative decoding: starts `wick serve` without and with `--spec-args`
(default `--spec ngram`; a draft model is `--spec-args "--draft-model PATH"`) on the same
model, sends the same greedy requests to both, alternating, checks the outputs are
byte-identical, and prints the decode rates and their ratio (decode = tokens after the
first / time after the first, streamed; with `--concurrency N`, N requests at once and
the sum of their decode rates).

    python scripts/bench/spec_ngram.py --model qwen2.5-coder-0.5b-instruct --rounds 3
    python scripts/bench/spec_ngram.py --concurrency 8 --rounds 2
    python scripts/bench/tiny_draft.py MODEL.gguf /tmp/tiny.gguf   # a draft that is never right
    python scripts/bench/spec_ngram.py --model MODEL.gguf --prompts prose \
        --spec-args "--draft-model /tmp/tiny.gguf"
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
WICK = ROOT / "target" / "release" / "wick"  # --wick picks another build

FUNCTION = '''def summarize_orders(orders, tax_rate, discounts):
    """Totals per customer, with tax and the best discount applied."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = 0.0
        for item in order["items"]:
            price = item["price"]
            quantity = item["quantity"]
            if quantity <= 0:
                continue
            amount += price * quantity
        best = 0.0
        for code in order.get("codes", []):
            if code in discounts:
                rate = discounts[code]
                if rate > best:
                    best = rate
        amount = amount * (1.0 - best)
        amount = amount * (1.0 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
            counts[customer] = 0
        totals[customer] += amount
        counts[customer] += 1
    report = []
    for customer in sorted(totals):
        average = totals[customer] / counts[customer]
        report.append({
            "customer": customer,
            "total": round(totals[customer], 2),
            "orders": counts[customer],
            "average": round(average, 2),
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    return report
'''

PROMPTS = [
    "Rename the variable `amount` to `subtotal` in this function. Reply with the whole "
    "updated function in one code block and nothing else.\n\n```python\n" + FUNCTION + "```",
    "Rename the parameter `orders` to `order_list` everywhere in this function. Reply "
    "with the whole updated function in one code block and nothing else.\n\n```python\n"
    + FUNCTION + "```",
]

# Text without much to copy: what drafting costs when it rarely pays.
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old, in a few paragraphs.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(wick: Path, model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="wick-spec-", suffix=".log", delete=False)
    cmd = [str(wick), "serve", model, "--port", str(port), "--prompt-cache", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            sys.exit(f"{cmd} exited: {Path(log.name).read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"{cmd} not ready")


def run(base: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, stamps, usage = [], [], None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    text.append(piece)
                    stamps.append(time.perf_counter())
    n = usage["completion_tokens"]
    decode = stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")
    return {"text": "".join(text), "tokens": n, "tps": (n - 1) / decode, "usage": usage}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_stats(base: str, pid: int) -> dict:
    """The engine's step counters (`/stats`): steps, their seconds, tokens fed; and the
    server's CPU time (on a loaded machine, less noisy than wall time)."""
    e = httpx.get(base + "/stats", timeout=10).json()["engine"]
    return {
        "cpu": cpu_seconds(pid),
        "steps": e["steps"],
        "total": e["step_seconds"]["total"],
        "forward": e["step_seconds"]["forward"],
        "sampling": e["step_seconds"]["sampling"],
        "fed": e["step_tokens"]["sum"],
        "generated": e["generated_tokens_total"],
    }


def step_report(before: dict, after: dict) -> str:
    """Per forward pass between two `engine_stats`: ms in all, in the pass, in sampling;
    tokens fed and tokens emitted."""
    d = {k: after[k] - before[k] for k in after}
    n = max(d["steps"], 1)
    return (
        f"{d['steps']} steps, {1e3 * d['total'] / n:.1f} ms/step (forward "
        f"{1e3 * d['forward'] / n:.1f}, sampling {1e3 * d['sampling'] / n:.1f}), "
        f"fed {d['fed'] / n:.1f}, emitted {d['generated'] / n:.1f} tokens/step; "
        f"CPU {1e3 * d['cpu'] / max(d['generated'], 1):.1f} ms/token"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--spec-args", default="--spec ngram")
    ap.add_argument("--prompts", choices=["edit", "prose"], default="edit")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--wick", help="the wick binary (default: this checkout's release build)")
    args = ap.parse_args()
    wick = Path(args.wick) if args.wick else WICK
    print("load:", os.getloadavg())
    # On a shared machine the server started second was measured ~1.18x faster than the
    # first with both plain (an A/A run): the servers are restarted in the other order
    # for the second half of the rounds, so that bias cancels in the median.
    servers = []
    pids = {}

    def launch(spec_first: bool):
        for p in servers:
            p.terminate()
            p.wait()
        configs = [("plain", []), ("spec", args.spec_args.split())]
        if spec_first:
            configs.reverse()
        urls = {}
        servers.clear()
        for name, extra in configs:
            proc, urls[name] = start(wick, args.model, extra)
            pids[urls[name]] = proc.pid
            servers.append(proc)
        print(f"servers (re)started, {configs[0][0]} first")
        return urls["plain"], urls["spec"]

    plain_url, spec_url = launch(False)
    try:
        rates = {"plain": [], "spec": []}
        for r in range(args.rounds):
            if args.rounds > 1 and r == args.rounds // 2:
                plain_url, spec_url = launch(True)
            prompts = PROMPTS if args.prompts == "edit" else PROSE
            for i, prompt in enumerate(prompts):
                order = [("plain", plain_url), ("spec", spec_url)]
                if (r + i) % 2:
                    order.reverse()
                # With --concurrency N, N requests at once (the prompts in turn from this one).
                batch = [prompts[(i + j) % len(prompts)] for j in range(args.concurrency)]
                out = {}
                for name, url in order:
                    before = engine_stats(url, pids[url])
                    with ThreadPoolExecutor(len(batch)) as pool:
                        replies = list(pool.map(lambda p: run(url, p, args.max_tokens), batch))
                    out[name] = {
                        "steps": step_report(before, engine_stats(url, pids[url])),
                        "texts": [x["text"] for x in replies],
                        "tokens": sum(x["tokens"] for x in replies),
                        "tps": sum(x["tps"] for x in replies),
                        "speculation": [x["usage"].get("speculation") for x in replies],
                    }
                same = out["plain"]["texts"] == out["spec"]["texts"]
                for name in rates:
                    rates[name].append(out[name]["tps"])
                print(
                    f"round {r} prompt {i} x{args.concurrency}: {out['plain']['tokens']} tokens, "
                    f"plain {out['plain']['tps']:.1f} tok/s, spec {out['spec']['tps']:.1f} tok/s, "
                    f"ratio {out['spec']['tps'] / out['plain']['tps']:.2f}, identical {same}, "
                    f"speculation {out['spec']['speculation'][0]}"
                )
                for name in ("plain", "spec"):
                    print(f"  {name}: {out[name]['steps']}")
                if r == 0:
                    print("  reply starts:", repr(out["plain"]["texts"][0][:120]))
                if not same:
                    print("plain:", repr(out["plain"]["texts"][0][:400]))
                    print("spec: ", repr(out["spec"]["texts"][0][:400]))
        mean = {k: sum(v) / len(v) for k, v in rates.items()}
        pairs = sorted(b / a for a, b in zip(rates["plain"], rates["spec"]))
        median = pairs[len(pairs) // 2] if len(pairs) % 2 else (
            pairs[len(pairs) // 2 - 1] + pairs[len(pairs) // 2]) / 2
        print(
            f"mean decode: plain {mean['plain']:.1f} tok/s, spec {mean['spec']:.1f} tok/s, "
            f"ratio {mean['spec'] / mean['plain']:.2f}; median pair ratio {median:.2f} "
            f"(range {pairs[0]:.2f}–{pairs[-1]:.2f}, {len(pairs)} pairs)"
        )
        print("load:", os.getloadavg())
    finally:
        for p in servers:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
