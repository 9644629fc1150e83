"""Agent loops reuse the previous turn on every cache kind (issue 43): a long system prompt
and a tool, then turns that each append the model's reply and a tool output, through
`/v1/chat/completions`, `/v1/messages` (with `cache_control`) and `/v1/responses`. Each turn
after the first must reuse at least 0.95 of the previous turn's prompt from the prompt cache,
thinking on and off. The models are tiny random goldens whose caches cannot be cut back —
Qwen 3.5 (recurrent DeltaNet state) and Gemma 4 (sliding windows that wrap) — with real chat
templates of the families wick ships (the llama.cpp test assets, `wick pull test-assets`)."""
import shutil

import anthropic
import httpx
import pytest

from conftest import ROOT, WICK_HOME, WickServer, _serve

GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
TEMPLATES = WICK_HOME / "assets" / "llama.cpp" / "templates"

SYSTEM = ("You are a coding agent. Use the tools to read files and run commands; answer "
          "briefly. " * 6)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]},
    },
}]


def tool_output(turn: int) -> str:
    return " ".join(f"line{turn}-{i} ok" for i in range(8 + 2 * turn))


@pytest.fixture(scope="module", params=[
    ("qwen35", "Qwen3.5-4B.jinja"),
    ("qwen35", "Qwen-Qwen3-0.6B.jinja"),
    ("qwen35", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
    ("qwen35", "openbmb-MiniCPM5-1B.jinja"),
    ("qwen35", "GLM-4.6.jinja"),
    ("gemma4_chat", "google-gemma-4-31B-it.jinja"),
], ids=lambda p: f"{p[0]}-{p[1].removesuffix('.jinja')}")
def agent_server(request, tmp_path_factory):
    golden, template = request.param
    path = TEMPLATES / template
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `wick pull test-assets`")
    d = tmp_path_factory.mktemp(golden)
    shutil.copytree(GOLDENS / golden, d / "m")
    shutil.copy(path, d / "m" / "chat_template.jinja")
    yield from _serve(str(d / "m"), "--model-id", "agent")


def ratios(prompts, cached):
    """Each turn's cached tokens over the previous turn's prompt."""
    return [c / p for p, c in zip(prompts, cached[1:])]


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_completions_turns_reuse_the_last_one(agent_server, thinking):
    client = agent_server.client()
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Find the failing test and fix it."}]
    prompts, cached = [], []
    for turn in range(6):
        r = client.chat.completions.create(
            model="agent", messages=messages, tools=TOOLS, max_tokens=24, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        prompts.append(r.usage.prompt_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
        messages.append({"role": "user", "content": tool_output(turn)})
    got = ratios(prompts, cached)
    assert all(x >= 0.95 for x in got), f"reuse per turn {got} (prompts {prompts}, cached {cached})"


def test_messages_cache_control_pins_and_usage_adds_up(agent_server):
    claude = anthropic.Anthropic(base_url=agent_server.base, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Find the failing test and fix it."}]
    prompts, cached = [], []
    for turn in range(5):
        # As Claude Code does: a breakpoint on the system prompt and on the last message.
        sent = [dict(m) for m in messages]
        last = sent[-1]
        last["content"] = [{"type": "text", "text": last["content"],
                            "cache_control": {"type": "ephemeral"}}]
        r = claude.messages.create(
            model="agent", max_tokens=24, messages=sent,
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}])
        u = r.usage
        total = u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens
        prompts.append(total)
        cached.append(u.cache_read_input_tokens)
        if turn == 0:
            # The breakpoints' prefix was written, and nothing was read.
            assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > 0, u
        text = "".join(b.text for b in r.content if b.type == "text") or "ok"
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": tool_output(turn)})
    got = ratios(prompts, cached)
    assert all(x >= 0.95 for x in got), f"reuse per turn {got} (prompts {prompts}, cached {cached})"
    stats = httpx.get(f"{agent_server.base}/stats").json()["prompt_cache"]
    assert stats["pinned_entries"] >= 1, stats


def test_responses_turns_reuse_the_last_one(agent_server):
    client = agent_server.client()
    previous = None
    prompts, cached = [], []
    for turn in range(4):
        text = "Find the failing test and fix it." if turn == 0 else tool_output(turn)
        r = client.responses.create(
            model="agent", instructions=SYSTEM, input=text, max_output_tokens=24,
            temperature=0, previous_response_id=previous)
        previous = r.id
        prompts.append(r.usage.input_tokens)
        cached.append(r.usage.input_tokens_details.cached_tokens)
    got = ratios(prompts, cached)
    assert all(x >= 0.95 for x in got), f"reuse per turn {got} (prompts {prompts}, cached {cached})"


@pytest.mark.parametrize("golden,template", [
    ("qwen35", "Qwen3.5-4B.jinja"),
    ("gemma4_chat", "google-gemma-4-31B-it.jinja"),
])
def test_turns_reuse_the_last_one_across_an_ssd_restore(tmp_path, golden, template):
    """The conversation goes on after a restart: the SSD tier's entries serve the next turn."""
    shutil.copytree(GOLDENS / golden, tmp_path / "m")
    shutil.copy(TEMPLATES / template, tmp_path / "m" / "chat_template.jinja")
    args = [str(tmp_path / "m"), "--model-id", "agent", "--ssd-cache", str(tmp_path / "ssd")]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Find the failing test and fix it."}]
    prompts, cached = [], []
    for turn in range(4):
        # A fresh process for every turn: only the SSD tier remembers the last one.
        server = WickServer(*args)
        try:
            r = server.client().chat.completions.create(
                model="agent", messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
        finally:
            assert server.stop() == 0, server.logs()
        prompts.append(r.usage.prompt_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or "ok"})
        messages.append({"role": "user", "content": tool_output(turn)})
    got = ratios(prompts, cached)
    assert all(x >= 0.95 for x in got), f"reuse per turn {got} (prompts {prompts}, cached {cached})"
