"""Gemma 4 images end to end: the tiny random Gemma 4 vision models of the engine's goldens
(scripts/goldens/hf_tiny_gemma4_vision.py: vision tower, embedder, tokenizer, chat template
and image processor config) served from their directories, asked about a real PNG through
the OpenAI, Anthropic and Responses protocols. The reply must be transformers' greedy
continuation for the same image and prompt: the server's decoding and aspect-preserving
resize, the soft-token count of the splice, the tower and the placement in the Gemma 4
forward pass (causal, and bidirectional on sliding layers for the `_bidir` variant) must all
agree with transformers. The prompt cache must tell two images apart."""
import base64
import json

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, WickServer

GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf"
GOLD = GOLDENS / "gemma4_vision"
BIDIR = GOLDENS / "gemma4_vision_bidir"


def reference(gold=GOLD) -> dict:
    return json.loads((gold / "reference.json").read_text())


def b64(name: str, gold=GOLD) -> str:
    return base64.b64encode((gold / name).read_bytes()).decode()


def data_url(name: str, gold=GOLD) -> str:
    return "data:image/png;base64," + b64(name, gold)


def chat_texts(gold=GOLD) -> tuple[str, str]:
    """The text parts around the image of the golden's chat request."""
    chat = reference(gold)["chat"]
    assert chat["case"] == "one_image" and chat["images"] == ["image_a.png"]
    parts = chat["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image", "text"]
    return parts[0]["text"], parts[2]["text"]


def openai_messages(image: str, gold=GOLD) -> list[dict]:
    before, after = chat_texts(gold)
    return [{"role": "user", "content": [
        {"type": "text", "text": before},
        {"type": "image_url", "image_url": {"url": data_url(image, gold)}},
        {"type": "text", "text": after}]}]


def greedy(gold=GOLD) -> list[int]:
    ref = reference(gold)["greedy"]
    assert ref["case"] == "one_image"
    return ref["continuation_ids"]


def expected_text(gold=GOLD) -> str:
    tok = Tokenizer.from_file(str(gold / "tokenizer.json"))
    return tok.decode(greedy(gold), skip_special_tokens=False)


def one_image_ids(gold=GOLD) -> list[int]:
    return next(c for c in reference(gold)["cases"] if c["name"] == "one_image")["ids"]


@pytest.fixture(scope="module")
def server():
    s = WickServer(str(GOLD), "--model-id", "tiny-g4-vision")
    yield s
    assert s.stop() == 0, s.logs()


def test_models_list_vision(server):
    with server.http() as h:
        model = h.get("/v1/models").json()["data"][0]
    assert model["vision"] is True and model["audio"] is False, model


def test_openai_image_reply_is_transformers_greedy_continuation(server):
    n = len(greedy())
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny-g4-vision", messages=openai_messages("image_a.png"),
                                       max_tokens=n, temperature=0)
    # The splice gave the image as many soft tokens as transformers' model used.
    assert r.usage.prompt_tokens == len(one_image_ids())
    assert r.choices[0].message.content == expected_text()
    text = ""
    with client.chat.completions.stream(model="tiny-g4-vision", messages=openai_messages("image_a.png"),
                                        max_tokens=n, temperature=0) as stream:
        for event in stream:
            if event.type == "content.delta":
                text += event.delta
    assert text == expected_text()


def test_anthropic_and_responses_images_give_the_same_reply(server):
    n = len(greedy())
    before, after = chat_texts()
    client = anthropic.Anthropic(base_url=server.base, api_key="none")
    msg = client.messages.create(model="tiny-g4-vision", max_tokens=n, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": before},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64("image_a.png")}},
            {"type": "text", "text": after}]}])
    assert msg.content[0].text == expected_text()
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(one_image_ids())
    oa = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    resp = oa.responses.create(model="tiny-g4-vision", max_output_tokens=n, temperature=0, input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": before},
            {"type": "input_image", "image_url": data_url("image_a.png")},
            {"type": "input_text", "text": after}]}])
    assert resp.output_text == expected_text()


def test_prompt_cache_tells_images_apart(server):
    def ask(image: str) -> dict:
        with server.http() as h:
            r = h.post("/v1/chat/completions", json={
                "model": "tiny-g4-vision", "messages": openai_messages(image), "max_tokens": 4,
                "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def cached(reply: dict) -> int:
        return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    first = ask("image_a.png")
    again = ask("image_a.png")
    other = ask("image_b.png")
    span_start = next(c for c in reference()["cases"] if c["name"] == "one_image")["spans"][0][0]
    assert cached(again) > span_start, again["usage"]
    assert cached(other) <= span_start, other["usage"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_bad_images_are_400_not_5xx(server):
    with server.http() as h:
        for url in ("data:image/png;base64,iVBORw0KGgo=",
                    "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
                    "http://127.0.0.1:1/x.png"):
            r = h.post("/v1/chat/completions", json={
                "model": "tiny-g4-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}]}]})
            assert r.status_code == 400, (url, r.status_code, r.text)


def test_bidirectional_vision_variant_gives_its_greedy_continuation():
    s = WickServer(str(BIDIR), "--model-id", "tiny-g4-bidir")
    try:
        n = len(greedy(BIDIR))
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none")
        r = client.chat.completions.create(model="tiny-g4-bidir", max_tokens=n, temperature=0,
                                           messages=openai_messages("image_a.png", BIDIR))
        assert r.usage.prompt_tokens == len(one_image_ids(BIDIR))
        assert r.choices[0].message.content == expected_text(BIDIR)
        before, after = chat_texts(BIDIR)
        msg = anthropic.Anthropic(base_url=s.base, api_key="none").messages.create(
            model="tiny-g4-bidir", max_tokens=n, extra_body={"temperature": 0}, messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": before},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64("image_a.png", BIDIR)}},
                    {"type": "text", "text": after}]}])
        assert msg.content[0].text == expected_text(BIDIR)
    finally:
        assert s.stop() == 0, s.logs()
