"""Gemma 4 end to end: the tiny Gemma 4 model (PLE, KV sharing) served from its safetensors
directory with Gemma 4's real chat template, its tool-call format and its reasoning channel.

The model is crates/wick-engine/tests/goldens/hf/gemma4_chat (scripts/goldens/hf_tiny_gemma4.py):
its weights make greedy decoding after the generation prompt write
`<|channel>thought\\nThe user wants the forecast.<channel|><|tool_call>call:get_weather{days:3}<tool_call|>`
then `<eos>` (transformers' generate checked that). The template comes from llama.cpp's test
assets (`wick pull test-assets`)."""
import json
import shutil

import pytest

from conftest import ROOT, WICK_HOME, _serve

MODEL = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "gemma4_chat"
TEMPLATE = WICK_HOME / "assets" / "llama.cpp" / "templates" / "google-gemma-4-31B-it.jinja"
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}},
                       "required": ["days"]},
    },
}]
MSG = [{"role": "user", "content": "Weather?"}]
REASONING = "The user wants the forecast."


@pytest.fixture(scope="module")
def gemma4_server(tmp_path_factory):
    if not TEMPLATE.is_file():
        pytest.fail(f"{TEMPLATE} is missing: run `wick pull test-assets`")
    d = tmp_path_factory.mktemp("gemma4") / "gemma4-tiny"
    shutil.copytree(MODEL, d)
    shutil.copy(TEMPLATE, d / "chat_template.jinja")
    yield from _serve(str(d), "--model-id", "gemma4-tiny")


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content")


def test_model_is_listed(gemma4_server):
    models = gemma4_server.client().models.list()
    assert [m.id for m in models.data] == ["gemma4-tiny"]


def test_tool_call_and_reasoning_channel(gemma4_server):
    client = gemma4_server.client()
    r = client.chat.completions.create(model="gemma4-tiny", messages=MSG, tools=TOOLS,
                                       max_tokens=32, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", r
    assert reasoning_of(choice.message) == REASONING, r
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"days": 3}
    # <|channel> thought reasoning <channel|> <|tool_call> call <tool_call|>, then <eos>.
    assert r.usage.completion_tokens in (7, 8)
    assert r.usage.prompt_tokens > 20


def test_streamed_tool_call_and_reasoning(gemma4_server):
    client = gemma4_server.client()
    reasoning, content, args, names, finish = "", "", "", [], None
    for chunk in client.chat.completions.create(
            model="gemma4-tiny", messages=MSG, tools=TOOLS, max_tokens=32, temperature=0,
            stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}}):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.function and t.function.name:
                    names.append(t.function.name)
                args += (t.function.arguments or "") if t.function else ""
            finish = c.finish_reason or finish
    assert reasoning == REASONING
    assert content == ""
    assert names == ["get_weather"]
    assert json.loads(args) == {"days": 3}
    assert finish == "tool_calls"


def test_thinking_off_closes_the_channel_in_the_prompt(gemma4_server):
    # Without enable_thinking the template writes an empty thought channel itself; the
    # model then goes straight to the call and no reasoning comes back.
    client = gemma4_server.client()
    r = client.chat.completions.create(model="gemma4-tiny", messages=MSG, tools=TOOLS,
                                       max_tokens=32, temperature=0)
    choice = r.choices[0]
    assert not reasoning_of(choice.message)
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"days": 3}
    # <|tool_call> call <tool_call|>, then <eos>.
    assert r.usage.completion_tokens in (3, 4)
