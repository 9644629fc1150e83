"""Continuous batching through the openai SDK: concurrent clients with mixed prompt lengths and
sampling settings get the answers they get alone, also from a server whose KV memory is too
small to hold them all (queueing and preemption), and /stats and /metrics show it."""
import asyncio
import threading
import time

import openai
import pytest

from conftest import WickServer, require_model, SMOLLM

TOKENS = 40
TOPICS = ["the sea", "a bakery", "mountains", "an old clock", "trains", "winter", "a garden", "stars"]


def messages(i: int) -> list[dict]:
    """Mixed prompt lengths: from one line to a few paragraphs."""
    filler = " The road went on past fields and farms, and the travellers kept walking." * (i * 2)
    return [{"role": "user", "content": f"Write about {TOPICS[i]}.{filler}"}]


def sampling(i: int) -> dict:
    """Every other request greedy; the others seeded nucleus sampling at different settings."""
    if i % 2 == 0:
        return {"temperature": 0}
    return {"temperature": 0.6 + 0.1 * i, "top_p": 0.9, "seed": 1000 + i}


def ask(client: openai.OpenAI, i: int) -> str:
    r = client.chat.completions.create(model="m", messages=messages(i), max_tokens=TOKENS,
                                       extra_body={"ignore_eos": True}, **sampling(i))
    assert r.usage.completion_tokens == TOKENS
    return r.choices[0].message.content


async def ask_streaming(client: openai.AsyncOpenAI, i: int) -> str:
    stream = await client.chat.completions.create(
        model="m", messages=messages(i), max_tokens=TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampling(i))
    text, usage = "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
    assert usage.completion_tokens == TOKENS
    return text


def concurrently(server: WickServer, n: int) -> list[str]:
    client = server.async_client()

    async def run():
        return await asyncio.gather(*(ask_streaming(client, i) for i in range(n)))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def batch_server():
    """The default model on its own server (its prompt cache fills up here, not in the shared
    session server other tests expect cold)."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def alone(batch_server) -> list[str]:
    """Each request's answer when it runs by itself."""
    client = batch_server.client()
    return [ask(client, i) for i in range(len(TOPICS))]


def test_concurrent_answers_equal_single_requests(batch_server, alone):
    got = concurrently(batch_server, len(TOPICS))
    for i, (a, b) in enumerate(zip(got, alone)):
        assert a == b, f"request {i} ({sampling(i)}) differs in a batch"
    stats = batch_server.stats()
    assert stats["batching"]["batch_size"]["avg"] > 1, stats["batching"]


def test_small_kv_memory_queues_and_preempts_but_answers_stay_correct(alone):
    require_model(SMOLLM, "smollm2-135m-instruct")
    # SmolLM2-135M: 30 layers x 16 tokens x 3 KV heads x 64 dims x 2 x 4 bytes = 720 KiB per
    # 16 tokens, so 16 MiB hold about 360 tokens: one to four of these requests at once.
    s = WickServer("--kv-memory", "16M", "--max-batch", "8", "--step-tokens", "64")
    try:
        stats0 = s.stats()
        kv = stats0["batching"]["kv_blocks"]
        assert kv["total"] == 16 * 2**20 // kv["block_bytes"], kv
        limit = stats0["admission"]["max_safe_context"]

        # A request the pool could never hold is refused before any work.
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(model="m", messages=messages(0), max_tokens=limit)
        assert e.value.body["code"] == "kv_capacity_exceeded"
        assert "max_tokens" == e.value.body["param"]

        seen = {"waiting": 0, "used": 0, "running": 0}
        done = threading.Event()

        def watch():
            while not done.is_set():
                b = s.stats()["batching"]
                seen["waiting"] = max(seen["waiting"], b["waiting"])
                seen["running"] = max(seen["running"], b["running"])
                seen["used"] = max(seen["used"], b["kv_blocks"]["used"])
                assert b["kv_blocks"]["used"] <= b["kv_blocks"]["total"], b
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        got = concurrently(s, len(TOPICS))
        done.set()
        watcher.join()
        for i, (a, b) in enumerate(zip(got, alone)):
            assert a == b, f"request {i} ({sampling(i)}) differs under memory pressure"

        after = s.stats()["batching"]
        assert after["preemptions"] > 0 or seen["waiting"] > 0, (after, seen)
        assert seen["running"] >= 2, seen
        assert after["kv_blocks"]["used"] == 0, after
        with s.http() as h:
            metrics = h.get("/metrics").text
        assert f"wick_preemptions_total {after['preemptions']}" in metrics
        assert 'wick_kv_blocks{state="total"}' in metrics
        print(f"small pool: preemptions {after['preemptions']}, most waiting {seen['waiting']}, "
              f"most blocks used {seen['used']} of {kv['total']}")
    finally:
        assert s.stop() == 0
