"""Draft-model speculative decoding (`wick serve --draft-model MODEL`): the default model
drafting for itself gives greedy replies byte-identical to the plain server's, alone and
concurrently, and keeps its drafts; `usage.speculation` is reported on chat, Anthropic
Messages (also through the SDK's stream helper) and Responses; a draft model with another
tokenizer, and contradictory flags, are clear start-up errors; with the prompt cache on, a
conversation's next turn restores the draft's KV of the history, which the draft then does
not compute again."""
import asyncio
import subprocess

import anthropic
import httpx
import pytest

from conftest import SMOLLM, WICK_HOME, WickServer, ensure_binary, require_model

GEMMA = WICK_HOME / "models" / "gemma-3-270m" / "gemma-3-270m-q4_k_m.gguf"

PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana.",
    "Write a short poem about the sea.",
    "Count from one to fifteen in words, separated by commas.",
]


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], temperature=0, **kw)


@pytest.fixture(scope="module")
def servers():
    require_model(SMOLLM, "smollm2-135m-instruct")
    plain = WickServer(str(SMOLLM), "--prompt-cache", "0")
    draft = WickServer(str(SMOLLM), "--prompt-cache", "0", "--draft-model", str(SMOLLM))
    yield plain, draft
    for s in (plain, draft):
        assert s.stop() == 0, s.logs()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_replies_are_unchanged(servers, prompt):
    plain, draft = servers
    a = chat(plain.client(), prompt, max_tokens=80)
    b = chat(draft.client(), prompt, max_tokens=80)
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.completion_tokens == a.usage.completion_tokens
    s = b.usage.model_extra["speculation"]
    # Drafting for itself, the draft is nearly always right.
    assert s["drafted"] > 0 and s["accepted"] >= 0.8 * s["drafted"], s


def test_concurrent_replies_match_their_solo_replies(servers):
    plain, draft = servers
    solo = [chat(plain.client(), p, max_tokens=60).choices[0].message.content for p in PROMPTS]
    client = draft.async_client()

    async def run():
        return await asyncio.gather(*(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=60) for p in PROMPTS))

    assert [r.choices[0].message.content for r in asyncio.run(run())] == solo


def test_sampled_requests_run_to_their_length(servers):
    _, draft = servers
    r = draft.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0.8,
        seed=4, max_tokens=40, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40
    s = r.usage.model_extra["speculation"]
    assert 0 < s["accepted"] <= s["drafted"], s


def test_anthropic_and_responses_report_speculation(servers):
    plain, draft = servers
    claude = anthropic.Anthropic(base_url=draft.base, api_key="none", max_retries=0)
    kinds, deltas = [], []
    with claude.messages.stream(
        model="m", max_tokens=40, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": PROMPTS[0]}],
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "message_delta":
                deltas.append(event.usage.model_dump())
        final = stream.get_final_message()
    assert kinds[-1] == "message_stop" and final.usage.output_tokens > 0
    assert deltas and deltas[-1]["speculation"]["drafted"] > 0, deltas
    body = {"model": "m", "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[0]}]}
    with httpx.Client(timeout=120) as h:
        whole = h.post(draft.base + "/v1/messages", json=body).json()
        alone = h.post(plain.base + "/v1/messages", json=body).json()
        assert whole["content"] == alone["content"]
        assert whole["usage"]["speculation"]["accepted"] > 0
        assert "speculation" not in alone["usage"]
        resp = h.post(draft.base + "/v1/responses", json={
            "model": "m", "input": PROMPTS[0], "max_output_tokens": 40, "temperature": 0}).json()
        assert resp["usage"]["speculation"]["drafted"] > 0, resp["usage"]
        opted_out = h.post(draft.base + "/v1/responses", json={
            "model": "m", "input": PROMPTS[0], "max_output_tokens": 20, "temperature": 0,
            "speculative": False}).json()
        assert "speculation" not in opted_out["usage"]


def spec_metrics(h: httpx.Client) -> dict:
    return {line.split()[0]: float(line.split()[1]) for line in h.get("/metrics").text.splitlines()
            if line.startswith("wick_spec_")}


def test_the_next_turn_restores_the_drafts_cache():
    require_model(SMOLLM, "smollm2-135m-instruct")
    server = WickServer(str(SMOLLM), "--draft-model", str(SMOLLM))
    try:
        client = server.client()
        history = [{"role": "system", "content": "You are a storyteller. " * 80},
                   {"role": "user", "content": "Tell a story about a mill by a river."}]
        first = client.chat.completions.create(model="m", messages=history, temperature=0,
                                               max_tokens=40)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Now tell it once more."}]
        with httpx.Client(base_url=server.base, timeout=30) as h:
            before = spec_metrics(h)
            second = client.chat.completions.create(model="m", messages=history, temperature=0,
                                                    max_tokens=40)
            after = spec_metrics(h)
        prompt = second.usage.prompt_tokens
        restored = (after["wick_spec_draft_model_cached_tokens_total"]
                    - before["wick_spec_draft_model_cached_tokens_total"])
        computed = (after["wick_spec_draft_model_tokens_total"]
                    - before["wick_spec_draft_model_tokens_total"])
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        # The first turn's prompt (the system prompt alone is hundreds of tokens).
        assert restored >= first.usage.prompt_tokens, (restored, prompt)
        # The draft computed the new tokens and its drafts, less than the history it would
        # otherwise compute again.
        assert computed < prompt, (computed, restored, prompt)
        assert second.usage.model_extra["speculation"]["accepted"] > 0
    finally:
        assert server.stop() == 0, server.logs()


def serve_fails(*args: str) -> str:
    r = subprocess.run([str(ensure_binary()), "serve", *args, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr
    return r.stderr


def test_a_draft_with_another_tokenizer_is_a_startup_error():
    require_model(SMOLLM, "smollm2-135m-instruct")
    if not GEMMA.is_file():
        pytest.skip(f"{GEMMA} is missing: run `wick pull gemma3`")
    err = serve_fails(str(SMOLLM), "--draft-model", str(GEMMA))
    assert "tokenizers differ" in err and "gemma" in err.lower() and "SmolLM2" in err, err


def test_contradictory_flags_are_refused():
    assert "--draft-model" in serve_fails("--spec", "draft")
    assert "--spec draft" in serve_fails("--spec", "ngram", "--draft-model", str(SMOLLM))
