"""Anthropic structured output: `output_config.format` (and the older `output_format`)
`{type: json_schema, schema}` constrains the answer to the schema, whole and streamed."""
import json

import pytest

from conftest import SMOLLM, _serve, require_model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server():
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve()


def post(server, body):
    with server.http() as h:
        return h.post("/v1/messages", json={"model": "claude-x", "max_tokens": 80, "messages": ASK,
                                            "temperature": 0, **body})


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_json_schema_answer_follows_the_schema(server, field):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    r = post(server, body)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["stop_reason"] == "end_turn"
    value = json.loads(msg["content"][0]["text"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_streamed_json_schema_answer(server):
    text = ""
    with server.http() as h:
        body = {"model": "claude-x", "max_tokens": 80, "messages": ASK, "stream": True,
                "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
        with h.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    e = json.loads(line[6:])
                    if e["type"] == "content_block_delta":
                        text += e["delta"]["text"]
    assert set(json.loads(text)) == {"name", "age"}


def test_bad_format_is_invalid_request(server):
    r = post(server, {"output_config": {"format": {"type": "json_schema"}}})
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema" in err["error"]["message"]
    r = post(server, {"output_config": {"format": {"type": "xml"}}})
    assert r.status_code == 400 and "output_config.format.type" in r.json()["error"]["message"]


def test_a_schema_that_hits_a_limit_mid_stream_ends_with_an_error_event(server):
    """Issue 45: every branch starts with `[`, so the parser row after it holds more items than
    llguidance's max_items_in_row: the stream ends with Anthropic's `error` event, not a 500."""
    anthropic = pytest.importorskip("anthropic")
    ambiguous = {"anyOf": [{"type": "array", "items": {"const": i}} for i in range(1200)]}
    c = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as e:
        with c.messages.stream(model="claude-x", max_tokens=32, messages=ASK,
                               extra_body={"temperature": 0,
                                           "output_format": {"type": "json_schema", "schema": ambiguous}}) as s:
            for _ in s:
                pass
    assert e.value.body["error"]["type"] == "invalid_request_error", e.value.body
    assert "max_items_in_row" in e.value.body["error"]["message"]
