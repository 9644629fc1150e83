"""Every client error answers in OpenAI's shape with the right status, and never a 5xx."""
import httpx
import openai
import pytest

from conftest import WickServer, free_port, ensure_binary, SMOLLM, require_model

MSG = [{"role": "user", "content": "Hi"}]


def assert_error(response: httpx.Response, status: int, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, body
    if code is not None:
        assert err["code"] == code, body
    return err


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


def post_chat(http, **body):
    body.setdefault("messages", MSG)
    body.setdefault("max_tokens", 2)
    return http.post("/v1/chat/completions", json=body)


def test_invalid_json(http):
    for raw in [b"{", b"not json", b"", b'{"messages": [}', b"[1,2]", b'{"messages": []} trailing']:
        r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": "3", "logprobs": True}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": ["hi"]}, "messages[0]"),
])
def test_wrong_types(http, body, param):
    assert_error(post_chat(http, **body), 400, param=param)


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 3}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_out_of_range(http, body, param):
    assert_error(post_chat(http, **body), 400, param=param)


def test_n_greater_than_one_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MSG, n=3, max_tokens=2)
    assert "n = 1" in str(e.value) or "n=1" in str(e.value)


def test_empty_and_missing_messages(http):
    assert_error(post_chat(http, messages=[]), 400, param="messages")
    assert_error(http.post("/v1/chat/completions", json={"max_tokens": 2}), 400, param="messages")


def test_context_overflow_is_refused_not_truncated(http, server):
    ctx = server.stats()["server"]["context_length"]
    assert_error(post_chat(http, max_tokens=ctx + 1), 400, code="context_length_exceeded")
    long_text = "hello " * (ctx + 100)
    assert_error(post_chat(http, messages=[{"role": "user", "content": long_text}]), 400,
                 code="context_length_exceeded")
    r = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
    assert_error(r, 400, param="prompt", code="context_length_exceeded")


def test_unsupported_features(http):
    # Forced calls and schemas work (test_structured.py); what they cannot do is a 400.
    assert_error(post_chat(http, tool_choice="required"), 400, param="tool_choice")
    assert_error(post_chat(http, tool_choice={"type": "function", "function": {"name": "g"}},
                           tools=[{"type": "function", "function": {"name": "f"}}]), 400, param="tool_choice")
    assert_error(post_chat(http, response_format={"type": "json_schema", "json_schema": {"schema": 5}}), 400,
                 param="response_format.json_schema.schema")
    assert_error(post_chat(http, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400)
    assert_error(post_chat(http, tools=[{"type": "function", "function": {"description": "no name"}}]), 400,
                 param="tools[0]")


def test_completion_errors(http):
    for body, param in [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -1]}, "prompt[1]"),
        ({"prompt": [99999999]}, "prompt[0]"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
    ]:
        body.setdefault("max_tokens", 2)
        assert_error(http.post("/v1/completions", json=body), 400, param=param)


def test_unknown_route_and_model(http):
    assert_error(http.get("/v1/nope"), 404, code="route_not_found")
    assert_error(http.post("/v2/chat/completions", json={}), 404)
    assert_error(http.get("/v1/models/not-a-model"), 404, code="model_not_found")


def test_wrong_method(http):
    assert_error(http.get("/v1/chat/completions"), 405, code="method_not_allowed")
    assert_error(http.post("/v1/models", json={}), 405)
    assert_error(http.delete("/health"), 405)


def test_no_input_is_a_server_error(http):
    bodies = [
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]},
        {"messages": [{"role": "tool", "content": "r"}], "tools": "x"},
        {"messages": MSG, "stop": [1, 2]},
        {"messages": MSG, "stream_options": 5},
        {"messages": MSG, "chat_template_kwargs": []},
        {"messages": MSG, "chat_template_kwargs": {"enable_thinking": "maybe"}},
        {"messages": MSG, "temperature": 1e300},
        {"messages": MSG, "seed": 1.5},
        {"messages": MSG, "seed": -5, "temperature": 1},
        {"messages": MSG, "logit_bias": []},
        {"messages": MSG, "tools": [1]},
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
        {"messages": [{"role": "user", "content": "\u0000\ud7ff"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
                      {"role": "tool", "content": "x"}]},
        {"messages": MSG, "response_format": "text"},
        {"messages": MSG, "tool_choice": 7},
    ]
    for body in bodies:
        body.setdefault("max_tokens", 2)
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            assert_error(r, r.status_code)


def test_auth_and_body_limit():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--max-body-bytes", "2048", api_key="sekret",
                   env={"WICK_MAX_QUEUE": "5", "WICK_MODEL_ID": "from-env"})
    try:
        stats = s.stats()  # flags also read WICK_* variables
        assert stats["queue"]["limit"] == 5 and stats["server"]["model"] == "from-env"
        with httpx.Client(base_url=s.base, timeout=30, headers={"Authorization": "Bearer sekret"}) as h:
            big = b'{"messages": [{"role": "user", "content": "' + b"a" * 3000 + b'"}]}'
            assert_error(h.post("/v1/chat/completions", content=big,
                                headers={"content-type": "application/json"}), 413, code="payload_too_large")
            assert h.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}).status_code == 200
        with httpx.Client(base_url=s.base, timeout=30) as h:
            assert h.get("/health").status_code == 200  # health stays open
            for path in ["/v1/models", "/v1", "/stats", "/metrics"]:
                err = assert_error(h.get(path), 401, code="invalid_api_key")
                assert err["type"] == "authentication_error"
            assert_error(h.post("/v1/chat/completions", json={"messages": MSG}), 401)
            assert_error(h.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
            assert h.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = s.client().chat.completions.create(model="m", messages=MSG, max_tokens=2)
        assert ok.choices[0].message.content is not None
    finally:
        assert s.stop() == 0


def test_busy_port_is_a_clear_startup_error(server):
    import subprocess
    r = subprocess.run([str(ensure_binary()), "serve", "--port", str(server.port)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "cannot listen" in r.stderr and "already" in r.stderr.lower(), r.stderr
