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
