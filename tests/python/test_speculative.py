"""Prompt-lookup speculative decoding (`wick serve --spec ngram`): greedy replies are the
same bytes as without it, on the default model and on Qwen2.5-Coder, alone and under
concurrent requests, streamed or not, with stop strings, max_tokens and logprobs; code
editing (the case it wins) drafts and keeps tokens, reported in `usage.speculation` and
/metrics; structured-output rows speculate with the same replies; `speculative: false` opts
a request out."""
import asyncio
import json

import httpx
import pytest

from conftest import QWEN, SMOLLM, WickServer, require_model

FUNCTION = '''def merge_intervals(intervals, min_gap):
    """Merges overlapping intervals, and those closer than min_gap."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    current_start, current_end = ordered[0]
    for start, end in ordered[1:]:
        if start - current_end <= min_gap:
            if end > current_end:
                current_end = end
        else:
            merged.append((current_start, current_end))
            current_start = start
            current_end = end
    merged.append((current_start, current_end))
    lengths = []
    for start, end in merged:
        lengths.append(end - start)
    total = 0
    for length in lengths:
        total += length
    longest = 0
    for length in lengths:
        if length > longest:
            longest = length
    summary = {
        "count": len(merged),
        "total": total,
        "longest": longest,
        "intervals": merged,
    }
    for key in sorted(summary):
        value = summary[key]
        if isinstance(value, list):
            print(key, len(value))
        else:
            print(key, value)
    return summary
'''

EDIT = ("Rename the variable `merged` to `joined` in this function. Reply with the whole "
        "updated function in one code block.\n\n```python\n" + FUNCTION + "```")

PROMPTS = [
    EDIT,
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
]


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], temperature=0, **kw)


def pair(*args):
    plain = WickServer(*args)
    spec = WickServer(*args, "--spec", "ngram")
    return plain, spec


def stop_all(*servers):
    for s in servers:
        code = s.stop()
        assert code == 0, f"wick serve exited with {code}:\n{s.logs()}"


@pytest.fixture(scope="module")
def smol():
    require_model(SMOLLM, "smollm2-135m-instruct")
    plain, spec = pair("--prompt-cache", "0")
    yield plain, spec
    stop_all(plain, spec)


@pytest.fixture(scope="module")
def qwen():
    if not QWEN.is_file():
        pytest.skip(f"{QWEN} is missing: run `wick pull qwen2.5-coder-0.5b-instruct`")
    plain, spec = pair(str(QWEN), "--model-id", "qwen", "--prompt-cache", "0")
    yield plain, spec
    stop_all(plain, spec)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_unchanged_default_model(smol, prompt):
    plain, spec = smol
    a = chat(plain.client(), prompt, max_tokens=160)
    b = chat(spec.client(), prompt, max_tokens=160)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.choices[0].finish_reason == a.choices[0].finish_reason
    assert b.usage.completion_tokens == a.usage.completion_tokens
    # The plain server never reports speculation.
    assert "speculation" not in (a.usage.model_extra or {})


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_output_is_unchanged_qwen(qwen, prompt):
    plain, spec = qwen
    a = chat(plain.client(), prompt, max_tokens=200)
    b = chat(spec.client(), prompt, max_tokens=200)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.completion_tokens == a.usage.completion_tokens
    if prompt == EDIT:
        s = b.usage.model_extra["speculation"]
        assert s["drafted"] > 0 and 0 < s["accepted"] <= s["drafted"]


def test_streamed_text_is_unchanged(qwen):
    plain, spec = qwen

    def streamed(server):
        stream = chat(server.client(), EDIT, max_tokens=120, stream=True,
                      stream_options={"include_usage": True})
        text, usage = "", None
        for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.delta.content or ""
        return text, usage

    (a, _), (b, usage) = streamed(plain), streamed(spec)
    assert b == a
    assert usage.completion_tokens == 120
    assert usage.model_extra["speculation"]["accepted"] > 0


def test_max_tokens_stop_strings_and_logprobs(qwen):
    plain, spec = qwen
    # A limit inside an accepted run is never passed.
    for n in (1, 2, 7, 33):
        a = chat(plain.client(), EDIT, max_tokens=n)
        b = chat(spec.client(), EDIT, max_tokens=n)
        assert b.usage.completion_tokens == a.usage.completion_tokens == n
        assert b.choices[0].message.content == a.choices[0].message.content
    # A stop string inside an accepted run ends the reply there.
    a = chat(plain.client(), EDIT, max_tokens=200, stop=["current_end = end"])
    b = chat(spec.client(), EDIT, max_tokens=200, stop=["current_end = end"])
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.choices[0].finish_reason == a.choices[0].finish_reason == "stop"
    # The emitted tokens' log-probabilities are the model's.
    a = chat(plain.client(), EDIT, max_tokens=60, logprobs=True, top_logprobs=2)
    b = chat(spec.client(), EDIT, max_tokens=60, logprobs=True, top_logprobs=2)
    la, lb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
    assert [t.token for t in lb] == [t.token for t in la]
    for x, y in zip(la, lb):
        assert y.logprob == pytest.approx(x.logprob, abs=1e-3)
        assert [t.token for t in y.top_logprobs] == [t.token for t in x.top_logprobs]


def test_concurrent_requests_match_their_solo_replies(qwen, smol):
    for plain, spec in (qwen, smol):
        prompts = [EDIT, PROMPTS[1], EDIT.replace("`joined`", "`combined`"), PROMPTS[3]]
        solo = [chat(plain.client(), p, max_tokens=100).choices[0].message.content
                for p in prompts]
        client = spec.async_client()

        async def run():
            return await asyncio.gather(*(client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], temperature=0,
                max_tokens=100) for p in prompts))

        replies = asyncio.run(run())
        assert [r.choices[0].message.content for r in replies] == solo


def test_opt_out_and_metrics(qwen):
    _, spec = qwen
    r = chat(spec.client(), EDIT, max_tokens=40, extra_body={"speculative": False})
    assert "speculation" not in (r.usage.model_extra or {})
    with httpx.Client(base_url=spec.base, timeout=30) as h:
        # Text completions carry it too.
        body = {"prompt": FUNCTION + "\n" + FUNCTION[:200], "max_tokens": 40, "temperature": 0}
        u = h.post("/v1/completions", json=body).json()["usage"]
        assert u["speculation"]["drafted"] > 0
        metrics = h.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("wick_spec_")}
    assert values["wick_spec_draft_tokens_total"] >= values["wick_spec_accepted_tokens_total"] > 0
    assert values["wick_spec_steps_total"] > 0


def test_sampled_and_constrained_requests(smol):
    _, spec = smol
    # Sampled rows speculate too (the rejection rule keeps plain sampling's distribution;
    # the Rust tests check that statistically).
    r = spec.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0.8,
        seed=3, max_tokens=30)
    assert r.usage.completion_tokens > 0
    s = (r.usage.model_extra or {}).get("speculation")
    assert s is None or 0 <= s["accepted"] <= s["drafted"]
    r = chat(spec.client(), PROMPTS[1], max_tokens=20,
             extra_body={"structured_outputs": {"choice": ["apple, banana", "cherry"]}})
    assert r.choices[0].message.content in ("apple, banana", "cherry")


def test_constrained_rows_speculate_and_keep_their_replies(smol):
    """Structured-output rows draft too: drafts are cut where the grammar refuses them and
    each position is picked under its mask, so a greedy reply is the plain server's."""
    plain, spec = smol
    ask = 'Copy this JSON exactly: {"fruit": "banana", "count": 12, "ripe": true}'
    schema = {"type": "object", "properties": {"fruit": {"type": "string"},
              "count": {"type": "integer"}, "ripe": {"type": "boolean"}},
              "required": ["fruit", "count", "ripe"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}
    cases = [dict(response_format=fmt),
             dict(extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})]
    prompts = [ask, "Copy this number exactly: 555-1234."]
    drafted = 0
    for prompt, kw in zip(prompts, cases):
        want = chat(plain.client(), prompt, max_tokens=60, **kw)
        got = chat(spec.client(), prompt, max_tokens=60, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        s = (got.usage.model_extra or {}).get("speculation")
        assert s is not None and 0 <= s["accepted"] <= s["drafted"]
        drafted += s["accepted"]
    json.loads(chat(spec.client(), ask, max_tokens=60, **cases[0]).choices[0].message.content)
    assert drafted > 0, "copying prompts keep some drafts"
