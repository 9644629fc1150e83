"""Streamed tool calls through three real client libraries: the openai SDK's
`chat.completions.stream()` helper, LiteLLM (`completion(stream=True)` and
`stream_chunk_builder`) and `llm` (an OpenAI-compatible model from `extra-openai-models.yaml`,
prompted with a tool). Each must assemble, from wick's stream, the same call as the
non-streamed reply, with Qwen2.5-Coder (whose calls need a repair) at temperature 0.

A fake server replays wick's own stream twice: as wick sends it now (repairs in a top-level
`wick_repairs` field of the finish chunk) and as it did before (repairs in a call delta
without `function`). The first must work with every client; the second makes the openai
helper and `llm` raise and LiteLLM log a validation error and drop that delta, so the live
tests would catch that shape coming back.

No traffic may leave loopback: importing and using the clients runs under a guard that
refuses (and records) any other destination, and LiteLLM reads its bundled model cost map."""
import contextlib
import copy
import ipaddress
import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from conftest import WEATHER

MODEL = "qwen2.5-coder-0.5b-instruct"
QUESTION = "What is the weather like in Paris right now?"
ASK = [{"role": "user", "content": QUESTION}]
SAMPLING = {"temperature": 0, "max_tokens": 48}

# Attempts to reach anything but loopback, as (call, destination).
OUTSIDE: list[tuple[str, object]] = []


def _is_loopback(host) -> bool:
    if host in ("localhost", "localhost.", "", None):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def loopback_only():
    """Refuse and record name look-ups and connections to anything but loopback."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def check(call, sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            OUTSIDE.append((call, address))
            raise ConnectionRefusedError(f"test guard: {address} is not loopback")

    def guarded_connect(self, address):
        check("connect", self, address)
        return connect(self, address)

    def guarded_connect_ex(self, address):
        check("connect_ex", self, address)
        return connect_ex(self, address)

    def guarded_getaddrinfo(host, *args, **kw):
        if not _is_loopback(host.decode() if isinstance(host, bytes) else host):
            OUTSIDE.append(("getaddrinfo", host))
            raise socket.gaierror(socket.EAI_NONAME, f"test guard: {host} is not loopback")
        return getaddrinfo(host, *args, **kw)

    socket.socket.connect, socket.socket.connect_ex = guarded_connect, guarded_connect_ex
    socket.getaddrinfo = guarded_getaddrinfo
    try:
        yield
    finally:
        socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
        socket.getaddrinfo = getaddrinfo


# LiteLLM fetches its model cost map from the network at import unless told to use the copy
# it ships; `llm` loads no third-party plugins with an empty LLM_LOAD_PLUGINS.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LLM_LOAD_PLUGINS"] = ""
with loopback_only():
    import litellm
    import llm
litellm.suppress_debug_info = True
# LiteLLM's own types warn when pydantic builds their schemas; nothing of wick's.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")


@pytest.fixture(autouse=True, scope="module")
def guard():
    with loopback_only():
        yield


@pytest.fixture(autouse=True)
def no_outside_traffic(guard):
    yield
    assert not OUTSIDE, f"traffic beyond loopback: {OUTSIDE}"


# --- the three clients, each returning the one call it assembled as (name, arguments) ---

def via_openai_helper(base: str) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    done = []
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=WEATHER, **SAMPLING) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.done":
                done.append((event.name, json.loads(event.arguments)))
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert done == calls, "the helper's done events disagree with its final completion"
    assert len(calls) == 1, calls
    return calls[0]


def via_litellm(base: str) -> tuple[str, dict]:
    chunks = list(litellm.completion(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="none",
                                     messages=ASK, tools=WEATHER, stream=True, num_retries=0,
                                     **SAMPLING))
    built = litellm.stream_chunk_builder(chunks, messages=ASK)
    choice = built.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1, calls
    return calls[0].function.name, json.loads(calls[0].function.arguments)


def via_llm(base: str, user_path, monkeypatch) -> tuple[str, dict]:
    # An OpenAI-compatible model is configured the way `llm`'s users do it, in a user dir.
    (user_path / "extra-openai-models.yaml").write_text(
        f"- model_id: wick-qwen\n  model_name: {MODEL}\n  api_base: {base}/v1\n  supports_tools: true\n")
    monkeypatch.setenv("LLM_USER_PATH", str(user_path))
    model = llm.get_model("wick-qwen")
    seen = []

    def get_weather(city: str) -> str:
        seen.append(city)
        return "Sunny, 21 degrees Celsius."

    params = WEATHER[0]["function"]
    tool = llm.Tool(name=params["name"], description=params["description"],
                    input_schema=params["parameters"], implementation=get_weather)
    response = model.prompt(QUESTION, tools=[tool], stream=True, **SAMPLING)
    text = "".join(response)
    assert text == "", f"markup leaked into the text: {text!r}"
    calls = response.tool_calls()
    assert len(calls) == 1, calls
    # The assembled call runs the Python tool with its arguments.
    results = response.execute_tool_calls()
    assert [r.output for r in results] == ["Sunny, 21 degrees Celsius."]
    assert seen == [calls[0].arguments.get("city")]
    return calls[0].name, calls[0].arguments


CLIENTS = ["openai", "litellm", "llm"]


def assemble(client: str, base: str, tmp_path, monkeypatch) -> tuple[str, dict]:
    if client == "openai":
        return via_openai_helper(base)
    if client == "litellm":
        return via_litellm(base)
    return via_llm(base, tmp_path, monkeypatch)


# --- the real server ---

@pytest.fixture(scope="module")
def whole_call(qwen_server) -> tuple[str, dict]:
    """The call of the non-streamed reply."""
    r = qwen_server.client().chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER, **SAMPLING)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
    return calls[0].function.name, json.loads(calls[0].function.arguments)


def read_events(base: str) -> list[dict]:
    """The chunks of one streamed reply, as sent."""
    body = {"model": MODEL, "messages": ASK, "tools": WEATHER, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING}
    events = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120.0) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.fixture(scope="module")
def wick_events(qwen_server) -> list[dict]:
    events = read_events(qwen_server.base)
    # The premise: this reply needs a repair, so the clients meet wick's repair report.
    repairs = [e["wick_repairs"] for e in events if "wick_repairs" in e]
    assert repairs and repairs[0] and repairs[0][0]["repairs"], "no repair reported: the test lost its point"
    for e in events:
        for c in e["choices"]:
            for tc in c["delta"].get("tool_calls") or []:
                assert "function" in tc and "wick_repairs" not in tc, tc
    return events


@pytest.mark.parametrize("client", CLIENTS)
def test_client_assembles_the_streamed_call(client, qwen_server, whole_call, wick_events, tmp_path, monkeypatch,
                                            caplog):
    name, arguments = assemble(client, qwen_server.base, tmp_path, monkeypatch)
    assert (name, arguments) == whole_call
    assert whole_call == ("get_weather", {"city": "Paris"})
    assert litellm_errors(caplog) == []


# --- wick's stream replayed, with the repairs where they are now and where they were ---

def repairs_in_call_delta(events: list[dict]) -> list[dict]:
    """The same reply with the repairs placed as wick sent them before: in a call delta of
    their own, after the call's arguments, carrying `index` and `wick_repairs` but no
    `function`."""
    out = []
    for e in copy.deepcopy(events):
        for entry in e.pop("wick_repairs", []):
            out.append({**e, "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": entry["index"], "wick_repairs": entry["repairs"]}]},
                "logprobs": None, "finish_reason": None}]})
        out.append(e)
    return out


@contextlib.contextmanager
def replaying(events: list[dict]):
    """A loopback server answering every chat request with `events` as an SSE stream."""
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_old_shape_is_the_same_reply_but_for_the_repairs(wick_events):
    old = repairs_in_call_delta(wick_events)
    reported = [entry for e in wick_events for entry in e.get("wick_repairs", [])]
    assert len(old) == len(wick_events) + len(reported)
    assert not [e for e in old if "wick_repairs" in e]
    bare = [tc for e in old for c in e["choices"] for tc in c["delta"].get("tool_calls") or []
            if "function" not in tc]
    assert bare == [{"index": r["index"], "wick_repairs": r["repairs"]} for r in reported]


def litellm_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("LiteLLM") and r.levelno >= 40]


@pytest.mark.parametrize("client", CLIENTS)
def test_replayed_stream_assembles(client, wick_events, whole_call, tmp_path, monkeypatch, caplog):
    with replaying(wick_events) as (base, requests):
        assert assemble(client, base, tmp_path, monkeypatch) == whole_call
    assert len(requests) == 1 and requests[0]["stream"] is True and requests[0]["tools"], requests
    assert litellm_errors(caplog) == []


def test_repairs_in_a_call_delta_break_the_openai_helper(wick_events):
    with replaying(repairs_in_call_delta(wick_events)) as (base, _):
        with pytest.raises(AssertionError) as failed:
            via_openai_helper(base)
    # `assert tool_call_delta.function is not None` inside the SDK, not one of ours.
    assert "openai" in str(failed.traceback[-1].path) and "streaming" in str(failed.traceback[-1].path)


def test_repairs_in_a_call_delta_break_llm(wick_events, tmp_path, monkeypatch):
    with replaying(repairs_in_call_delta(wick_events)) as (base, _):
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'arguments'"):
            via_llm(base, tmp_path, monkeypatch)


def test_repairs_in_a_call_delta_make_litellm_log_an_error(wick_events, whole_call, caplog):
    # This LiteLLM catches the validation error of the chunk, logs it with its traceback at
    # ERROR on every such stream, and drops that delta: the call still assembles.
    with replaying(repairs_in_call_delta(wick_events)) as (base, _):
        assert via_litellm(base) == whole_call
    errors = litellm_errors(caplog)
    assert errors and all("ChatCompletionDeltaToolCall" in e and "function" in e for e in errors), errors
