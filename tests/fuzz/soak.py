#!/usr/bin/env python3
"""Soak: a `wick serve` under steady mixed load (whole and streamed chat, completions,
cancelled streams) for --secs, sampling the server's resident memory; prints the RSS at the
start of the load, at the end, and the drift, and fails on any 5xx or a dead server.

    python3 tests/fuzz/soak.py --secs 600 --clients 4
"""
import argparse
import random
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_http import start_server  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def client_loop(base: str, stop: float, seed: int, counts: dict, errors: list):
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=120) as http:
        while time.monotonic() < stop:
            kind = rng.choice(["chat", "stream", "completion", "cancel"])
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 60)))
            try:
                if kind == "completion":
                    r = http.post("/v1/completions", json={"prompt": words, "max_tokens": rng.randint(1, 16)})
                    code = r.status_code
                else:
                    body = {"messages": [{"role": "user", "content": words}],
                            "max_tokens": rng.randint(1, 24), "stream": kind != "chat"}
                    if kind == "chat":
                        code = http.post("/v1/chat/completions", json=body).status_code
                    else:
                        with http.stream("POST", "/v1/chat/completions", json=body) as r:
                            code = r.status_code
                            for i, _ in enumerate(r.iter_lines()):
                                if kind == "cancel" and i >= 2:
                                    break  # disconnect mid-stream
            except httpx.HTTPError as e:
                errors.append(repr(e))
                continue
            counts[code] = counts.get(code, 0) + 1
            if code >= 500:
                errors.append(f"{kind}: {code}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--secs", type=float, default=300)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    proc, base, log = start_server(args.serve_args)
    counts, errors, samples = {}, [], []
    try:
        # Warm up (first allocations, caches) before the first sample.
        httpx.post(base + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        stop = time.monotonic() + args.secs
        threads = [threading.Thread(target=client_loop, args=(base, stop, i, counts, errors))
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        while time.monotonic() < stop:
            samples.append((time.monotonic(), rss_kib(proc.pid)))
            time.sleep(min(10, max(0.1, stop - time.monotonic())))
        for t in threads:
            t.join()
        samples.append((time.monotonic(), rss_kib(proc.pid)))
        health = httpx.get(base + "/health", timeout=10).status_code
    finally:
        proc.terminate()
        proc.wait(60)
    first, last = samples[0][1], samples[-1][1]
    peak = max(s[1] for s in samples)
    total = sum(counts.values())
    print(f"soak: {args.secs:.0f}s, {args.clients} clients, {total} requests {dict(sorted(counts.items()))}")
    print(f"  RSS start {first / 1024:.1f} MiB, end {last / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
          f"drift {(last - first) / 1024:+.1f} MiB; /health {health}; exit {proc.returncode}")
    if "panicked" in log.read_text(errors="replace"):
        errors.append("panic in the server log")
    for e in errors[:10]:
        print("ERROR:", e)
    return 1 if errors or health != 200 else 0


if __name__ == "__main__":
    sys.exit(main())
