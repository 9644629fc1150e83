"""SIGTERM: stop accepting, finish or cancel in-flight work within the grace period, exit 0."""
import signal
import threading
import time

import httpx

from conftest import WickServer, require_model, SMOLLM


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
