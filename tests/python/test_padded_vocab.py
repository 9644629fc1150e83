"""A padded vocabulary through `wick serve`: Qwen's checkpoints give the embedding and the output
head more rows than the tokenizer has ids (151,936 for 151,665). The tiny Qwen2 golden
(crates/wick-engine/tests/goldens/hf/qwen2, 512 ids) is padded here to 640 rows whose head rows
outscore every real one, so a server that let them through would fail each request (500, "token
id 6xx is outside the vocabulary"). They are never produced, a `logit_bias` or a prompt naming
one is a client mistake (400), and biases on real ids still work."""
import array
import json
import shutil
import struct
import sys

import httpx
import openai
import pytest

from conftest import ROOT, _serve

GOLDEN = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "qwen2"
TOKENS, ROWS = 512, 640


def read_safetensors(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    found = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        found.append((start, name, t["dtype"], t["shape"], body[start:end]))
    return [f[1:] for f in sorted(found)]


def write_safetensors(path, tensors):
    header, at = {}, 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        at += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(t[3] for t in tensors))


def padded_model(dst):
    """The golden with 640 embedding and head rows: zero embeddings, and head row 512 + j equal
    to real row j times -50 (some padded id always scores far above every real one)."""
    assert sys.byteorder == "little"
    shutil.copytree(GOLDEN, dst, ignore=shutil.ignore_patterns("logits.safetensors", "reference.json"))
    config = json.loads((dst / "config.json").read_text())
    config["vocab_size"] = ROWS
    (dst / "config.json").write_text(json.dumps(config))
    tensors = []
    for name, dtype, shape, raw in read_safetensors(dst / "model.safetensors"):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert dtype == "F32" and shape[0] == TOKENS
            hidden = shape[1]
            values = array.array("f")
            values.frombytes(raw)
            if name == "lm_head.weight":
                values.extend(array.array("f", (-50.0 * v for v in values[:(ROWS - TOKENS) * hidden])))
            else:
                values.extend(array.array("f", [0.0]) * ((ROWS - TOKENS) * hidden))
            raw, shape = values.tobytes(), [ROWS, hidden]
        tensors.append((name, dtype, shape, raw))
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    model = padded_model(tmp_path_factory.mktemp("padded") / "qwen2-padded")
    yield from _serve(str(model), "--model-id", "padded")


def chat(server, **extra):
    body = {"model": "padded", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16, "ignore_eos": True, **extra}
    with server.http() as h:
        return h.post("/v1/chat/completions", json=body)


def test_greedy_and_sampled_replies_never_reach_the_padded_rows(padded):
    for extra in ({"temperature": 0}, {"temperature": 1.5, "seed": 3},
                  {"temperature": 0, "logprobs": True, "top_logprobs": 5},
                  {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}):
        r = chat(padded, **extra)
        assert r.status_code == 200, (extra, r.text)
        if extra.get("stream"):
            frames = [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
            assert frames[-1] == "[DONE]", frames[-3:]
            usage = [json.loads(f)["usage"] for f in frames[:-1] if json.loads(f).get("usage")]
            assert usage and usage[-1]["completion_tokens"] == 16, frames[-3:]
            assert not any('"error"' in f for f in frames), frames
            continue
        reply = r.json()
        assert reply["choices"][0]["finish_reason"] == "length", reply
        assert reply["usage"]["completion_tokens"] == 16, reply
        if extra.get("logprobs"):
            for entry in reply["choices"][0]["logprobs"]["content"]:
                assert len(entry["top_logprobs"]) == 5, entry
                assert all(t["logprob"] > -1e30 for t in entry["top_logprobs"]), entry


def test_a_logit_bias_on_a_real_id_still_steers_the_reply(padded):
    plain = chat(padded, temperature=0).json()["choices"][0]["message"]["content"]
    biased = chat(padded, temperature=0, logit_bias={"300": 100}).json()
    assert biased["usage"]["completion_tokens"] == 16, biased
    text = biased["choices"][0]["message"]["content"]
    assert text != plain and len(set(text)) <= 4, (plain, text)


def test_a_logit_bias_or_prompt_naming_a_padded_id_is_a_client_mistake(padded):
    client = padded.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="padded", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            logit_bias={"600": 100})
    assert "600" in str(e.value) and "512" in str(e.value), e.value
    with httpx.Client(base_url=padded.base, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": "padded", "prompt": [5, 600, 7], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "600" in r.json()["error"]["message"], r.text
