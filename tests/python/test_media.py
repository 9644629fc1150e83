"""Images and audio in chat requests, against the default text model (no towers): every
protocol's media part gets a 400 in its own error shape naming the model and what it lacks,
hostile media gets a 400, and nothing answers 5xx. (Preprocessing and prompt splicing are
tested in Rust: crates/wick-media and wick-server's media module.)"""
import base64
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "crates" / "wick-media" / "tests" / "data"


def b64(name: str) -> str:
    return base64.b64encode((DATA / name).read_bytes()).decode()


def png_url() -> str:
    return "data:image/png;base64," + b64("alpha.png")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


@pytest.fixture(scope="module")
def model_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def chat(http, parts):
    return http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )


def openai_error(r, status=400):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    return err


def test_models_report_no_towers(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["vision"] is False
    assert card["audio"] is False


def test_chat_image_is_refused_naming_the_model(http, model_id):
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": png_url()}}]
    err = openai_error(chat(http, parts))
    assert model_id in err["message"] and "vision tower" in err["message"], err
    assert err["param"] == "messages[0].content[1].type"


def test_chat_audio_is_refused_naming_the_model(http, model_id):
    parts = [{"type": "input_audio", "input_audio": {"data": b64("mono16k.wav"), "format": "wav"}}]
    err = openai_error(chat(http, parts))
    assert model_id in err["message"] and "audio tower" in err["message"], err


def test_anthropic_image_is_refused_in_anthropic_shape(http, model_id):
    for source in [
        {"type": "base64", "media_type": "image/png", "data": b64("alpha.png")},
        {"type": "url", "url": "https://example.com/cat.png"},
    ]:
        r = http.post(
            "/v1/messages",
            json={
                "model": model_id,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image", "source": source},
                ]}],
            },
        )
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert model_id in body["error"]["message"] and "vision tower" in body["error"]["message"]


def test_responses_image_is_refused(http, model_id):
    r = http.post(
        "/v1/responses",
        json={
            "max_output_tokens": 4,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": png_url()},
            ]}],
        },
    )
    err = openai_error(r)
    assert model_id in err["message"] and "vision tower" in err["message"], err


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}},
        {"type": "image_url", "image_url": {"url": "data:image/png,raw"}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}},
        {"type": "image_url", "image_url": 7},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe0trunc").decode()}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}},
        {"type": "input_audio", "input_audio": {"format": "wav"}},
    ],
)
def test_hostile_media_is_a_400(http, part):
    openai_error(chat(http, [part]))


def test_many_parts_and_a_huge_body_are_4xx_not_5xx(http):
    parts = [{"type": "image_url", "image_url": {"url": png_url()}}] * 50
    assert chat(http, parts).status_code == 400
    huge = "data:image/png;base64," + "A" * (40 * 1024 * 1024)
    r = chat(http, [{"type": "image_url", "image_url": {"url": huge}}])
    assert 400 <= r.status_code < 500, r.status_code
