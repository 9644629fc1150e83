"""Qwen 3.5 (gated DeltaNet hybrid) through the server: the tiny random-weight golden model
(crates/wick-engine/tests/goldens/hf/qwen35) with Qwen3.5-4B's real chat template from the
llama.cpp test assets (`wick pull test-assets`): the template renders tools and tool turns,
a call in the qwen3-coder XML format comes back parsed into tool_calls, the thinking block splits
into reasoning_content, and a prompt that extends a cached one reuses the DeltaNet state at
the exact boundary."""
import json

import pytest

from conftest import ROOT, WICK_HOME, _serve

MODEL = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "qwen35"
TEMPLATE = WICK_HOME / "assets" / "llama.cpp" / "templates" / "Qwen3.5-4B.jinja"

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}]


@pytest.fixture(scope="module")
def qwen35():
    if not TEMPLATE.is_file():
        pytest.fail(f"{TEMPLATE} is missing: run `wick pull test-assets`")
    yield from _serve(str(MODEL), "--chat-template", str(TEMPLATE), "--model-id", "qwen35-tiny")


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content")


CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_a_qwen_xml_call_parses_into_tool_calls(qwen35):
    # A random model writes no call by itself: a regex constraint makes it write one in the
    # qwen3-coder XML format its template teaches, and the reply parser must read it back.
    client = qwen35.client()
    r = client.chat.completions.create(
        model="qwen35-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, max_tokens=300, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                    "guided_regex": CALL.replace("\n", "\\n")})
    choice = r.choices[0]
    assert choice.message.tool_calls, r
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content


def test_tool_turns_render_and_thinking_splits(qwen35):
    client = qwen35.client()
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    # Thinking on (the template's default opens <think>): the random model never closes it,
    # so everything it writes is reasoning.
    r = client.chat.completions.create(model="qwen35-tiny", messages=history, tools=TOOLS,
                                       max_tokens=12, temperature=0)
    msg = r.choices[0].message
    assert reasoning_of(msg), r
    assert not msg.content
    assert r.usage.prompt_tokens > 50
    # Thinking off: the template writes an empty think block and the text is content.
    r = client.chat.completions.create(
        model="qwen35-tiny", messages=history, tools=TOOLS, max_tokens=12, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content
    assert not reasoning_of(r.choices[0].message)


def test_an_extended_prompt_reuses_the_recurrent_state_at_the_boundary(qwen35):
    client = qwen35.client()
    # Long enough (> 256 tokens) to earn a prompt-boundary entry.
    base = " ".join(["The river ran slowly past the mill, and the miller watched the water."] * 24)
    first = client.completions.create(model="qwen35-tiny", prompt=base, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 256
    longer = base + "\nQuestion: What is the capital of France? Answer:"
    second = client.completions.create(model="qwen35-tiny", prompt=longer, max_tokens=4,
                                       temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= first.usage.prompt_tokens, second.usage
    # The continuation on the reused state equals a recompute without any cache.
    fresh = _serve(str(MODEL), "--chat-template", str(TEMPLATE), "--model-id", "qwen35-tiny",
                   "--prompt-cache", "0")
    server = next(fresh)
    try:
        cold = server.client().completions.create(model="qwen35-tiny", prompt=longer, max_tokens=4,
                                                   temperature=0)
    finally:
        next(fresh, None)
    assert cold.usage.prompt_tokens_details is None or not cold.usage.prompt_tokens_details.cached_tokens
    assert cold.choices[0].text == second.choices[0].text
