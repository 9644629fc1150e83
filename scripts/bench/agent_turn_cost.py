#!/usr/bin/env python3
"""What an agent's next turn costs once its conversation is long (issue 43): a conversation
of about TOKENS prompt tokens (a system prompt, a tool, turns of tool output) is sent once,
then each further turn appends the model's reply and a new tool output. Each turn's time to
first token (a 1-token reply, timed at the client) is set against a cold prompt of as many
tokens as the turn did not find cached, sent right after it to the same server as token ids
to /v1/completions (the reference: what the new tokens cost without any history). Prints one
JSON line per turn and a summary line.

    agent_turn_cost.py --wick BIN --model DIR [--tokens 20000] [--turns 3] [--threads N]
"""
import argparse
import json
import socket
import subprocess
import tempfile
import time
import urllib.request

SYSTEM = "You are a coding agent working in a large repository. Use the tools; be brief. "
TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]}}}]


def tool_output(turn, lines):
    return "\n".join(f"src/module_{turn}/file_{i}.rs:{i * 7}: fn item_{i}() -> u32 {{ {i} }}"
                     for i in range(lines))


def post(base, body, path="/v1/chat/completions"):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.load(r)
    return out, time.perf_counter() - t


def ask(base, messages):
    return post(base, {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 1,
                       "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--lines", type=int, default=12, help="lines of tool output per turn")
    ap.add_argument("--threads", type=int)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [a.wick, "serve", a.model, "--model-id", "m", "--port", str(port)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    log = tempfile.NamedTemporaryFile(prefix="wick-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        # Grow the history to about --tokens, measuring with one cheap request per 8 turns.
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Find why the build fails and fix it."}]
        turn = 0
        while True:
            for _ in range(8):
                messages.append({"role": "assistant", "content": f"Checking part {turn}."})
                messages.append({"role": "user", "content": tool_output(turn, a.lines)})
                turn += 1
            r, secs = ask(base, messages)
            if r["usage"]["prompt_tokens"] >= a.tokens:
                break
        cold = {"prompt_tokens": r["usage"]["prompt_tokens"], "seconds": round(secs, 3)}
        print(json.dumps({"history": cold}), flush=True)
        ratios = []
        for t in range(a.turns):
            reply = r["choices"][0]["message"].get("content") or "ok"
            new_text = tool_output(1000 + t, a.lines)
            messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": new_text})
            r, turn_s = ask(base, messages)
            prompt = r["usage"]["prompt_tokens"]
            cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
            # The reference: as many tokens, cold (ids no conversation starts with).
            ids = [(7 * i + 13 * t + 101) % 400 + 50 for i in range(prompt - cached)]
            alone, alone_s = post(base, {"model": "m", "prompt": ids, "max_tokens": 1,
                                         "temperature": 0}, "/v1/completions")
            line = {"turn": t, "prompt_tokens": prompt, "cached_tokens": cached,
                    "new_tokens": prompt - cached, "ttft_s": round(turn_s, 3),
                    "alone_prompt_tokens": alone["usage"]["prompt_tokens"],
                    "alone_cached": alone["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "alone_ttft_s": round(alone_s, 3), "ratio": round(turn_s / alone_s, 3)}
            ratios.append(line["ratio"])
            print(json.dumps(line), flush=True)
        print(json.dumps({"summary": {"history_tokens": cold["prompt_tokens"],
                                      "cold_history_s": cold["seconds"],
                                      "turn_over_alone": ratios}}), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
