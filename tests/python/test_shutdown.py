"""SIGTERM: stop accepting, finish or cancel in-flight work within the grace period, exit 0; an
engine panic: fail the work in flight, stop reporting healthy, exit non-zero."""
import signal
import threading
import time

import httpx

from conftest import ROOT, WickServer, require_model, SMOLLM


def test_sigterm_with_a_stream_in_flight_exits_zero():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer("--shutdown-grace", "1")
    events = []

    def stream():
        try:
            with httpx.Client(base_url=s.base, timeout=30) as h:
                with h.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Write a long essay."}],
                        "max_tokens": 5000, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            events.append(line)
        except httpx.HTTPError as e:
            events.append(f"closed: {e}")

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(events) >= 3
    started = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(timeout=15)
    took = time.monotonic() - started
    t.join(timeout=5)
    assert code == 0, s.logs()
    assert took < 6, f"shutdown took {took:.1f}s"
    # The stream was cut by the grace period: its last frame says why, and the connection
    # closed cleanly after it (no transport error).
    assert not any(e.startswith("closed") for e in events), events[-3:]
    assert "the server is shutting down" in events[-1], events[-3:]
    assert '"error"' in events[-1], events[-3:]
    assert "ready in" in s.logs()


def test_sigint_idle_exits_zero():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=15) == 0, s.logs()


def test_an_engine_panic_fails_the_request_then_the_server_exits_nonzero():
    """A panic on the engine thread (injected with WICK_TEST_PANIC_AT_STEP; it stands for any bug
    in a forward pass) fails the request in flight with the reason, `/health` stops answering ok
    (503, then the port closes) and the process exits non-zero, for its supervisor to restart."""
    tiny = ROOT / "crates" / "wick-engine" / "tests" / "goldens" / "hf" / "qwen2"
    s = WickServer(str(tiny), "--shutdown-grace", "1", env={"WICK_TEST_PANIC_AT_STEP": "0"})
    with httpx.Client(base_url=s.base, timeout=30) as h:
        r = h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("generation failed: the engine stopped after an internal error"), message
        assert "generation failed: generation failed" not in message, message
        try:
            health = h.get("/health")
            assert health.status_code == 503, health.text
            assert health.json()["status"] == "error", health.text
        except httpx.TransportError:
            pass  # already shut down
    code = s.proc.wait(timeout=20)
    assert code != 0, s.logs()
    assert "the engine stopped after an internal error" in s.logs()
