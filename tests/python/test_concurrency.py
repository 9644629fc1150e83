"""Many clients at once, a full queue, and clients that hang up mid-stream."""
import asyncio
import threading
import time

import httpx
import pytest

from conftest import WickServer, require_model, SMOLLM

CLIENTS = 16
TOKENS = 12


def test_sixteen_concurrent_streams_all_complete(server):
    client = server.async_client()

    async def one(i):
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish, chunks = "", None, None, 0
        async for chunk in stream:
            chunks += 1
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, usage, finish

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(CLIENTS)))

    before = server.stats()["engine"]
    started = time.monotonic()
    results = asyncio.run(all_of_them())
    took = time.monotonic() - started
    assert len(results) == CLIENTS
    for text, usage, finish in results:
        assert finish == "length"
        assert usage.completion_tokens == TOKENS
        assert usage.total_tokens == usage.prompt_tokens + TOKENS
        assert text
    after = server.stats()["engine"]
    # The streams were decoded together: some forward passes carried several sequences,
    # and there were far fewer passes than one per generated token.
    def multi(e):
        h = e["batch_size"]
        return h["count"] - h["counts"][0]
    assert multi(after) > multi(before), after["batch_size"]
    steps = after["steps"] - before["steps"]
    assert steps < CLIENTS * TOKENS / 2, f"{steps} forward passes for {CLIENTS * TOKENS} tokens"
    print(f"{CLIENTS} streams x {TOKENS} tokens in {took:.2f}s")


def test_full_queue_answers_429_with_retry_after():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--max-batch", "1", "--max-queue", "1")
    try:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        holders = []

        def hold():
            with httpx.Client(base_url=s.base, timeout=60) as h:
                with h.stream("POST", "/v1/chat/completions", json=body) as r:
                    holders.append(r.status_code)
                    for _ in r.iter_lines():
                        if len(holders) > 10:
                            break

        threads = [threading.Thread(target=hold, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        # one running, one waiting: the next is refused
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = s.stats()
            if st["batch"]["active_rows"] == 1 and st["queue"]["waiting"] == 1:
                break
            time.sleep(0.05)
        with httpx.Client(base_url=s.base, timeout=30) as h:
            r = h.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        holders.extend([0] * 20)  # let the holders hang up
    finally:
        assert s.stop() == 0


def test_a_burst_is_not_refused_while_batch_places_are_free():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--max-batch", "3", "--max-queue", "0")
    try:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                "ignore_eos": True}
        codes = []

        def one():
            with httpx.Client(base_url=s.base, timeout=60) as h:
                codes.append(h.post("/v1/chat/completions", json=body).status_code)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [200, 200, 200]
    finally:
        assert s.stop() == 0


def test_disconnect_cancels_the_generation(server):
    before = server.stats()["engine"]
    with httpx.Client(base_url=server.base, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Write a very long essay."}],
                "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines += 1
                if lines >= 5:
                    break
    # the client is gone: the engine must drop the request within a step or so
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = server.stats()["engine"]
        if now["cancelled"] > before["cancelled"] and now["running"] == 0:
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"generation still running after the client left: {server.stats()}")
    stats = server.stats()
    assert stats["memory"]["kv_bytes"] == 0, stats["memory"]
    assert stats["engine"]["kv_pool"]["used_blocks"] == 0, stats["engine"]["kv_pool"]
    generated = stats["engine"]["generated_tokens_total"]
    time.sleep(0.3)
    assert server.stats()["engine"]["generated_tokens_total"] == generated
    assert generated - before["generated_tokens_total"] < 500
