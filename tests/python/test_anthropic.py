"""Anthropic Messages API (`/v1/messages`) driven by the official `anthropic` SDK: text,
the stream helper's event order, tool round trips streamed and not, count_tokens, the error
shape and statuses, `x-api-key` auth, and prompt caching across Claude Code's changing
`cch=` attribution line."""
import json

import anthropic
import httpx
import pytest

from conftest import QWEN, SMOLLM, WEATHER_ANTHROPIC as WEATHER, WickServer, _serve, require_model

SHORT = 12
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now? Use the get_weather tool."}]



@pytest.fixture(scope="module")
def server():
    """A SmolLM2 server of this module's own: its prompt cache does not leak into the
    session server other files check `cached_tokens` on."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve()


@pytest.fixture(scope="module")
def client(server):
    return server.client()

def claude(server: WickServer, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=server.api_key or "none", max_retries=0, **kw)


@pytest.fixture(scope="module")
def small_ctx_server():
    require_model(SMOLLM, "smollm2-135m-instruct")
    server = WickServer("--ctx-size", "256")
    yield server
    assert server.stop() == 0, server.logs()


@pytest.fixture(scope="module")
def keyed_server():
    require_model(SMOLLM, "smollm2-135m-instruct")
    server = WickServer(api_key="sekrit")
    yield server
    assert server.stop() == 0, server.logs()


def test_text_message(server):
    msg = claude(server).messages.create(
        model="claude-opus-4-1", max_tokens=SHORT, extra_body={"temperature": 0},
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Say hello."}],
        metadata={"user_id": "u1"},
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.id.startswith("msg_")
    assert msg.content and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= SHORT
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0


def test_stream_helper_sees_events_in_order(server):
    kinds, text = [], []
    with claude(server).messages.stream(
        model="claude-3-5-haiku-latest", max_tokens=SHORT, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Count from one to ten."}],
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text.append(event.delta.text)
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]
    assert raw[0] == "message_start" and raw[-1] == "message_stop"
    assert raw[-2] == "message_delta"
    assert raw.index("content_block_start") < raw.index("content_block_delta") < raw.index("content_block_stop")
    assert raw.count("content_block_start") == raw.count("content_block_stop")
    assert final.content[0].text == "".join(text)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_raw_stream_has_one_start_per_block_index(server):
    with httpx.Client(base_url=server.base, timeout=60) as h:
        with h.stream("POST", "/v1/messages?beta=true", json={
            "model": "claude", "max_tokens": SHORT, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]},
            headers={"anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2025"}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    started = set()
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(started)
            started.add(e["index"])
        elif e["type"] == "content_block_delta":
            assert e["index"] in started
    assert events[-1]["type"] == "message_stop"


def test_count_tokens_matches_the_message_usage(server):
    c = claude(server)
    kw = dict(system="You count tokens precisely. Unique 7d1f.",
              messages=[{"role": "user", "content": "How many tokens is this sentence, exactly?"}])
    counted = c.messages.count_tokens(model="claude", **kw)
    msg = c.messages.create(model="claude", max_tokens=2, **kw)
    assert counted.input_tokens > 10
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_client_errors_have_anthropic_shape(server):
    c = claude(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="claude", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "vision tower" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="claude", max_tokens=4, tool_choice={"type": "tool"}, tools=[WEATHER],
                          messages=[{"role": "user", "content": "x"}])
    assert "names the tool" in e.value.body["error"]["message"]
    with httpx.Client(base_url=server.base, timeout=30) as h:
        r = h.post("/v1/messages", json={"model": "claude", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]
        r = h.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = h.get("/v1/messages/nope")
        assert r.status_code in (404, 405) and r.json()["type"] == "error"


def test_prompt_over_the_context_is_prompt_too_long(small_ctx_server):
    long = " ".join(f"word{i}" for i in range(600))
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(small_ctx_server).messages.create(
            model="claude", max_tokens=16000, messages=[{"role": "user", "content": long}])
    message = e.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 256 maximum"), message
    # A large max_tokens with a prompt that fits is capped, not refused (Claude Code sends 32000; the SDK refuses more than about 21k unstreamed).
    msg = claude(small_ctx_server).messages.create(
        model="claude", max_tokens=16000, messages=[{"role": "user", "content": "Hi"}], stop_sequences=["."])
    assert msg.usage.output_tokens > 0


def test_x_api_key_and_bearer_are_accepted(keyed_server):
    msg = claude(keyed_server).messages.create(
        model="claude", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert msg.usage.output_tokens > 0
    bearer = anthropic.Anthropic(base_url=keyed_server.base, auth_token="sekrit", max_retries=0)
    assert bearer.messages.create(model="claude", max_tokens=2,
                                  messages=[{"role": "user", "content": "Hi"}]).content is not None
    wrong = anthropic.Anthropic(base_url=keyed_server.base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="claude", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"


def test_changing_cch_attribution_keeps_the_prefix_cached(server):
    c = claude(server)
    doc = " ".join(f"Rule {i}: always check file {i} before editing module {i % 5}." for i in range(40))

    def turn(cch: str):
        return c.messages.create(model="claude", max_tokens=2, extra_body={"temperature": 0}, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.1.a1b; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": "You are a coding agent.\n" + doc},
        ], messages=[{"role": "user", "content": "Which file first?"}])

    first = turn("3fa91")
    second = turn("b07c2")
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= total * 0.8, second.usage


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return claude(qwen_server, timeout=120)


def test_tool_round_trip(qwen):
    first = qwen.messages.create(model="claude", max_tokens=64, extra_body={"temperature": 0}, tools=[WEATHER], messages=ASK_WEATHER)
    assert first.stop_reason == "tool_use", first
    use = [b for b in first.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    history = ASK_WEATHER + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "Sunny, 22 C"}]}]},
    ]
    # Offered the tool again, this 0.5B model calls it again instead of answering (as in
    # test_tools.py), so the follow-up offers none.
    second = qwen.messages.create(model="claude", max_tokens=32, extra_body={"temperature": 0}, messages=history,
                                  system="You are a helpful assistant. When a tool result is available, "
                                         "answer the user in one sentence.")
    assert second.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in second.content if b.type == "text")
    assert "22" in text or "sunny" in text.lower(), text


def test_streamed_tool_use_accumulates_input(qwen):
    with qwen.messages.stream(model="claude", max_tokens=64, extra_body={"temperature": 0}, tools=[WEATHER],
                              messages=ASK_WEATHER) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert "paris" in use.input["city"].lower()
    assert "input_json" in kinds or "content_block_delta" in kinds


def test_tool_choice_any_and_tool_force_a_call(qwen):
    # A question that needs no tool still gets a call: decoding is constrained to one.
    ask = [{"role": "user", "content": "Say hello."}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = qwen.messages.create(model="claude", max_tokens=48, extra_body={"temperature": 0},
                                 tools=[WEATHER], tool_choice=choice, messages=ask)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and uses, (choice, r)
        assert uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str), r


def test_models_answer_both_sdks(server, client):
    listed = claude(server).models.list()
    assert listed.data[0].id == client.models.list().data[0].id
    assert listed.data[0].type == "model" and listed.data[0].created_at.year >= 2024
    assert listed.has_more is False
    with httpx.Client(base_url=server.base, timeout=30) as h:
        assert h.get("/v1/models", params={"client_version": "0.171.0"}).status_code == 200
