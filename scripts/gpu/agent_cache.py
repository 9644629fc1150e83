#!/usr/bin/env python3
"""An agent loop through `wick serve` on a backend (issue 43 on the GPU): a long system prompt
and a tool, then turns that each append the model's reply and a tool output, through
/v1/chat/completions (thinking off and on) and /v1/messages with cache_control. Prints one
JSON line per loop: each turn's cached tokens over the previous turn's prompt. Standard
library only (the GPU image has no OpenAI or Anthropic SDK).

    agent_cache.py --wick BIN --model DIR [--template FILE] [--backend cuda] [--turns 6]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SYSTEM = ("You are a coding agent. Use the tools to read files and run commands; answer "
          "briefly. " * 6)
TOOLS = [{"type": "function", "function": {
    "name": "run", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                   "required": ["cmd"]}}}]


def tool_output(turn):
    return " ".join(f"line{turn}-{i} ok" for i in range(8 + 2 * turn))


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def chat_loop(base, turns, thinking):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Find the failing test and fix it."}]
    prompts, cached = [], []
    for turn in range(turns):
        r = post(base, "/v1/chat/completions", {
            "model": "agent", "messages": messages, "tools": TOOLS, "max_tokens": 24,
            "temperature": 0, "chat_template_kwargs": {"enable_thinking": thinking}})
        prompts.append(r["usage"]["prompt_tokens"])
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append({"role": "assistant",
                         "content": r["choices"][0]["message"].get("content") or "ok"})
        messages.append({"role": "user", "content": tool_output(turn)})
    return prompts, cached


def messages_loop(base, turns):
    messages = [{"role": "user", "content": "Find the failing test and fix it."}]
    prompts, cached = [], []
    for turn in range(turns):
        sent = [dict(m) for m in messages]
        sent[-1]["content"] = [{"type": "text", "text": sent[-1]["content"],
                                "cache_control": {"type": "ephemeral"}}]
        r = post(base, "/v1/messages", {
            "model": "agent", "max_tokens": 24, "messages": sent,
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]})
        u = r["usage"]
        prompts.append(u["input_tokens"] + u["cache_creation_input_tokens"]
                       + u["cache_read_input_tokens"])
        cached.append(u["cache_read_input_tokens"])
        text = "".join(b.get("text", "") for b in r["content"] if b["type"] == "text") or "ok"
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": tool_output(turn)})
    return prompts, cached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--template")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--turns", type=int, default=6)
    a = ap.parse_args()
    work = tempfile.mkdtemp()
    model = os.path.join(work, "m")
    shutil.copytree(a.model, model)
    if a.template:
        shutil.copy(a.template, os.path.join(model, "chat_template.jinja"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(work, "serve.log"), "w")
    proc = subprocess.Popen([a.wick, "serve", model, "--model-id", "agent", "--backend",
                             a.backend, "--port", str(port)], stdout=log, stderr=log)
    label = f"{os.path.basename(a.model.rstrip('/'))} {os.path.basename(a.template or '')}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                print(json.dumps({"model": label, "error": open(log.name).read()[-600:]}))
                return
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        loops = [("chat, thinking off", lambda: chat_loop(base, a.turns, False)),
                 ("chat, thinking on", lambda: chat_loop(base, a.turns, True)),
                 ("messages, cache_control", lambda: messages_loop(base, a.turns - 1))]
        for name, run in loops:
            try:
                prompts, cached = run()
                ratios = [round(c / p, 4) for p, c in zip(prompts, cached[1:])]
                print(json.dumps({"model": label, "backend": a.backend, "loop": name,
                                  "prompts": prompts, "cached": cached, "reuse": ratios,
                                  "ok": all(x >= 0.95 for x in ratios)}), flush=True)
            except Exception as e:  # one loop's failure is reported, the others still run
                print(json.dumps({"model": label, "loop": name, "error": str(e)}), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
