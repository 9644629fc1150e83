"""Qwen-VL images end to end: the tiny random Qwen 3.5 and Qwen2.5-VL vision models of the
engine's goldens (scripts/goldens/hf_tiny_qwen35_vision.py, hf_tiny_qwen25_vl.py: vision tower
and merger, text model with M-RoPE, tokenizer, chat template and image processor config), each
served from its directory and asked about a real PNG through the OpenAI and Anthropic SDKs. The reply must be transformers' greedy
continuation for the same image and prompt, which needs the server's decoding and smart
resize, the `<|image_pad|>` expansion from the image's grid, the tower, and the 3-D rotary
positions that resume after the image all to agree with transformers."""
import base64
import json

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, WickServer

GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
GOLD = GOLDENS / "qwen35_vision"  # the PNGs (the same in both goldens)


@pytest.fixture(scope="module", params=["qwen35_vision", "qwen25_vl"])
def server(request):
    s = WickServer(str(GOLDENS / request.param), "--model-id", "tiny-qwen-vision")
    s.gold = GOLDENS / request.param
    yield s
    assert s.stop() == 0, s.logs()


def reference(server) -> dict:
    return json.loads((server.gold / "reference.json").read_text())


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((GOLD / name).read_bytes()).decode()


def expected_text(server) -> str:
    ref = reference(server)["greedy"]
    assert ref["case"] == "one_image"
    tok = Tokenizer.from_file(str(server.gold / "tokenizer.json"))
    return tok.decode(ref["continuation_ids"], skip_special_tokens=False)


def one_image_ids(server) -> list[int]:
    return next(c for c in reference(server)["cases"] if c["name"] == "one_image")["ids"]


def messages(image: str) -> list[dict]:
    # The goldens' prompt: "What is in " <image> " this picture?" in one user turn.
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": " this picture?"}]}]


def test_models_list_vision(server):
    with server.http() as h:
        model = h.get("/v1/models").json()["data"][0]
    assert model["vision"] is True and model["audio"] is False, model


def test_openai_image_reply_is_transformers_greedy_continuation(server):
    n = len(reference(server)["greedy"]["continuation_ids"])
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny-qwen-vision", messages=messages("image_a.png"),
                                       max_tokens=n, temperature=0)
    assert r.usage.prompt_tokens == len(one_image_ids(server))
    assert r.choices[0].message.content == expected_text(server)
    text = ""
    with client.chat.completions.stream(model="tiny-qwen-vision", messages=messages("image_a.png"),
                                        max_tokens=n, temperature=0) as stream:
        for event in stream:
            if event.type == "content.delta":
                text += event.delta
    assert text == expected_text(server)


def test_anthropic_image_gives_the_same_reply(server):
    n = len(reference(server)["greedy"]["continuation_ids"])
    client = anthropic.Anthropic(base_url=server.base, api_key="none")
    msg = client.messages.create(model="tiny-qwen-vision", max_tokens=n,
                                 extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url("image_a.png").split(",", 1)[1]}},
            {"type": "text", "text": " this picture?"}]}])
    assert msg.content[0].text == expected_text(server)


def test_a_larger_image_takes_more_soft_tokens(server):
    # image_b is scaled down by the processor's pixel budget to a 6×8 patch grid: 12 pads.
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny-qwen-vision", messages=messages("image_b.png"),
                                       max_tokens=2, temperature=0)
    grids = {i["file"]: i["soft_tokens"] for i in reference(server)["images"]}
    assert r.usage.prompt_tokens == len(one_image_ids(server)) - grids["image_a.png"] + grids["image_b.png"]


@pytest.mark.parametrize("key,value", [
    ("image_std", [1e-40, 1e-40, 1e-40]),  # positive, but every pixel became infinite
    ("image_std", ["0.5", 0.5, 0.5, 0.5]),  # a string was dropped, shifting the channels
    ("image_mean", [1e39, 0.5, 0.5]),  # infinite as f32
])
def test_a_damaged_preprocessor_config_stops_the_load(tmp_path, key, value):
    import shutil
    import subprocess

    from conftest import ensure_binary, free_port

    model = tmp_path / "model"
    shutil.copytree(GOLDENS / "qwen35_vision", model)
    pre = json.loads((model / "preprocessor_config.json").read_text())
    pre[key] = value
    (model / "preprocessor_config.json").write_text(json.dumps(pre))
    try:
        done = subprocess.run([str(ensure_binary()), "serve", str(model), "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server started with {key} = {value}")
    assert done.returncode != 0
    assert key in done.stderr + done.stdout, done.stderr
