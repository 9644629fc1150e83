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


# A tool whose schema the unconstrained model gets wrong: it writes the city's name, not
# its IATA code, and a unit outside the enum.
AIRPORT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather at an airport.",
        "parameters": {
            "type": "object",
            "properties": {
                "airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "unit": {"enum": ["celsius_degrees", "fahrenheit_degrees"]},
            },
            "required": ["airport", "unit"],
        },
    },
}


def weather_call(qwen, strict, content="What is the weather in Paris right now, in celsius?"):
    tool = json.loads(json.dumps(AIRPORT_WEATHER))
    tool["function"]["strict"] = strict
    return qwen.chat.completions.create(
        model="qwen2.5-coder-0.5b-instruct",
        messages=[{"role": "user", "content": content}],
        tools=[tool, TIME],
        max_tokens=96,
        temperature=0,
    ).choices[0]


def test_strict_tools_constrain_calls_under_auto(qwen):
    free = weather_call(qwen, strict=False)
    assert free.message.tool_calls, free
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(free.message.tool_calls[0].function.arguments),
                            AIRPORT_WEATHER["function"]["parameters"])
    strict = weather_call(qwen, strict=True)
    assert strict.finish_reason == "tool_calls", strict
    call = strict.message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, AIRPORT_WEATHER["function"]["parameters"])
    assert set(args) == {"airport", "unit"}, "strict: no properties outside the schema"


def test_strict_tools_leave_free_text_free(qwen):
    # No call wanted: the reply is the same text as without the constraint.
    prompt = "Reply with one short sentence about cats. Do not call any tool."
    free = weather_call(qwen, strict=False, content=prompt)
    strict = weather_call(qwen, strict=True, content=prompt)
    assert not strict.message.tool_calls, strict
    assert strict.message.content and strict.message.content == free.message.content


# Codex CLI's custom tools (Responses API): a Lark grammar format, as apply_patch has.
PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk
add_hunk: "*** Add File: " filename LF add_line+
filename: /(.+)/
add_line: "+" /(.*)/ LF
LF: "\n"
'''
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Edit files with a patch in the apply_patch format.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK}}
TICKET = {"type": "custom", "name": "open_ticket", "description": "Open a ticket by its code.",
          "format": {"type": "grammar", "syntax": "regex", "definition": "[A-Z]{3}-[0-9]{4}"}}


def test_custom_tools_come_back_as_custom_tool_calls(qwen):
    r = qwen.responses.create(model="m", input="Create hello.txt containing the line: hi",
                              tools=[APPLY_PATCH], tool_choice={"type": "custom", "name": "apply_patch"},
                              max_output_tokens=160, temperature=0)
    calls = [o for o in r.output if o.type == "custom_tool_call"]
    assert calls and calls[0].name == "apply_patch", r.output
    # The grammar is regular, so it binds the input (PATCH_LARK as a regular expression).
    patch = r"\*\*\* Begin Patch\n(\*\*\* Add File: .+\n(\+.*\n)+)+\*\*\* End Patch\n?"
    assert r.status == "completed" and re.fullmatch(patch, calls[0].input), calls[0].input
    # The call and its output go back into the next turn.
    follow = qwen.responses.create(model="m", input=[
        {"type": "message", "role": "user", "content": "Create hello.txt"},
        {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "apply_patch", "input": calls[0].input},
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done."},
    ], tools=[APPLY_PATCH], max_output_tokens=16, temperature=0)
    assert follow.status in ("completed", "incomplete")


def test_a_regex_custom_tool_constrains_its_input(qwen):
    r = qwen.responses.create(model="m", input="Open a ticket for the printer being broken.",
                              tools=[TICKET], tool_choice={"type": "custom", "name": "open_ticket"},
                              max_output_tokens=64, temperature=0)
    call = [o for o in r.output if o.type == "custom_tool_call"][0]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", call.input), call.input


def test_a_streamed_custom_call_sends_its_input(qwen):
    with qwen.responses.stream(model="m", input="Open a ticket for the printer being broken.",
                               tools=[TICKET], tool_choice={"type": "custom", "name": "open_ticket"},
                               max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(done) == 1 and re.fullmatch(r"[A-Z]{3}-[0-9]{4}", done[0].input), events
    assert "response.function_call_arguments.delta" not in [e.type for e in events]
    items = [e.item for e in events if e.type == "response.output_item.done"]
    assert items[-1].type == "custom_tool_call" and items[-1].input == done[0].input


def test_a_bad_custom_grammar_is_400(qwen):
    bad = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: foo("}}
    with pytest.raises(openai.BadRequestError) as e:
        qwen.responses.create(model="m", input="x", tools=[bad], max_output_tokens=4)
    assert e.value.body["param"] == "tools[0].format.definition", e.value.body


# Issue 45: grammars that compile but cannot be served are the client's error, never a 500.
# 3000 alternatives that start alike: the first token mask over Qwen's 152k vocabulary needs
# more parser items than llguidance allows (step_max_items), so the request is refused before
# it runs.
WIDE_LARK = ("start: " + " | ".join(f"r{i}" for i in range(3000)) + "\n"
             + "\n".join(f'r{i}: "a" r{i} | "b{i}"' for i in range(3000)) + "\n")


def test_a_grammar_whose_first_step_hits_a_limit_is_400(qwen):
    wide_tool = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": WIDE_LARK}}
    calls = [
        ("structured_outputs.grammar", lambda: qwen.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
            extra_body={"structured_outputs": {"grammar": WIDE_LARK}})),
        ("guided_grammar", lambda: qwen.completions.create(
            model="m", prompt="x", max_tokens=4, extra_body={"guided_grammar": WIDE_LARK})),
        ("tools[0].format.definition", lambda: qwen.responses.create(
            model="m", input="x", tools=[wide_tool], max_output_tokens=4)),
    ]
    for param, call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        err = e.value.body
        assert err["code"] == "grammar_failed" and err["param"] == param, err
        assert "step_max_items" in err["message"], err


# Every branch starts with `[`: the parser row after it holds more items than llguidance's
# max_items_in_row, a limit found only while generating.
AMBIGUOUS = {"anyOf": [{"type": "array", "items": {"const": i}} for i in range(1200)]}


def test_a_grammar_that_hits_a_limit_mid_stream_ends_the_stream_with_a_client_error(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": AMBIGUOUS}}
    with pytest.raises(openai.APIError) as e:
        for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=32, temperature=0, stream=True,
                                                response_format=fmt):
            pass
    assert not isinstance(e.value, openai.InternalServerError)
    assert e.value.body["code"] == "grammar_failed", e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    assert "max_items_in_row" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=32, temperature=0, response_format=fmt)
    assert e.value.body["code"] == "grammar_failed", e.value.body
