"""Structured output by constrained decoding, through the official OpenAI SDK: JSON schemas
(nested objects, enums, anyOf, $ref, patterns, formats, bounded arrays) on SmolLM2 give replies
that parse and validate, json_object gives an object, vLLM's regex / choice / grammar fields
hold on chat and /v1/completions, bad grammars are 400s with llguidance's message, and forced
tool calls on Qwen2.5-Coder come back parsed."""
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "smollm2-135m-instruct"

SCHEMAS = {
    "nested_enum": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                },
                "required": ["name", "role"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "ref_and_bounded_array": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}
        },
        "required": ["points"],
    },
    "any_of_pattern_format": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "when": {"type": "string", "format": "date"},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
        },
        "required": ["id", "when", "value"],
    },
}


def chat(client, prompt, max_tokens=96, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_replies_validate(client, name):
    schema = SCHEMAS[name]
    reply = chat(
        client,
        "Give an example as JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    # strict: no property outside the schema anywhere.
    if name == "nested_enum":
        assert set(value) <= {"user", "active"} and set(value["user"]) <= {"name", "role"}


def test_json_object(client):
    reply = chat(
        client, 'Reply with a JSON object like {"name": "Tom"} for a cat.', max_tokens=128,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0]
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_pydantic_parse(client):
    class City(BaseModel):
        name: str
        population: int

    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A city and its population."}],
        response_format=City,
        max_tokens=64,
        temperature=0,
    )
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_vllm_regex_choice_and_grammar(client):
    phone = chat(client, "A phone number.", extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].message.content)
    pick = chat(client, "Is the sky green?", extra_body={"guided_choice": ["yes", "no"]})
    assert pick.choices[0].message.content in ("yes", "no")
    grammar = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"\n'
    g = chat(client, "A color.", extra_body={"structured_outputs": {"grammar": grammar}})
    assert g.choices[0].message.content in ("color: red", "color: green", "color: blue")


def test_completions_take_vllm_fields(client):
    out = client.completions.create(
        model=MODEL, prompt="The year was", max_tokens=8, temperature=0,
        extra_body={"guided_regex": r" [12][0-9]{3}\."},
    )
    assert re.fullmatch(r" [12][0-9]{3}\.", out.choices[0].text)


def test_streamed_constrained_reply(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=8,
        temperature=0, stream=True, extra_body={"guided_choice": ["yes", "no"]},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes", "no")


def test_unfinished_at_max_tokens_is_length(client):
    reply = chat(client, "Say a.", max_tokens=4, extra_body={"guided_regex": "a{40}"})
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: foo("}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_constraints_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=body,
        )
    err = e.value.body
    assert err["param"] == param, err
    assert err["message"], err


# Forced tool calls on Qwen2.5-Coder.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return qwen_server.client()


@pytest.mark.parametrize("tool_choice, name", [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
])
def test_forced_tool_calls_are_parsed(qwen, tool_choice, name):
    reply = qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b-instruct",
        messages=[{"role": "user", "content": "Hello! How are you today?"}],
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    if name:
        assert call.function.name == name
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert not (call.model_extra or {}).get("wick_repairs"), call
