"""Raw text completions: string and token-array prompts, echo, legacy logprobs, streaming, stop."""
from conftest import SHORT

PROMPT = "The capital of France is"


def complete(client, **kw):
    kw.setdefault("model", "anything")
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("max_tokens", SHORT)
    kw.setdefault("temperature", 0)
    return client.completions.create(**kw)


def test_text_prompt(client):
    r = complete(client)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    c = r.choices[0]
    assert c.text and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens >= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_array_prompt(client):
    # Token ids from chat logprobs (wick adds each token's id to the entries).
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8, temperature=0, logprobs=True)
    entries = chat.choices[0].logprobs.content
    ids = [e.model_extra["id"] for e in entries]
    text = "".join(e.token for e in entries)
    r = complete(client, prompt=ids, echo=True, max_tokens=4)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].text.startswith(text)
    nested = complete(client, prompt=[ids], max_tokens=4)
    assert r.choices[0].text == text + nested.choices[0].text


def test_echo(client):
    r = complete(client, echo=True, max_tokens=4)
    assert r.choices[0].text.startswith(PROMPT)
    plain = complete(client, max_tokens=4)
    assert r.choices[0].text == PROMPT + plain.choices[0].text


def test_legacy_logprobs(client):
    r = complete(client, logprobs=2, max_tokens=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    echoed = complete(client, logprobs=0, max_tokens=2, echo=True).choices[0].logprobs
    assert echoed.token_logprobs[0] is None and echoed.token_logprobs[-1] is not None


def test_stream(client):
    whole = complete(client, max_tokens=12)
    text, finish, usage = "", None, None
    for chunk in complete(client, max_tokens=12, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop(client):
    base = complete(client, max_tokens=16).choices[0].text
    assert len(base) > 4
    stop = base.strip()[:3]
    r = complete(client, max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text
