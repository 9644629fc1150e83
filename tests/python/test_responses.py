"""OpenAI Responses API (`/v1/responses`) driven by the official `openai` SDK: text, the
stream helper's events, `previous_response_id` chains through the in-memory store, GET and
DELETE, function calls and their outputs, and the errors."""
import json

import httpx
import openai
import pytest

from conftest import SMOLLM, WEATHER_RESPONSES as WEATHER, _serve, require_model

SHORT = 12


@pytest.fixture(scope="module")
def server():
    """A SmolLM2 server of this module's own: its prompt cache does not leak into the
    session server other files check `cached_tokens` on."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve()


@pytest.fixture(scope="module")
def client(server):
    return server.client()

def test_text_response(client):
    r = client.responses.create(model="gpt-5", input="Say hello.", instructions="Be brief.",
                                max_output_tokens=SHORT, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= SHORT
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_stream_helper_events(client):
    with client.responses.stream(model="gpt-5", input=[
            {"role": "developer", "content": "Answer in English."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Count to five."}]}],
            max_output_tokens=SHORT, temperature=0) as stream:
        kinds, deltas = [], []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = event.response
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress"
    # Cut by max_output_tokens, the stream ends with response.incomplete.
    assert kinds[-1] == {"completed": "response.completed", "incomplete": "response.incomplete"}[final.status]
    order = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
             "response.output_text.done", "response.output_item.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
    assert final.output_text == "".join(deltas)
    assert final.usage.output_tokens > 0


def test_previous_response_id_chain_get_and_delete(client):
    first = client.responses.create(model="m", input="My name is Ada. Reply with OK.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    # The follow-up's prompt starts with the first turn: its prefix comes from the cache.
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_unstored_responses_are_not_kept(client):
    r = client.responses.create(model="m", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_bad_input_is_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}], max_output_tokens=2)
    # The text model has no vision tower: the error names the part where the client wrote it.
    assert e.value.body["param"] == "input[0].content[0].type"
    assert "vision tower" in e.value.body["message"]


def test_other_tool_types_are_tolerated(client):
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2,
                                tools=[{"type": "web_search"}, WEATHER],
                                reasoning={"effort": "low"}, parallel_tool_calls=False)
    assert r.status in ("completed", "incomplete")


def test_text_format_json_schema_and_forced_calls(client):
    # Responses' flat text.format and tool_choice go through the same constrained decoding
    # as chat's response_format and forced calls.
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    r = client.responses.create(model="gpt-5", input="Describe a person as JSON.", max_output_tokens=60,
                                temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                "schema": schema, "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), r.output_text
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(model="gpt-5", input="Say hello.", max_output_tokens=48, temperature=0,
                                    tools=[WEATHER], tool_choice=choice)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and calls[0].name == "get_weather", (choice, r.output)
        assert isinstance(json.loads(calls[0].arguments)["city"], str)


def test_overlong_prompt_streams_response_failed(server):
    long = " ".join(f"w{i}" for i in range(20000))
    with httpx.Client(base_url=server.base, timeout=120) as h:
        with h.stream("POST", "/v1/responses", json={"model": "m", "input": long, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return qwen_server.client(timeout=120)


def test_function_call_round_trip(qwen):
    first = qwen.responses.create(model="m", input="What is the weather in Paris? Use the get_weather tool.",
                                  tools=[WEATHER], max_output_tokens=64, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", first.output
    assert "paris" in json.loads(calls[0].arguments)["city"].lower()
    # Offered the tool again, this 0.5B model calls it again instead of answering (as in
    # test_tools.py), so the follow-up offers none.
    second = qwen.responses.create(model="m", previous_response_id=first.id,
                                   instructions="You are a helpful assistant. When a tool result is "
                                                "available, answer the user in one sentence.",
                                   input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                           "output": "Sunny, 22 C"}],
                                   max_output_tokens=32, temperature=0)
    assert "22" in second.output_text or "sunny" in second.output_text.lower(), second.output_text


def test_streamed_function_call(qwen):
    with qwen.responses.stream(model="m", input="What is the weather in Paris? Use the get_weather tool.",
                               tools=[WEATHER], max_output_tokens=64, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    call = [o for o in final.output if o.type == "function_call"][0]
    assert "paris" in json.loads(call.arguments)["city"].lower()
