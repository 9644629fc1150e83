"""LoRA adapters through the server: PEFT and mlx-lm adapters on the tiny random Llama, each,
stacked and none, against the transformers + PEFT greedy continuations of
scripts/goldens/peft_adapters.py; concurrent requests with different adapters give the same
tokens as each alone; a prompt cached under one adapter is not reused under another; mounting,
unmounting (also while a request uses the adapter), vLLM's endpoints and the errors."""
import json
import threading
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, _serve

GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens"
BASE = GOLDENS / "hf" / "llama"
ADAPTERS = GOLDENS / "adapters"
REFERENCE = json.loads((ADAPTERS / "reference.json").read_text())
TOKENIZER = Tokenizer.from_file(str(BASE / "tokenizer.json"))
SPECIAL = {0, 1, 2}


@pytest.fixture(scope="module")
def srv():
    # peft_a is mounted first, so it is the default; peft_b is mounted over HTTP below.
    yield from _serve(str(BASE), "--adapter", str(ADAPTERS / "peft_a"), "--adapter", str(ADAPTERS / "mlx_c"))


@pytest.fixture(scope="module")
def http(srv):
    with srv.http() as h:
        r = h.post("/v1/adapters", json={"id": "peft_b", "path": str(ADAPTERS / "peft_b")})
        assert r.status_code == 200, r.text
        assert r.json()["mounted_layers"] == 3 and r.json()["rank"] == 8
        yield h


def expected(sel: str, case: str) -> str | None:
    ids = REFERENCE["selections"][sel]["greedy"][case]
    if SPECIAL & set(ids):
        return None
    return TOKENIZER.decode(ids)


def complete(h: httpx.Client, case: str, **fields) -> dict:
    body = {
        "model": "m",
        "prompt": REFERENCE["cases"][case],
        "max_tokens": REFERENCE["greedy_new_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }
    r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def checked_pairs():
    return [(s, c) for s in REFERENCE["selections"] for c in REFERENCE["cases"] if expected(s, c) is not None]


def test_each_selection_matches_peft(http):
    pairs = checked_pairs()
    assert len(pairs) >= 8
    for sel, case in pairs:
        got = complete(http, case, adapter=sel)["choices"][0]["text"]
        assert got == expected(sel, case), (sel, case)


def test_default_model_field_and_none(http):
    case = "len7"
    # No field: the first --adapter (peft_a) is the default; "none" is the base model.
    assert complete(http, case)["choices"][0]["text"] == expected("peft_a", case)
    assert complete(http, case, adapter="none")["choices"][0]["text"] == expected("none", case)
    # vLLM's convention: `model` names the adapter.
    got = complete(http, case, model="mlx_c")["choices"][0]["text"]
    assert got == expected("mlx_c", case)
    # An explicit `adapter` wins over `model`.
    got = complete(http, case, model="mlx_c", adapter="none")["choices"][0]["text"]
    assert got == expected("none", case)


def test_concurrent_requests_with_different_adapters(http, srv):
    pairs = checked_pairs()
    alone = {p: expected(*p) for p in pairs}
    results = {}

    def run(p, i):
        with srv.http() as h:
            results[(p, i)] = complete(h, p[1], adapter=p[0])["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(p, i)) for i in range(2) for p in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(threads)
    for (p, _), text in results.items():
        assert text == alone[p], p


def test_prompt_cache_is_per_adapter(http):
    # A prompt no other test sends, so every namespace starts cold.
    prompt = [p + 3 for p in reversed(REFERENCE["cases"]["len19"])]

    def run(adapter):
        r = complete(http, "len7", prompt=prompt, adapter=adapter, max_tokens=4)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["text"]

    cached, first = run("peft_b")
    assert cached == 0
    cached, again = run("peft_b")
    assert cached > 0 and again == first
    for other in ("mlx_c", "none", "peft_a+peft_b", "peft_b+peft_a"):
        cold, text = run(other)
        assert cold == 0, other
        warm, text_again = run(other)
        assert warm > 0 and text_again == text, other


def test_listings(http):
    mounted = http.get("/v1/adapters").json()["adapters"]
    by_id = {a["id"]: a for a in mounted}
    assert set(by_id) == {"peft_a", "peft_b", "mlx_c"}
    assert by_id["peft_a"]["default"] and by_id["peft_a"]["format"] == "peft"
    assert by_id["mlx_c"]["format"] == "mlx-lm" and by_id["mlx_c"]["scale"] == 2.0
    assert by_id["peft_a"]["rank"] == 4 and by_id["peft_a"]["mounted_layers"] == 14
    models = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert {"peft_a", "peft_b", "mlx_c"} <= set(models)
    card = http.get("/v1/models/mlx_c").json()
    assert card["parent"] == models[0]
    # Found beside the --adapter folders: mlx_c records no base model, so it is kept; the
    # PEFT ones record "tiny-random-llama", which is not the served model ("llama").
    avail = {a["id"]: a for a in http.get("/v1/adapters/available").json()["adapters"]}
    assert avail["mlx_c"]["mounted"] and avail["mlx_c"]["rank"] == 4
    assert "peft_a" not in avail and "peft_b" not in avail


def test_errors(http):
    r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2, "adapter": "nope"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "adapter" and "nope" in err["message"] and "peft_a" in err["message"]
    r = http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 2, "adapter": "peft_a+peft_a"})
    assert r.status_code == 400
    assert http.delete("/v1/adapters/nope").status_code == 404
    assert "not mounted" in http.delete("/v1/adapters/nope").json()["error"]["message"]
    r = http.post("/v1/adapters", json={"id": "x", "path": str(ADAPTERS / "missing")})
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"]
    r = http.post("/v1/adapters", json={"id": "a+b", "path": str(ADAPTERS / "peft_a")})
    assert r.status_code == 400
    r = http.post("/v1/adapters", json={"id": "peft_a", "path": str(ADAPTERS / "peft_a")})
    assert r.status_code == 400 and "already mounted" in r.json()["error"]["message"]
    assert http.post("/v1/adapters", json={"id": "x"}).status_code == 400
    # A bad adapter refuses the whole mount: nothing of it is listed afterwards.
    assert "x" not in {a["id"] for a in http.get("/v1/adapters").json()["adapters"]}


def test_vllm_load_and_unload(http):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "again_c", "lora_path": str(ADAPTERS / "mlx_c")})
    assert r.status_code == 200 and "again_c" in r.text
    got = complete(http, "len7", model="again_c")["choices"][0]["text"]
    assert got == expected("mlx_c", "len7")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "again_c"})
    assert r.status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "again_c"}).status_code == 404
    r = http.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 1, "adapter": "again_c"})
    assert r.status_code == 400


def test_unmount_while_in_use_lets_the_request_finish(http, srv):
    r = http.post("/v1/adapters", json={"id": "busy", "path": str(ADAPTERS / "peft_b")})
    assert r.status_code == 200
    body = {"model": "m", "prompt": REFERENCE["cases"]["len7"], "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "adapter": "busy", "stream": True, "stream_options": {"include_usage": True}}
    chunks, usage, text = 0, None, ""
    with srv.http() as h, h.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            text += "".join(c["text"] for c in chunk.get("choices", []))
            chunks += 1
            if chunks == 2:
                assert http.delete("/v1/adapters/busy").json()["removed_layers"] == 3
    assert usage["completion_tokens"] == 2000
    # It ran with peft_b's weights to the end: it begins as peft_b (same files) does.
    assert text.startswith(complete(http, "len7", adapter="peft_b", max_tokens=8)["choices"][0]["text"])
    # The id is gone for new requests.
    r = http.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 1, "adapter": "busy"})
    assert r.status_code == 400


def test_chat_anthropic_and_responses_take_the_field(http):
    msgs = [{"role": "user", "content": "The river ran"}]
    chat = http.post("/v1/chat/completions", json={
        "model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "adapter": "mlx_c"}).json()
    base = http.post("/v1/chat/completions", json={
        "model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "adapter": "none"}).json()
    text = chat["choices"][0]["message"]["content"]
    assert text != base["choices"][0]["message"]["content"]
    anth = http.post("/v1/messages", json={
        "model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "adapter": "mlx_c"}).json()
    assert anth["content"][0]["text"] == text
    resp = http.post("/v1/responses", json={
        "model": "m", "input": "The river ran", "max_output_tokens": 8, "temperature": 0,
        "ignore_eos": True, "adapter": "mlx_c"}).json()
    assert resp["output"][-1]["content"][0]["text"] == text
    r = http.post("/v1/messages", json={"model": "m", "messages": msgs, "max_tokens": 8, "adapter": "nope"})
    assert r.status_code == 400 and r.json()["type"] == "error"
