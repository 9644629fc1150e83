"""Hostile web pages and clients against a real `wick serve`: a cross-origin page in headless
Chromium, DNS-rebinding `Host` headers, keep-alive after a 401, an idle-connection flood, and
an over-limit Content-Length."""
import http.server
import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse

import httpx
import pytest

from conftest import SMOLLM, WickServer, free_port, require_model

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def steps(server: WickServer) -> int:
    """Forward passes the engine has run: unchanged means no generation ran."""
    return server.stats()["batching"]["steps"]


def find_chromium() -> str | None:
    """Debian's chromium, installed with apt-get when it is missing and we may."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, timeout=600,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        return shutil.which("chromium")
    return None


PAGE = """<!doctype html><html><body><pre id="out">running</pre><script>
const target = "%(target)s";
const out = {};
const chat = JSON.stringify(%(chat)s);
async function attempt(name, url, init) {
  try {
    const r = await fetch(url, init);
    out[name] = r.type === "opaque" ? "sent" : "read:" + r.status;
  } catch (e) {
    out[name] = "blocked";
  }
}
(async () => {
  // A CORS "simple" request: no preflight, the browser sends it as is.
  await attempt("plain", target + "/v1/chat/completions",
                {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: chat});
  await attempt("flush", target + "/admin/cache/flush", {method: "POST", mode: "no-cors"});
  // A JSON POST needs a preflight.
  await attempt("json", target + "/v1/chat/completions",
                {method: "POST", headers: {"Content-Type": "application/json"}, body: chat});
  await attempt("stats", target + "/stats", {});
  document.getElementById("out").textContent = "RESULT" + JSON.stringify(out) + "END";
  await fetch("/report?" + encodeURIComponent(JSON.stringify(out)));
})();
</script></body></html>"""


class Page:
    """A page on its own loopback origin that calls wick from the browser."""

    def __init__(self, target: str = ""):
        self.reports: list[dict] = []
        self.target = target
        reports = self.reports
        this = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                if url.path == "/report":
                    reports.append(json.loads(urllib.parse.unquote(url.query)))
                    body, kind = b"ok", "text/plain"
                else:
                    body = (PAGE % {"target": this.target, "chat": json.dumps(CHAT)}).encode()
                    kind = "text/html"
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.origin = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def visit(self, chromium: str) -> tuple[dict, str]:
        """Loads the page in headless Chromium; what it reported and its final DOM."""
        with tempfile.TemporaryDirectory() as profile:
            dom = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                 "--virtual-time-budget=20000", "--dump-dom", self.origin + "/"],
                capture_output=True, text=True, timeout=120,
            ).stdout
        deadline = time.monotonic() + 20
        while not self.reports and time.monotonic() < deadline:
            time.sleep(0.1)
        self.httpd.shutdown()
        assert self.reports, f"the page never reported; DOM: {dom[:2000]}"
        return self.reports[0], dom


@pytest.fixture(scope="module")
def chromium():
    path = find_chromium()
    if path is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    return path


def route_count(server, route: str, status: str) -> float:
    """The requests `/metrics` counted for POST `route` answered with `status`."""
    metrics = httpx.get(server.base + "/metrics").text
    key = f'route="{route}",method="POST",status="{status}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if key in line and not line.startswith("#"))


ROUTES = ("/v1/chat/completions", "/admin/cache/flush")


def test_a_cross_origin_page_cannot_run_anything(server, chromium):
    before = steps(server)
    # The session's server may have answered other tests' requests: compare counts.
    ok_before = {route: route_count(server, route, "200") for route in ROUTES}
    refused_before = {route: route_count(server, route, "403") for route in ROUTES}
    page = Page(server.base)
    report, dom = page.visit(chromium)
    # The page could send its simple requests, but could read nothing ...
    assert report["json"] == "blocked", report
    assert report["stats"] == "blocked", report
    assert "RESULT" in dom and '"json":"blocked"' in dom, dom[:2000]
    # ... and wick ran none of them.
    assert steps(server) == before, "a cross-origin request ran a generation"
    for route in ROUTES:
        assert route_count(server, route, "403") > refused_before[route], route
        assert route_count(server, route, "200") == ok_before[route], route


def test_a_cors_origin_may_call_the_api(chromium):
    """The same page, allowed with --cors-origin: the harness sees a call that works."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    page = Page()
    s = WickServer("--cors-origin", page.origin)
    try:
        page.target = s.base
        report, _ = page.visit(chromium)
        assert report["json"] == "read:200", report
        assert report["stats"] == "read:200", report
    finally:
        assert s.stop() == 0


def test_dns_rebinding_hosts_are_refused(server):
    with httpx.Client(base_url=server.base, timeout=10) as h:
        r = h.get("/stats", headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
        r = h.post("/v1/chat/completions", json=CHAT, headers={"Host": f"evil.example:{server.port}"})
        assert r.status_code == 403, r.text
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
            assert h.get("/health", headers={"Host": host}).status_code == 200


def test_text_plain_posts_are_415(server):
    with httpx.Client(base_url=server.base, timeout=10) as h:
        r = h.post("/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text


def read_response(c: socket.socket) -> tuple[str, bytes]:
    """One HTTP/1.1 response with a Content-Length body: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(65536)
        if not chunk:
            return data.decode(errors="replace"), b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = c.recv(65536)
        if not chunk:
            break
        body += chunk
    return head.decode(errors="replace"), body


def test_the_connection_survives_a_401():
    require_model(SMOLLM, "smollm2-135m-instruct")
    s = WickServer(api_key="sekret")
    try:
        # On one socket: a 401 must either say `Connection: close` or leave the socket usable.
        body = json.dumps(CHAT).encode()
        post = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n" % len(body))
        # The body follows the headers a moment later, as it does from real clients over a
        # network: the 401 is sent before the body arrives.
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.sendall(post + b"\r\n")
            time.sleep(0.3)
            c.sendall(body)
            head, _ = read_response(c)
            assert head.startswith("HTTP/1.1 401"), head
            if "connection: close" not in head.lower():
                time.sleep(0.2)
                try:
                    c.sendall(post + b"authorization: Bearer sekret\r\n\r\n" + body)
                    head, answer = read_response(c)
                except OSError as e:
                    head, answer = repr(e), b""
                assert head.startswith("HTTP/1.1 200"), f"the socket kept after a 401 failed: {head!r}"
                assert json.loads(answer)["object"] == "chat.completion"
        # A body too long to read for nothing: the 401 says the connection closes.
        big = json.dumps(dict(CHAT, messages=[{"role": "user", "content": "x" * 200_000}])).encode()
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as c:
            c.sendall(post.replace(b"%d" % len(body), b"%d" % len(big)) + b"\r\n" + big[:1000])
            head, _ = read_response(c)
            assert head.startswith("HTTP/1.1 401") and "connection: close" in head.lower(), head
        # The same with a keep-alive client.
        with httpx.Client(base_url=s.base, timeout=30) as h:
            for _ in range(3):
                r = h.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 401, r.text
                r = h.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
                assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0


def test_health_answers_during_an_idle_connection_flood():
    require_model(SMOLLM, "smollm2-135m-instruct")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2200:
        if hard != resource.RLIM_INFINITY and hard < 2200:
            pytest.skip(f"the open-file limit ({hard}) is too low for a 2,000-socket flood")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2200, hard))
    # Idle sockets stay open for the whole test: the cap, not the header timeout, makes room.
    s = WickServer("--max-connections", "500", "--header-timeout", "30")
    flood = []
    try:
        for _ in range(2000):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            flood.append(c)
        worst = 0.0
        for _ in range(10):
            started = time.monotonic()
            r = httpx.get(s.base + "/health", timeout=5)
            assert r.status_code == 200
            worst = max(worst, time.monotonic() - started)
        assert worst < 2.0, worst
    finally:
        for c in flood:
            c.close()
        assert s.stop() == 0


def test_an_over_limit_content_length_is_413_at_once(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as c:
        started = time.monotonic()
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                  b"content-length: 999999999\r\n\r\n{")
        answer = c.recv(4096).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 413"), answer
        assert time.monotonic() - started < 2.0


def test_unknown_fields_are_logged_once_per_name(server):
    with httpx.Client(base_url=server.base, timeout=60) as h:
        for _ in range(2):
            r = h.post("/v1/chat/completions", json=dict(CHAT, lora="my-adapter"))
            assert r.status_code == 200, r.text
    warnings = [line for line in server.logs().splitlines() if "not supported by wick" in line and "lora" in line]
    assert len(warnings) == 1, warnings
