#!/usr/bin/env python3
"""Posts mutated JSON bodies to every POST endpoint of a running `wick serve` for a bounded
time and checks that no answer is a 5xx, no connection is dropped without an answer, and the
server still answers /health at the end (and its log has no panic).

Endpoints come from the server's own `GET /v1` list (recorded by the router), so a new
endpoint is fuzzed as soon as it is routed; seed bodies per endpoint are in http_seeds.json (the generic
ones otherwise). Starts its own server from target/release/wick unless --base is given.

    python3 tests/fuzz/fuzz_http.py --secs 30           # CI (WICK_FUZZ_SECS also sets it)
    python3 tests/fuzz/fuzz_http.py --base http://127.0.0.1:8080 --secs 600
"""
import argparse
import copy
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def post_routes(base: str) -> list[str]:
    """The POST paths the server routes, from its `GET /v1` list (the router records it as
    routes are added, so a new endpoint is fuzzed as soon as it is routed)."""
    listed = httpx.get(base + "/v1", timeout=30).json()["endpoints"]
    return [e.split(" ", 1)[1] for e in listed if e.startswith("POST ") and "{" not in e]


HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 + 1, -(2**63), 1e308, -1e308, 0.5, 1e-320,
    "", "x", "a" * 5000, "<|im_start|>system\nx<|im_end|>", "\u0000", "\ud7ff\ue000", "NaN",
    "Infinity", [], [None], [[[]]], {}, {"a": {"b": {}}}, [1] * 300, "{\"a\":",
]


def rand_value(rng: random.Random):
    if rng.random() < 0.1:
        # Deep nesting, spliced in as text after encoding (Python's own copy/dumps recurse).
        return f"__DEEP_{rng.randint(50, 3000)}__"
    return copy.deepcopy(rng.choice(HOSTILE_VALUES))


def expand_deep(raw: bytes) -> bytes:
    """Replaces each `"__DEEP_n__"` with n nested arrays / objects."""
    def deep(m):
        n = int(m.group(1))
        opener = b'{"k":' if n % 2 else b"["
        closer = b"}" if n % 2 else b"]"
        return opener * n + b"0" + closer * n
    return re.sub(rb'"__DEEP_(\d+)__"', deep, raw)


def paths_of(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths_of(v, prefix + (i,))


def mutate_json(body, rng: random.Random):
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 4)):
        all_paths = list(paths_of(body))
        path = rng.choice(all_paths)
        if not path:
            if rng.random() < 0.2:
                body = rand_value(rng)
            continue
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        op = rng.random()
        try:
            if op < 0.5:
                parent[key] = rand_value(rng)
            elif op < 0.7:
                del parent[key]
            elif op < 0.85 and isinstance(parent, dict):
                parent[rng.choice(["lora", "max_tokens", "n", "stream", "model", "messages", "tools",
                                   "logit_bias", "stop", "seed", "role", "content", "zz"])] = rand_value(rng)
            else:
                parent[key] = copy.deepcopy(parent[key]) if rng.random() < 0.5 else [parent[key]] * 2
        except (KeyError, IndexError, TypeError):
            pass
    return body


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if not b:
            b += bytes([rng.randrange(256)])
        elif op < 0.3:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.5:
            del b[rng.randrange(len(b)):]
        elif op < 0.7:
            i = rng.randrange(len(b))
            b[i:i] = rng.choice([b"\xff\xfe", b"\xc0\x80", b"{", b"}", b"[", b"\"", b"\\u", b"\x00", b",", b"1e999999"])
        else:
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 50)]
    return bytes(b)


def post_bounded(http: httpx.Client, endpoint: str, raw: bytes, headers: dict, limit: float):
    """POSTs and reads the answer for at most `limit` seconds in all (a mutated max_tokens can
    stream for minutes); a longer answer is cut by disconnecting, which the server must
    survive. Returns (status, start of the body); status "slow" when cut."""
    started = time.monotonic()
    with http.stream("POST", endpoint, content=raw, headers=headers) as r:
        body = b""
        for chunk in r.iter_bytes():
            if len(body) < 4096:
                body += chunk
            if time.monotonic() - started > limit:
                return "slow", body.decode(errors="replace")
        return r.status_code, body.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="wick-fuzz-", suffix=".log", delete=False)
    cmd = [str(ROOT / "target/release/wick"), "serve", *extra, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, WICK_LOG=os.environ.get("WICK_LOG", "info")))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"wick serve exited with {proc.returncode}:\n{Path(log.name).read_text()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, Path(log.name)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit("wick serve did not become ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--secs", type=float, default=float(os.environ.get("WICK_FUZZ_SECS", 30)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("WICK_FUZZ_SEED", 1)))
    ap.add_argument("--base", help="fuzz a running server instead of starting one")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per request")
    ap.add_argument("serve_args", nargs="*", help="arguments for `wick serve` (default model when empty)")
    args = ap.parse_args()

    seeds = json.loads((HERE / "http_seeds.json").read_text())
    proc = log = None
    base = args.base
    if base is None:
        proc, base, log = start_server(args.serve_args)
    endpoints = post_routes(base)
    if "/v1/chat/completions" not in endpoints:
        sys.exit(f"the server's GET /v1 lists no chat endpoint: {endpoints}")
    for e in endpoints:
        if e not in seeds:
            print(f"note: no seeds for {e} in http_seeds.json; using the generic ones")
    rng = random.Random(args.seed)
    stats = {e: {"tried": 0, "status": {}} for e in endpoints}
    failures, dropped = [], []
    prev = "nothing"
    deadline = time.monotonic() + args.secs
    try:
        with httpx.Client(base_url=base, timeout=args.timeout) as http:
            while time.monotonic() < deadline and len(failures) < 10:
                endpoint = rng.choice(endpoints)
                body = rng.choice(seeds.get(endpoint) or seeds["generic"])
                if rng.random() < 0.85:
                    body = mutate_json(body, rng)
                raw = expand_deep(json.dumps(body).encode())
                if rng.random() < 0.25:
                    raw = mutate_bytes(raw, rng)
                ctype = rng.choice(["application/json"] * 8 + ["text/plain", "application/json; charset=latin-1", ""])
                headers = {"content-type": ctype} if ctype else {}
                s = stats[endpoint]
                s["tried"] += 1
                what = f"{len(raw)} bytes, content-type {ctype!r}, after {prev}: " + raw[:300].decode(errors="replace")
                try:
                    code, text = post_bounded(http, endpoint, raw, headers, args.timeout)
                    if isinstance(code, int) and code >= 500:
                        failures.append((endpoint, code, what, text[:300]))
                except httpx.TimeoutException:
                    code = "timeout"  # a long generation or a slow answer; not a crash
                except httpx.HTTPError as e:
                    # Sent on a kept-alive connection the server had closed? The same body on
                    # a fresh connection tells a dropped connection from a request that kills
                    # its answer.
                    try:
                        with httpx.Client(base_url=base, timeout=args.timeout) as fresh:
                            retry, text = post_bounded(fresh, endpoint, raw, headers, args.timeout)
                        code = f"dropped-keepalive-then-{retry}"
                        dropped.append((endpoint, what, str(e)))
                        if isinstance(retry, int) and retry >= 500:
                            failures.append((endpoint, retry, what, text[:300]))
                    except httpx.TimeoutException:
                        code = "dropped-keepalive-then-timeout"
                    except httpx.HTTPError as e2:
                        code = type(e2).__name__
                        failures.append((endpoint, code, what, str(e2)))
                s["status"][str(code)] = s["status"].get(str(code), 0) + 1
                prev = f"{endpoint} -> {code}"
            health = httpx.get(base + "/health", timeout=10).status_code
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    total = sum(s["tried"] for s in stats.values())
    print(f"fuzz_http: {total} bodies in {args.secs:.0f}s (seed {args.seed}), /health {health} at the end")
    for e, s in stats.items():
        print(f"  {e}: {s['tried']} bodies, status counts {dict(sorted(s['status'].items()))}")
    if log is not None:
        text = log.read_text(errors="replace")
        if "panicked" in text:
            failures.append(("log", "panic", b"", text[text.index("panicked") - 200:][:600]))
        if proc.returncode not in (0, None):
            failures.append(("exit", proc.returncode, b"", "wick serve did not exit cleanly on SIGTERM"))
    if health != 200:
        failures.append(("/health", health, b"", "server not healthy after fuzzing"))
    if dropped:
        print(f"{len(dropped)} requests sent on a kept-alive connection got no answer (the same body "
              f"on a fresh connection did); first: {dropped[0]}")
        for endpoint, what, _ in dropped:
            print(f"  dropped: {endpoint} {what[:160]}")
        if os.environ.get("WICK_FUZZ_STRICT_KEEPALIVE") == "1":
            failures.append(("keep-alive", len(dropped), "", "connections closed without Connection: close"))
    for f in failures:
        print("FAILURE:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
