#!/usr/bin/env python3
"""Continuous batching on the CPU: aggregate decode speed of N concurrent streams against
one stream, through a real `wick serve` and the load tool `wick bench --concurrency N`.

    cargo build --release -p wick
    python3 scripts/bench_batching.py --rounds 3 --gen-tokens 256

Starts one server (default model, prompt cache off so every round prefills, so no round
is favoured), then for each round runs 1 stream and 8 streams back to back and reports
the ratio of their aggregate decode rates, two ways: "sum of streams" = the sum over
streams of (tokens - 1) / (last token - first token), which includes the time other
streams' prompts were being prefilled; "while all decode" = tokens over the window in which
every stream was decoding (from the last stream's first token to the first stream's last). The table shows each round's pair and the
median ratio: a ratio of two runs seconds apart is steadier on a shared machine than a
ratio of medians. Extra arguments after `--` go to `wick serve` (e.g. `-- --kv-type f32`).
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WICK = ROOT / "target" / "release" / "wick"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"wick serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit("wick serve did not become ready")


def load(url: str, streams: int, prompt_tokens: int, gen_tokens: int) -> dict:
    out = subprocess.run(
        [str(WICK), "bench", "--concurrency", str(streams), "--url", url,
         "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens), "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("serve_args", nargs="*", help="extra `wick serve` arguments (after --)")
    a = ap.parse_args()
    if not WICK.is_file():
        sys.exit(f"{WICK} is missing: cargo build --release -p wick")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [str(WICK), "serve", "--port", str(port), "--prompt-cache", "0", *a.serve_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, serve)
        load(url, a.streams, a.prompt_tokens, 16)  # warm-up
        ratios, steady_ratios = [], []
        n = a.streams
        print(f"| round | 1 stream decode tok/s | {n} streams decode tok/s (sum of streams) "
              f"| ratio | {n} streams while all decode | ratio |")
        print("|---|---|---|---|---|---|")
        for r in range(a.rounds):
            one = load(url, 1, a.prompt_tokens, a.gen_tokens)["decode_tps"]
            many = load(url, n, a.prompt_tokens, a.gen_tokens)
            ratios.append(many["decode_tps"] / one)
            steady = many.get("steady_decode_tps") or 0.0
            steady_ratios.append(steady / one)
            print(f"| {r + 1} | {one:.1f} | {many['decode_tps']:.1f} | {ratios[-1]:.2f} "
                  f"| {steady:.1f} | {steady_ratios[-1]:.2f} |", flush=True)
        print(f"\nmedian ratio {statistics.median(ratios):.2f} (sum of streams), "
              f"{statistics.median(steady_ratios):.2f} (while all decode); "
              f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        serve.terminate()
        serve.wait(timeout=30)


if __name__ == "__main__":
    main()
