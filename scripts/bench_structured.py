#!/usr/bin/env python3
"""Structured output on the CPU: decode speed of JSON-schema-constrained streams against
unconstrained ones, at 1 and 8 concurrent streams, through a real `wick serve`.

    cargo build --release -p wick
    python3 scripts/bench_structured.py --rounds 3 --gen-tokens 192

Each stream is one streamed chat completion at temperature 0 with exactly `--gen-tokens`
output tokens: unconstrained ones set `ignore_eos`; constrained ones carry a schema (an array
of at least 100 small objects with an integer, a bounded string and an enum) that cannot
end before `max_tokens`, so both kinds decode the same number of tokens. A stream's decode
rate is (tokens - 1) / (last token - first token); the aggregate is their sum. Each round
runs the four cases back to back and the table shows each round's constrained/free ratio
(two runs seconds apart compare better on a shared machine than medians). The server runs
with the prompt cache off; extra arguments after `--` go to `wick serve`.
"""
import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WICK = ROOT / "target" / "release" / "wick"

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 16},
            "kind": {"enum": ["fruit", "vegetable", "grain"]},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
}
PROMPT = "List foods as JSON objects with an id, a name and a kind."


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


def stream(url: str, gen_tokens: int, constrained: bool, out: list) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": gen_tokens,
        "temperature": 0,
        "stream": True,
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "foods", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    stamps = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    out.append(stamps)


def run(url: str, streams: int, gen_tokens: int, constrained: bool) -> float:
    results: list = []
    threads = [
        threading.Thread(target=stream, args=(url, gen_tokens, constrained, results))
        for _ in range(streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = 0.0
    for stamps in results:
        if len(stamps) >= 2:
            total += (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=192)
    ap.add_argument("--wick", type=Path, default=WICK, help="the wick binary (default: this checkout's release build)")
    ap.add_argument("serve_args", nargs="*", help="extra `wick serve` arguments (after --)")
    a = ap.parse_args()
    if not a.wick.is_file():
        sys.exit(f"{a.wick} is missing: cargo build --release -p wick")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = subprocess.Popen(
        [str(a.wick), "serve", "--port", str(port), "--prompt-cache", "0", *a.serve_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(url, serve)
        run(url, 1, 16, True)  # warm-up (builds the token trie)
        run(url, 8, 16, False)  # warm-up (the backend's batch buffers)
        run(url, 8, 16, True)
        ratios = {1: [], 8: []}
        print("| round | streams | free tok/s | JSON schema tok/s | ratio |")
        print("|---:|---:|---:|---:|---:|")
        for r in range(a.rounds):
            for n in (1, 8):
                free = run(url, n, a.gen_tokens, False)
                constrained = run(url, n, a.gen_tokens, True)
                ratios[n].append(constrained / free)
                print(f"| {r + 1} | {n} | {free:.1f} | {constrained:.1f} | {constrained / free:.3f} |", flush=True)
        for n, rs in ratios.items():
            print(f"median ratio, {n} stream(s): {statistics.median(rs):.3f}")
    finally:
        serve.terminate()
        serve.wait(timeout=30)


if __name__ == "__main__":
    main()
