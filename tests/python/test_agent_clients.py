"""Real coding agents against `wick serve` on Qwen2.5-Coder-0.5B, offline (their traffic
goes to loopback only): Claude Code (`claude -p`, Anthropic Messages) and Codex CLI
(`codex exec`, OpenAI Responses), installed pinned by scripts/agents/install.sh into
target/agents. Each answers a cold turn and a warm one (a new session reusing the first's
prompt from the cache); what came through wick is checked in its /metrics, and the time to
first token of both turns is printed (docs/agents.md records it).

Slow: Claude Code's first request is ~19k tokens, minutes of prefill on two cores."""
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import QWEN, ROOT, _serve, require_model

AGENTS = ROOT / "target" / "agents" / "node_modules" / ".bin"
CLAUDE = AGENTS / "claude"
CODEX = AGENTS / "codex"
MODEL_ID = "qwen2.5-coder-0.5b-instruct"

pytestmark = pytest.mark.slow


def need(binary: Path):
    if not binary.exists():
        pytest.skip(f"{binary.name} is not installed: run scripts/agents/install.sh (needs npm)")


@pytest.fixture(scope="module")
def qwen():
    """Qwen with a prompt cache of this module's own."""
    require_model(QWEN, MODEL_ID)
    yield from _serve(str(QWEN), "--model-id", MODEL_ID)


def metrics(server) -> dict:
    """The counters this test reads from /metrics: requests per route (status 200), the
    TTFT histogram's sum and count, prompt / cached / generated tokens."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    out = {"routes": {}}
    for line in text.splitlines():
        m = re.match(r'wick_http_requests_total\{route="([^"]+)",method="POST",status="200"\} (\d+)', line)
        if m:
            out["routes"][m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"(wick_time_to_first_token_seconds_(?:sum|count)|wick_prompt_tokens_total|"
                     r"wick_prompt_cached_tokens_total|wick_generation_tokens_total) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def delta(before: dict, after: dict, route: str) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after if k != "routes"}
    d["requests"] = after["routes"].get(route, 0) - before["routes"].get(route, 0)
    d["ttft"] = d["wick_time_to_first_token_seconds_sum"] / max(d["wick_time_to_first_token_seconds_count"], 1)
    return d


def run(cmd, env, cwd, timeout):
    started = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - started


def turn(server, route, cmd, env, cwd, timeout=1200):
    before = metrics(server)
    p, took = run(cmd, env, cwd, timeout)
    d = delta(before, metrics(server), route)
    assert p.returncode == 0, f"{cmd[0]} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}\n{server.logs()[-3000:]}"
    assert p.stdout.strip(), f"no answer:\n{p.stderr}"
    # The answer came through wick: a successful request on the route, tokens generated.
    assert d["requests"] >= 1, d
    assert d["wick_generation_tokens_total"] >= 1, d
    return p.stdout.strip(), took, d


def test_claude_code(qwen, tmp_path):
    need(CLAUDE)
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": qwen.base,
        "ANTHROPIC_AUTH_TOKEN": "dummy",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        # The cold prefill takes minutes on a small CPU: wait for it (Claude Code gives up
        # on a stream after 5 minutes without content by default).
        "API_TIMEOUT_MS": "1200000",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1200000",
        "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "1200000",
    }
    cmd = [str(CLAUDE), "-p", "--max-turns", "1"]
    answer, took, cold = turn(qwen, "/v1/messages", cmd + ["What is 2+2? Answer with one number."], env, work)
    assert cold["wick_prompt_tokens_total"] > 10_000, cold
    # A new session: the same system prompt and tools, a different question.
    answer2, took2, warm = turn(qwen, "/v1/messages", cmd + ["What is 3+3? Answer with one number."], env, work)
    print(f"\nclaude-code cold: {took:.1f}s TTFT {cold['ttft']:.2f}s prompt {cold['wick_prompt_tokens_total']:.0f}"
          f" | warm: {took2:.1f}s TTFT {warm['ttft']:.2f}s cached {warm['wick_prompt_cached_tokens_total']:.0f}"
          f"/{warm['wick_prompt_tokens_total']:.0f} | answers {answer!r} {answer2!r}")
    assert warm["wick_prompt_cached_tokens_total"] >= 0.9 * warm["wick_prompt_tokens_total"], warm
    assert warm["ttft"] <= 0.1 * cold["ttft"], (cold, warm)


def test_codex(qwen, tmp_path):
    need(CODEX)
    home = tmp_path / "home"
    work = tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(f"""
model = "{MODEL_ID}"
model_provider = "wick"

[model_providers.wick]
name = "wick"
base_url = "{qwen.base}/v1"
wire_api = "responses"

[analytics]
enabled = false

[features]
plugins = false
""")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex")}
    cmd = [str(CODEX), "exec", "--skip-git-repo-check", "--sandbox", "read-only"]
    answer, took, cold = turn(qwen, "/v1/responses", cmd + ["What is 2+2? Answer with one number."], env, work)
    assert cold["wick_prompt_tokens_total"] > 2_000, cold
    answer2, took2, warm = turn(qwen, "/v1/responses", cmd + ["What is 3+3? Answer with one number."], env, work)
    print(f"\ncodex cold: {took:.1f}s TTFT {cold['ttft']:.2f}s prompt {cold['wick_prompt_tokens_total']:.0f}"
          f" | warm: {took2:.1f}s TTFT {warm['ttft']:.2f}s cached {warm['wick_prompt_cached_tokens_total']:.0f}"
          f"/{warm['wick_prompt_tokens_total']:.0f} | answers {answer!r} {answer2!r}")
    assert warm["wick_prompt_cached_tokens_total"] >= 0.5 * warm["wick_prompt_tokens_total"], warm
