"""Discovery and operations endpoints: /health, /v1, /v1/models, /stats, /metrics."""
import re


def test_health_body_is_exact(server):
    with server.http() as h:
        r = h.get("/health")
    assert r.status_code == 200
    assert r.content == b'{"status": "ok"}'
    assert r.headers["content-type"] == "application/json"


def test_index(server):
    with server.http() as h:
        body = h.get("/v1").json()
    assert body["name"] == "wick" and body["model"] == "smollm2-135m-instruct"
    assert "POST /v1/chat/completions" in body["endpoints"]
    # The list is the router's own: every listed GET without a parameter answers.
    with server.http() as h:
        for endpoint in body["endpoints"]:
            method, path = endpoint.split(" ", 1)
            if method == "GET" and "{" not in path:
                assert h.get(path).status_code == 200, endpoint


def test_models(client, server):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["smollm2-135m-instruct"]
    m = client.models.retrieve("smollm2-135m-instruct")
    assert m.id == "smollm2-135m-instruct" and m.owned_by == "wick"
    assert m.model_extra["context_window"] == server.stats()["server"]["context_length"]


def test_stats_fields(server, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    s = server.stats()
    assert set(s) >= {"server", "queue", "batch", "tokens_per_second", "cache", "memory", "requests", "engine"}
    assert s["queue"]["limit"] == 64 and s["batch"]["configured"] == 8
    assert s["memory"]["weights_bytes"] > 10_000_000
    assert s["memory"]["rss_bytes"] > s["memory"]["weights_bytes"] / 4
    assert s["engine"]["completed"] >= 1
    assert s["tokens_per_second"]["decode"] >= 0


def test_metrics_prometheus_text(server, client):
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   stream=True).close()
    with server.http() as h:
        h.get("/no/such/route")
        r = h.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert re.search(r'wick_http_requests_total\{route="/v1/chat/completions",method="POST",status="200"\} \d+', text)
    assert re.search(r'wick_http_requests_total\{route="unmatched",method="GET",status="404"\} \d+', text)
    assert re.search(r'wick_http_errors_total\{code="route_not_found"\} \d+', text)
    for name in ["wick_time_to_first_token_seconds_bucket", "wick_inter_token_latency_seconds_count",
                 "wick_prompt_tokens_total", "wick_generation_tokens_total", "wick_queue_depth",
                 "wick_batch_size", "wick_running_sequences", "wick_kv_cache_bytes"]:
        assert name in text, name
    count = re.search(r"wick_time_to_first_token_seconds_count (\d+)", text)
    assert int(count.group(1)) >= 1
    # every sample line parses as `name{labels} value`, names as Prometheus allows them
    # (colons too: the vLLM-named gauges routers read are `vllm:…`)
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-z_]+="(?:[^"\\]|\\.)*",?)*\})? ([-+0-9.eE]+|NaN|\+Inf)', line), line


def test_server_heap_asks_for_huge_pages(server):
    """Where the kernel gives transparent huge pages only on request (THP `madvise`) and the
    C library is glibc, `wick` re-executes itself with glibc's huge-page tunable, so the
    weights and KV blocks it streams every step sit on 2 MiB pages."""
    import os
    import platform
    from pathlib import Path

    import pytest

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or not thp.exists():
        pytest.skip("glibc Linux with transparent huge pages only")
    if "[madvise]" not in thp.read_text() or "GLIBC_TUNABLES" in os.environ:
        pytest.skip("the kernel does not want a request, or the tunables are the caller's")
    environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
    assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
