"""`/v1/completions` with `echo` and `logprobs`: the prompt's tokens are scored (the first
one `null`), as lm-evaluation-harness's `local-completions` reads them."""
import math

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"


def scored(client, prompt, max_tokens, **kw):
    return client.completions.create(model="m", prompt=prompt, echo=True, logprobs=1,
                                     max_tokens=max_tokens, temperature=0, **kw)


def test_max_tokens_zero_scores_the_prompt(client):
    r = scored(client, PROMPT, 0)
    c = r.choices[0]
    assert c.text == PROMPT
    lp = c.logprobs
    n = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The alternative of a position is at least as likely as the prompt's token there.
    for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        best = max(top.values())
        assert best >= x - 1e-5
        if tok in top:
            assert abs(top[tok] - x) < 1e-4
    # A likely continuation scores better than an unlikely one.
    assert lp.token_logprobs[-1] > -15


def test_prompt_scores_equal_generation_logprobs(client):
    gen = scored(client, PROMPT, 6).choices[0]
    generated = gen.text[len(PROMPT):]
    assert generated
    again = scored(client, PROMPT + generated, 0).choices[0].logprobs
    assert again.tokens == gen.logprobs.tokens, "the prompt re-tokenized differently"
    for i, (a, b) in enumerate(zip(again.token_logprobs[1:], gen.logprobs.token_logprobs[1:])):
        assert abs(a - b) <= 1e-4, (i, a, b)
    # Greedy tokens are the top alternative at their positions (lm-eval's is_greedy).
    k = len(gen.logprobs.tokens) - 6
    for tok, top in zip(again.tokens[k:], again.top_logprobs[k:]):
        assert max(top, key=top.get) == tok


def test_lm_eval_request_shape(client):
    # local-completions: token ids in a one-element batch, max_tokens 1, logprobs 1.
    ids_text = scored(client, PROMPT, 0)
    r = client.completions.create(model="m", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
                                  temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.prompt_tokens + 1
    prompt_part = lp.token_logprobs[:-1]
    want = ids_text.choices[0].logprobs.token_logprobs
    assert prompt_part[0] is None and want[0] is None
    assert all(abs(a - b) <= 1e-4 for a, b in zip(prompt_part[1:], want[1:]))


def test_stream_sends_the_scored_prompt_first(client):
    chunks = list(scored(client, PROMPT, 3, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT
    assert first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) >= 10
    assert all(x is not None for x in first.logprobs.token_logprobs[1:])
    whole = scored(client, PROMPT, 3).choices[0]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(whole.logprobs.token_logprobs)
    assert all((a is None and b is None) or abs(a - b) <= 1e-4
               for a, b in zip(streamed, whole.logprobs.token_logprobs))


def test_zero_tokens_needs_echo(client):
    import openai
    import pytest
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in str(e.value)
    one = scored(client, [1], 0).choices[0].logprobs
    assert one.token_logprobs == [None]
