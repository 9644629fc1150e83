"""Chat completions through the official OpenAI SDK: whole and streamed replies, limits, stop
strings, seeds, sampling fields, log-probabilities and usage."""
import math

import pytest

from conftest import SHORT

HELLO = [{"role": "user", "content": "Write one short sentence about the sea."}]


def chat(client, **kw):
    kw.setdefault("model", "anything")
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", SHORT)
    return client.chat.completions.create(**kw)


def collect(stream):
    text, reasoning, chunks, usage, finish = "", "", [], None, None
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            if choice.finish_reason:
                finish = choice.finish_reason
    return text, reasoning, chunks, usage, finish


def test_whole_reply_has_the_openai_shape(client, server):
    r = chat(client, temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == "smollm2-135m-instruct"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 5
    assert 0 < u.completion_tokens <= SHORT
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def test_stream_equals_whole_reply(client):
    whole = chat(client, temperature=0, max_tokens=24)
    text, _, chunks, usage, finish = collect(chat(client, temperature=0, max_tokens=24, stream=True,
                                                  stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_without_include_usage_has_no_usage(client):
    _, _, chunks, usage, finish = collect(chat(client, temperature=0, max_tokens=4, stream=True))
    assert usage is None
    assert finish == "length"


def test_max_tokens_gives_length(client):
    r = chat(client, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_max_completion_tokens_wins(client):
    r = chat(client, temperature=0, max_tokens=20, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_stop_string_and_array(client):
    base = chat(client, temperature=0, max_tokens=24).choices[0].message.content
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    r = chat(client, temperature=0, max_tokens=24, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content
    assert base.startswith(r.choices[0].message.content)
    r2 = chat(client, temperature=0, max_tokens=24, stop=["zzzz-never", stop, ""])
    assert r2.choices[0].message.content == r.choices[0].message.content
    text, _, _, _, finish = collect(chat(client, temperature=0, max_tokens=24, stop=[stop], stream=True))
    assert text == r.choices[0].message.content and finish == "stop"


def test_seed_reproducibility(client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=20)
    a = chat(client, seed=1234, **kw).choices[0].message.content
    b = chat(client, seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {chat(client, seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds all gave the same text"
    text, *_ = collect(chat(client, seed=1234, stream=True, **kw))
    assert text == a


def test_sampling_fields_are_accepted(client):
    r = chat(client, temperature=0.8, top_p=0.9, seed=7, frequency_penalty=0.5, presence_penalty=0.3,
             extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].message.content


def test_logit_bias_changes_the_greedy_token(client):
    r = chat(client, temperature=0, max_tokens=1, logprobs=True, top_logprobs=2)
    first = r.choices[0].logprobs.content[0]
    first_id = first.model_extra["id"]  # wick adds token ids to logprob entries
    second = first.top_logprobs[1]
    banned = chat(client, temperature=0, max_tokens=1, logprobs=True, logit_bias={str(first_id): -100})
    token = banned.choices[0].logprobs.content[0]
    assert token.model_extra["id"] != first_id
    assert token.model_extra["id"] == second.model_extra["id"]


def test_logprobs_whole_and_streamed(client):
    r = chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0 and math.isfinite(entry.logprob)
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = []
    for chunk in chat(client, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))


def test_logprobs_without_alternatives(client):
    r = chat(client, temperature=0, max_tokens=4, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = chat(client, temperature=0, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_roles_and_content_parts(client):
    messages = [
        {"role": "developer", "content": "You answer briefly."},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "How are you?"},
    ]
    r = chat(client, messages=messages, temperature=0)
    assert r.choices[0].message.content


def test_penalties_change_the_output(client):
    kw = dict(temperature=0, max_tokens=32, messages=[{"role": "user", "content": "Repeat the word cat many times."}])
    plain = chat(client, **kw).choices[0].message.content
    penal = chat(client, frequency_penalty=2.0, **kw).choices[0].message.content
    assert plain != penal
