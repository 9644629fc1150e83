"""Tool calling over HTTP with the real Qwen2.5-Coder-0.5B-Instruct: a parsed call with the right
arguments (repaired when the model drops the <tool_call> tags), the tool result round-trips, and
a stream yields the same call."""
import json
import re

import pytest

from conftest import WEATHER

ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return qwen_server.client()


def ask(qwen, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", WEATHER)
    kw.setdefault("max_tokens", 48)
    return qwen.chat.completions.create(model="qwen2.5-coder-0.5b-instruct", temperature=0, **kw)


@pytest.fixture(scope="module")
def weather_reply(qwen):
    return ask(qwen)


def test_weather_call_is_parsed(weather_reply, qwen_server):
    choice = weather_reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1
    call = calls[0]
    assert re.fullmatch(r"call_[0-9a-f]{8}", call.id)
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None
    # This model often drops the <tool_call> tags: the repair is reported, logged and counted.
    repairs = (call.model_extra or {}).get("wick_repairs", [])
    with qwen_server.http() as h:
        metrics = h.get("/metrics").text
    assert re.search(r"wick_tool_calls_total [1-9]", metrics)
    for kind in repairs:
        assert re.search(rf'wick_tool_call_repairs_total{{kind="{kind}"}} [1-9]', metrics)
        assert "tool call repaired" in qwen_server.logs()


def test_stream_yields_the_same_call(qwen, weather_reply):
    whole = weather_reply.choices[0].message.tool_calls[0]
    calls, content, finish, repairs = {}, "", None, {}
    for chunk in ask(qwen, stream=True):
        # Repairs come in the finish chunk, top level (never as a call delta without
        # `function`, which client libraries' stream helpers reject).
        for entry in (chunk.model_extra or {}).get("wick_repairs", []):
            repairs[entry["index"]] = entry["repairs"]
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "", "repairs": []})
                if tc.id:
                    assert entry["id"] is None, "id sent twice"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                assert tc.function is not None, "a call delta without function"
                if tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
    assert finish == "tool_calls"
    assert list(calls) == [0]
    assert re.fullmatch(r"call_[0-9a-f]{8}", calls[0]["id"])
    assert calls[0]["name"] == whole.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)
    assert repairs.get(0, []) == (whole.model_extra or {}).get("wick_repairs", [])
    assert content == "", "markup leaked into content"


def test_sdk_stream_helper_assembles_the_call(qwen, weather_reply):
    # The openai SDK's stream() helper asserts that every tool-call delta has `function`.
    whole = weather_reply.choices[0].message.tool_calls[0]
    with qwen.chat.completions.stream(model="qwen2.5-coder-0.5b-instruct", temperature=0,
                                      messages=ASK, tools=WEATHER, max_tokens=48) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == whole.function.name
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)


def test_tool_result_round_trips(qwen, weather_reply):
    call = weather_reply.choices[0].message.tool_calls[0]
    # The assistant's call (arguments as a JSON string) and the tool's result are rendered
    # back through the chat template. Offered the tool again, this 0.5B model calls it again
    # instead of answering, so the follow-up offers no tools.
    messages = [{"role": "system", "content": "You are a helpful assistant. When a tool result is "
                 "available, answer the user in one sentence."}] + ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees Celsius."},
    ]
    r = ask(qwen, messages=messages, tools=None, max_tokens=32)
    choice = r.choices[0]
    assert not choice.message.tool_calls
    assert "21" in choice.message.content, choice.message.content
    assert "sunny" in choice.message.content.lower(), choice.message.content


def test_tool_choice_none_disables_parsing(qwen):
    r = ask(qwen, tool_choice="none", max_tokens=8)
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")


def test_call_cut_by_max_tokens_says_length(qwen):
    # The call is cut inside its arguments and repaired: still a cut reply.
    r = ask(qwen, max_tokens=12)
    choice = r.choices[0]
    assert choice.message.tool_calls, choice
    assert choice.finish_reason == "length", choice
    chunks = list(ask(qwen, max_tokens=12, stream=True))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_early_stop_on_one_call_reports_cached_tokens(qwen):
    # parallel_tool_calls=false ends the reply at the first complete call, before the engine
    # is done; its usage must still count the prompt tokens that came from the cache.
    ask(qwen, parallel_tool_calls=False)
    r = ask(qwen, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.prompt_tokens_details.cached_tokens > 0, r.usage
