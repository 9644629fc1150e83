"""Images end to end: the tiny random Gemma 3 vision model of the engine's goldens
(scripts/goldens/hf_tiny_gemma3_vision.py: SigLIP tower, projector, tokenizer, chat template
and image processor config) served from its directory, asked about a real PNG through the
OpenAI, Anthropic and Responses protocols. The reply must be transformers' greedy
continuation for the same image and prompt, which needs the server's decoding, resizing and
normalisation, the prompt's image expansion, the tower and the splice all to agree with
transformers. The prompt cache must tell two images apart."""
import base64
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, WickServer

GOLD = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "gemma3_vision"


def reference() -> dict:
    import json
    return json.loads((GOLD / "reference.json").read_text())


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((GOLD / name).read_bytes()).decode()


def b64(name: str) -> str:
    return base64.b64encode((GOLD / name).read_bytes()).decode()


@pytest.fixture(scope="module")
def server():
    s = WickServer(str(GOLD), "--model-id", "tiny-vision")
    yield s
    assert s.stop() == 0, s.logs()


def expected_text() -> str:
    ref = reference()["greedy"]
    assert ref["case"] == "one_image"
    tok = Tokenizer.from_file(str(GOLD / "tokenizer.json"))
    return tok.decode(ref["continuation_ids"], skip_special_tokens=False)


def one_image_ids() -> list[int]:
    return next(c for c in reference()["cases"] if c["name"] == "one_image")["ids"]


def openai_messages(image: str) -> list[dict]:
    # The golden's prompt: "What is in" <image> "this picture?" in one user turn.
    return [{"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "this picture?"}]}]


def test_models_list_vision(server):
    with server.http() as h:
        model = h.get("/v1/models").json()["data"][0]
    assert model["vision"] is True and model["audio"] is False, model


def test_openai_image_reply_is_transformers_greedy_continuation(server):
    n = len(reference()["greedy"]["continuation_ids"])
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="tiny-vision", messages=openai_messages("image_a.png"),
                                       max_tokens=n, temperature=0)
    assert r.usage.prompt_tokens == len(one_image_ids())
    assert r.choices[0].message.content == expected_text()
    # Streamed through the SDK's helper: the same text (the reply stops at max_tokens, so
    # the text is read from the helper's content events).
    text = ""
    with client.chat.completions.stream(model="tiny-vision", messages=openai_messages("image_a.png"),
                                        max_tokens=n, temperature=0) as stream:
        for event in stream:
            if event.type == "content.delta":
                text += event.delta
    assert text == expected_text()


def test_anthropic_and_responses_images_give_the_same_reply(server):
    n = len(reference()["greedy"]["continuation_ids"])
    client = anthropic.Anthropic(base_url=server.base, api_key="none")
    msg = client.messages.create(model="tiny-vision", max_tokens=n, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is in"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64("image_a.png")}},
            {"type": "text", "text": "this picture?"}]}])
    assert msg.content[0].text == expected_text()
    # Anthropic counts cached prompt tokens apart (this prompt ran before).
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(one_image_ids())
    oa = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    resp = oa.responses.create(model="tiny-vision", max_output_tokens=n, temperature=0, input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is in"},
            {"type": "input_image", "image_url": data_url("image_a.png")},
            {"type": "input_text", "text": "this picture?"}]}])
    assert resp.output_text == expected_text()


def test_prompt_cache_tells_images_apart(server):
    def ask(image: str) -> dict:
        with server.http() as h:
            r = h.post("/v1/chat/completions", json={
                "model": "tiny-vision", "messages": openai_messages(image), "max_tokens": 4,
                "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def cached(reply: dict) -> int:
        return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    ask("image_a.png")
    again = ask("image_a.png")
    other = ask("image_b.png")
    span_start = next(c for c in reference()["cases"] if c["name"] == "one_image")["spans"][0][0]
    # The same image: the prefix through the image is reused.
    assert cached(again) > span_start, again["usage"]
    # Another image: nothing at or after its soft tokens comes from the first image's KV.
    assert cached(other) <= span_start, other["usage"]


def test_bad_images_are_400_not_5xx(server):
    with server.http() as h:
        for url in ("data:image/png;base64,iVBORw0KGgo=",  # truncated PNG
                    "data:image/png;base64,@@@not-base64@@@",
                    "data:text/plain;base64," + base64.b64encode(b"hello").decode(),
                    "http://127.0.0.1:1/x.png",  # loopback: refused without --allow-private-media
                    "file:///etc/passwd"):
            r = h.post("/v1/chat/completions", json={
                "model": "tiny-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}]}]})
            assert r.status_code == 400, (url, r.status_code, r.text)
            assert r.json()["error"]["message"], url


def test_wrong_media_types_are_400s_that_say_so(server):
    png = b64("image_a.png")
    with server.http() as h:
        # A PNG sent under a type that is not an image's.
        for declared in ("application/pdf", "audio/wav", "text/plain"):
            r = h.post("/v1/chat/completions", json={
                "model": "tiny-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": f"data:{declared};base64,{png}"}}]}]})
            assert r.status_code == 400, (declared, r.text)
            assert declared in r.json()["error"]["message"], r.text
        # Among image types the bytes decide (clients often label every image image/jpeg).
        r = h.post("/v1/chat/completions", json={
            "model": "tiny-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{png}"}}]}]})
        assert r.status_code == 200, r.text
        # Anthropic checks media_type as Anthropic does: one of its four types, matching the data.
        for media_type, want in (("image/jpeg", "says image/jpeg but the data is PNG"),
                                 ("image/bmp", "not supported"),
                                 (None, "required")):
            source = {"type": "base64", "data": png}
            if media_type:
                source["media_type"] = media_type
            r = h.post("/v1/messages", json={
                "model": "tiny-vision", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": source}]}]})
            assert r.status_code == 400, (media_type, r.text)
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert want in body["error"]["message"], body
            assert "messages[0].content[0].source.media_type" in body["error"]["message"], body
