"""Replicas behind a router: the worker endpoints routers read (`/get_load`, `/version`,
`/server_info`, the vLLM-named gauges in `/metrics`) behind `--api-key`, and two live
`wick serve` processes sharing one `--ssd-cache` directory, each restoring prefixes the
other computed on its first request for them."""
import re
import time

import httpx

from conftest import SMOLLM, WickServer, require_model

# A long shared system prompt, so a restored prefix is unmistakable in cached_tokens.
SYSTEM = "You are a terse assistant for a warehouse team. " + " ".join(
    f"Rule {i}: bin {i} holds part {i * 13 % 97}, restock at {i % 9 + 1} units." for i in range(24))


def chat(server: WickServer, messages: list[dict], max_tokens: int = 8) -> dict:
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def flushed(server: WickServer):
    with server.http() as h:
        r = h.post("/admin/cache/flush")
    assert r.status_code == 200, r.text


def stopped(server: WickServer):
    code = server.stop()
    assert code == 0, f"wick serve exited with {code}:\n{server.logs()}"


def test_router_endpoints_and_vllm_gauges_honour_the_api_key():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--model-id", "smol", api_key="k3y")
    try:
        bare = httpx.Client(base_url=s.base, timeout=30)
        assert bare.get("/health").status_code == 200
        for path in ("/get_load", "/version", "/server_info", "/metrics"):
            r = bare.get(path)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["type"]
        with s.http() as h:
            load = h.get("/get_load").json()
            assert load == {"load": 0, "num_waiting_reqs": 0, "num_running_reqs": 0,
                            "kv_cache_usage": 0.0}, load
            assert re.fullmatch(r"\d+\.\d+\.\d+.*", h.get("/version").json()["version"])
            info = h.get("/server_info").json()
            assert info["model"] == "smol" and info["server"] == "wick"
            assert info["max_batch"] >= 1 and info["kv_total_blocks"] > 0
            chat(s, [{"role": "user", "content": "Say hi."}])
            text = h.get("/metrics").text
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "gpu_cache_usage_perc"):
            assert f"# TYPE vllm:{name} gauge" in text, name
            m = re.search(rf'^vllm:{name}{{model_name="smol"}} (\S+)$', text, re.M)
            assert m, name
            assert 0.0 <= float(m.group(1)) <= (1.0 if "perc" in name else 64), (name, m.group(1))
        # wick's own gauges are still there
        assert "wick_queue_depth" in text and "wick_kv_blocks" in text
    finally:
        stopped(s)


def test_render_endpoints_give_the_prompt_the_request_would_run_and_load_can_be_public():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--model-id", "smol", "--public-load", api_key="k3y")
    try:
        bare = httpx.Client(base_url=s.base, timeout=30)
        # --public-load: the load poll needs no key; everything else still does.
        assert bare.get("/get_load").json()["load"] == 0
        assert bare.post("/v1/chat/completions/render", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Bin 3?"}]
        with s.http() as h:
            r = h.post("/v1/chat/completions/render", json={
                "model": "m", "messages": messages, "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200, r.text
            rendered = r.json()
            assert rendered["request_id"].startswith("chatcmpl-")
            assert rendered["sampling_params"]["max_tokens"] == 5
            ids = rendered["token_ids"]
            # The ids are the prompt the chat endpoint runs: its usage counts them.
            reply = chat(s, messages, max_tokens=5)
            assert reply["usage"]["prompt_tokens"] == len(ids)
            # A longer conversation renders to an extension of the shorter one's ids
            # (what a router's token-prefix matching relies on).
            longer = messages + [{"role": "assistant", "content": "Part 39."},
                                 {"role": "user", "content": "Bin 4?"}]
            ids2 = h.post("/v1/chat/completions/render",
                          json={"model": "m", "messages": longer}).json()["token_ids"]
            assert len(ids2) > len(ids) and ids2[:len(ids) - 3] == ids[:len(ids) - 3]
            # Completions: a list with one rendered prompt; token input passes through.
            r = h.post("/v1/completions/render", json={"model": "m", "prompt": "Hello there"})
            assert r.status_code == 200, r.text
            [one] = r.json()
            assert one["request_id"].startswith("cmpl-") and len(one["token_ids"]) >= 2
            r = h.post("/v1/completions/render", json={"model": "m", "prompt": [1, 2, 3]})
            assert r.json()[0]["token_ids"] == [1, 2, 3]
            # Same validation as the generating endpoints, same error shape.
            r = h.post("/v1/chat/completions/render", json={"model": "m", "messages": []})
            assert r.status_code == 400 and r.json()["error"]["type"]
            r = h.post("/v1/completions/render", json={"model": "m", "prompt": [10**9]})
            assert r.status_code == 400 and "prompt[0]" in r.text
    finally:
        stopped(s)


def test_two_live_replicas_share_one_ssd_cache(tmp_path):
    require_model(SMOLLM, "smollm2-135m-instruct")
    root = tmp_path / "shared"
    args = ("--ssd-cache", str(root), "--ssd-write-max-defer", "1")
    a = WickServer(*args)
    b = None
    try:
        # A serves conversation 1's first turn and makes it durable.
        conv1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "Where is part 26?"}]
        first = chat(a, conv1)
        assert first["usage"]["prompt_tokens"] > 300
        flushed(a)
        # B joins while A runs: its first request, the next turn of a conversation it never
        # saw, restores A's prefix from the shared directory.
        b = WickServer(*args)
        conv1 += [first["choices"][0]["message"], {"role": "user", "content": "And part 39?"}]
        turn2 = chat(b, conv1)
        assert cached(turn2) >= first["usage"]["prompt_tokens"] - 8, turn2["usage"]
        stats = b.stats()
        assert stats["prompt_cache"]["ssd_hits"] == 1, stats["prompt_cache"]
        assert stats["prompt_cache"]["misses"] == 0
        # The other way round while both run: B's new conversation reaches A through A's
        # refresh of the directory (about a second).
        conv2 = [{"role": "system", "content": SYSTEM + " Answer in French."},
                 {"role": "user", "content": "Where is part 52?"}]
        b_first = chat(b, conv2)
        flushed(b)
        conv2 += [b_first["choices"][0]["message"], {"role": "user", "content": "Merci."}]
        deadline = time.monotonic() + 10
        while a.stats()["ssd_cache"]["entries"] < 2:
            assert time.monotonic() < deadline, "A never saw B's entry"
            time.sleep(0.1)
        turn2 = chat(a, conv2)
        assert cached(turn2) >= b_first["usage"]["prompt_tokens"] - 8, turn2["usage"]
        assert a.stats()["prompt_cache"]["ssd_hits"] >= 1
        for s in (a, b):
            st = s.stats()
            assert st["ssd_cache"]["restore_failures"] == 0
            assert st["requests"]["failed"] == 0
    finally:
        if b is not None:
            stopped(b)
        stopped(a)
    # Both owners are gone: no lock files or temporary files are left behind.
    assert not list(root.rglob("*.tmp"))
    assert not list(root.rglob(".owner-*.lock"))


def test_replica_killed_mid_reply_and_restarted_loses_nothing(tmp_path):
    """kill -9 of a replica in the middle of a streamed reply: the client's stream ends (it
    does not hang), the surviving replica and the restarted one both restore the dead one's
    prefixes from the shared directory, and the dead owner's lock is reaped. Every wait here
    is bounded, so a regression fails the test instead of stalling the suite."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    root = tmp_path / "shared"
    args = ("--ssd-cache", str(root), "--ssd-write-max-defer", "1")
    a = WickServer(*args)
    b = restarted = None
    try:
        conv = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Where is part 26?"}]
        first = chat(a, conv)
        # No flush: the write deferral (1 s) alone makes the prefix durable.
        deadline = time.monotonic() + 15
        while a.stats()["ssd_cache"]["entries"] < 1:
            assert time.monotonic() < deadline, "A never wrote its prefix"
            time.sleep(0.1)
        b = WickServer(*args)

        # A long streamed reply on A; A dies after the first few chunks.
        chunks = 0
        with httpx.Client(base_url=a.base, timeout=httpx.Timeout(30.0)) as h:
            try:
                with h.stream("POST", "/v1/chat/completions", json={
                        "model": "m", "stream": True, "max_tokens": 400, "temperature": 0,
                        "ignore_eos": True,
                        "messages": conv + [{"role": "assistant", "content": "Bin 26."},
                                            {"role": "user", "content": "List every bin."}]}) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if chunks == 3:
                                a.proc.kill()
                                a.proc.wait(10)
            except httpx.HTTPError:
                pass  # the cut connection, as a client sees it
        assert chunks >= 3 and a.proc.returncode == -9, (chunks, a.proc.returncode)

        # The survivor restores the dead replica's prefix.
        conv += [first["choices"][0]["message"], {"role": "user", "content": "And part 39?"}]
        turn = chat(b, conv)
        assert cached(turn) >= first["usage"]["prompt_tokens"] - 8, turn["usage"]

        # The dead replica comes back on the same directory and restores it too.
        restarted = WickServer(*args)
        again = chat(restarted, conv)
        assert cached(again) >= first["usage"]["prompt_tokens"] - 8, again["usage"]
        assert again["choices"][0]["message"]["content"] == turn["choices"][0]["message"]["content"]
        for s in (b, restarted):
            st = s.stats()
            assert st["ssd_cache"]["restore_failures"] == 0, st["ssd_cache"]
            assert st["requests"]["failed"] == 0, st["requests"]
    finally:
        if a.proc.poll() is None:
            a.proc.kill()
            a.proc.wait(10)
        for s in (restarted, b):
            if s is not None:
                stopped(s)
    # The killed owner's lock and temporary files were reaped by the replicas that outlived it.
    assert not list(root.rglob("*.tmp"))
    assert not list(root.rglob(".owner-*.lock"))
