"""`POST /v1/embeddings` through the official `openai` SDK: all-MiniLM-L6-v2 (an encoder,
served as an embedder automatically) and the tiny Qwen3 decoder embedder (`--embedding`)
against sentence-transformers' vectors (scripts/goldens/embeddings.py), float and base64,
token-id input, Matryoshka `dimensions`, instructions, and the 400s."""
import base64
import json
import math
import struct

import openai
import pytest

from conftest import ROOT, SMOLLM, WICK_HOME, _serve, require_model

GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "embed"
MINILM = WICK_HOME / "models" / "all-minilm-l6-v2"
TINY = GOLDENS / "tiny-qwen3-embed"


def golden(name):
    return json.loads((GOLDENS / f"{name}.json").read_text())


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def assert_close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w), i
        assert cosine(g, w) >= 0.9999, (i, cosine(g, w))


def from_base64(s):
    raw = base64.b64decode(s)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.fixture(scope="module")
def minilm():
    require_model(MINILM / "model.safetensors", "minilm")
    yield from _serve("minilm")


@pytest.fixture(scope="module")
def tiny():
    yield from _serve(str(TINY), "--embedding", "--model-id", "tiny-embed")


def test_minilm_float_and_base64(minilm):
    g = golden("minilm")
    client = minilm.client()
    r = client.embeddings.create(model="anything", input=g["sentences"], encoding_format="float")
    assert r.object == "list" and r.model == "all-minilm-l6-v2"
    assert [d.index for d in r.data] == list(range(len(g["sentences"])))
    assert_close([d.embedding for d in r.data], g["vectors"])
    assert r.usage.prompt_tokens == sum(len(i) for i in g["ids"]) == r.usage.total_tokens

    r = client.embeddings.create(model="m", input=g["sentences"][:2], encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in r.data)
    assert_close([from_base64(d.embedding) for d in r.data], g["vectors"][:2])
    # The SDK's default asks for base64 and decodes it.
    r = client.embeddings.create(model="m", input=g["sentences"][0])
    assert_close([r.data[0].embedding], g["vectors"][:1])


def test_minilm_token_ids_and_refusals(minilm):
    g = golden("minilm")
    client = minilm.client()
    r = client.embeddings.create(model="m", input=g["ids"][:3], encoding_format="float")
    assert_close([d.embedding for d in r.data], g["vectors"][:3])
    r = client.embeddings.create(model="m", input=g["ids"][0], encoding_format="float")
    assert_close([r.data[0].embedding], g["vectors"][:1])
    # No Matryoshka dimensions declared: only the full length.
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="m", input="hi", dimensions=128)
    assert e.value.body["param"] == "dimensions"
    assert len(client.embeddings.create(model="m", input="hi", dimensions=384,
                                        encoding_format="float").data[0].embedding) == 384
    for bad, param in [([], "input"), ([[1, 99999999]], "input"), ([[]], "input[0]"),
                       (["ok", 3], "input[1]"), ([list(range(1000, 1300))], "input")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="m", input=bad)
        assert e.value.body["type"] == "invalid_request_error", bad
        assert e.value.body["param"] == param, bad
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in e.value.body["message"]
    assert client.models.list().data[0].id == "all-minilm-l6-v2"


def test_decoder_embedder(tiny):
    g = golden("tiny-qwen3-embed")
    client = tiny.client()
    r = client.embeddings.create(model="tiny-embed", input=g["sentences"], encoding_format="float")
    assert_close([d.embedding for d in r.data], g["vectors"])
    assert r.usage.prompt_tokens == sum(len(i) for i in g["ids"])
    r = client.embeddings.create(model="tiny-embed", input=g["sentences"],
                                 extra_body={"instruction": g["query_instruction"]},
                                 encoding_format="base64")
    assert_close([from_base64(d.embedding) for d in r.data], g["query_vectors"])
    r = client.embeddings.create(model="tiny-embed", input=g["sentences"],
                                 dimensions=g["truncate_to"], encoding_format="float")
    assert_close([d.embedding for d in r.data], g["truncated_vectors"])
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny-embed", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions"


def test_a_chat_server_refuses_embeddings(server):
    require_model(SMOLLM, "smollm2-135m-instruct")
    with pytest.raises(openai.BadRequestError) as e:
        server.client().embeddings.create(model="m", input="hello")
    assert "--embedding" in e.value.body["message"]
    assert e.value.body["type"] == "invalid_request_error"
