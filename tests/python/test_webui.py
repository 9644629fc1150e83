"""The web UI in a real browser: Debian's chromium driven by Playwright against `wick serve` on
the default model. Each page loads with no console errors; a chat message streams a reply whose
text is the API's own answer; stop ends a generation (the server counts it cancelled); a tool
call is shown with its name and arguments; the status page's numbers are /stats' numbers and
move live; downloads and the library are listed; with --api-key the page asks for the key,
refuses a wrong one and works after the right one; model text cannot inject markup; controls
are labelled; text contrast meets WCAG AA in both colour schemes; a narrow window works.

Skips (saying why) only when chromium is missing and cannot be installed (scripts/test.sh
installs Debian's package; as root the fixture does too).
`WICK_UI_SCREENSHOTS=1` also writes docs/ui-chat.png, docs/ui-status.png and docs/ui-finetune.png
(scripts/ui_screenshots.sh)."""
import json
import os
import re
import time

import httpx
import pytest

from conftest import ROOT, SMOLLM, TEMPLATES, WEATHER, _serve, require_model
from test_security import find_chromium

SCREENSHOTS = os.environ.get("WICK_UI_SCREENSHOTS") == "1"
KEY = "webui-test-key"
GOLDENS = ROOT / "crates" / "wick-engine" / "tests" / "goldens"


@pytest.fixture(scope="module")
def ui_server():
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve()


@pytest.fixture(scope="module")
def keyed_server():
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve(api_key=KEY)


@pytest.fixture(scope="module")
def think_ui_server():
    """The default model with a template that opens <think>: replies start with reasoning."""
    require_model(SMOLLM, "smollm2-135m-instruct")
    yield from _serve("--chat-template", str(TEMPLATES / "think.jinja"))


@pytest.fixture(scope="module")
def adapter_server():
    """The tiny random Llama with two LoRA adapters mounted (test_adapters.py's)."""
    adapters = GOLDENS / "adapters"
    yield from _serve(str(GOLDENS / "hf" / "llama"), "--adapter", str(adapters / "peft_a"),
                      "--adapter", str(adapters / "mlx_c"))


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed and cannot be installed here (needs root and apt-get)")
    with sync_playwright() as p:
        # As root (CI), chromium's sandbox cannot start.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        b = p.chromium.launch(executable_path=chromium, args=args)
        yield b
        b.close()


class Page:
    """A fresh browser context and page that records console errors and page exceptions."""

    def __init__(self, browser, base, width=1100, height=760):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.base = base
        self.errors = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.set_default_timeout(60_000)

    def open(self, route):
        self.page.goto(f"{self.base}/#/{route}")
        return self.page

    def assert_clean(self, allowed=()):
        errors = [e for e in self.errors if not any(a in e for a in allowed)]
        assert not errors, errors


@pytest.fixture
def ui(browser, ui_server):
    p = Page(browser, ui_server.base)
    yield p
    p.context.close()


def set_sampling(page, **values):
    page.click("#sampling-button")
    for name, value in values.items():
        page.fill(f"#s-{name}", str(value))
    page.keyboard.press("Escape")


def model_id(server):
    return server.stats()["server"]["model"]


def wait_for_model(page):
    page.wait_for_function("() => document.getElementById('model-name')?.textContent.length > 1")


def send(page, text):
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator(".msg.assistant").last


def stored_conversations(page):
    return page.evaluate("import('/ui/js/store.js').then((s) => s.list())")


def test_assets_have_types_policy_and_cache_headers(ui_server):
    with httpx.Client(base_url=ui_server.base) as h:
        page = h.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        csp = page.headers["content-security-policy"]
        for directive in ["default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"]:
            assert directive in csp
        assert "unsafe" not in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-cache"
        again = h.get("/", headers={"If-None-Match": page.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        assert h.get("/ui/js/app.js").headers["content-type"] == "text/javascript; charset=utf-8"
        assert h.get("/ui/style.css").headers["content-type"] == "text/css; charset=utf-8"
        missing = h.get("/ui/js/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "route_not_found"
        # The UI changed nothing of the guard: a cross-site POST is still refused.
        evil = h.post("/v1/chat/completions", headers={"Origin": "http://evil.example"},
                      json={"messages": [{"role": "user", "content": "hi"}]})
        assert evil.status_code == 403


def test_chat_streams_the_reply_the_api_gives(ui, ui_server):
    page = ui.open("chat")
    wait_for_model(page)
    set_sampling(page, temperature=0, max_tokens=24, seed=7)
    send(page, "What is the capital of France?")
    reply = last_reply(page)
    reply.locator(".msg-stats").wait_for()
    stats = reply.locator(".msg-stats")
    assert int(stats.get_attribute("data-completion-tokens")) > 0
    assert stats.get_attribute("data-finish") in ("stop", "length")
    assert "tok/s" in stats.inner_text()
    # The streamed, stored text is what the API answers to the same request.
    stored = stored_conversations(page)[0]
    assert stored["title"] == "What is the capital of France?"
    content = stored["messages"][-1]["content"]
    want = ui_server.client().chat.completions.create(
        model=model_id(ui_server), messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=24, seed=7).choices[0].message.content
    assert content == want
    assert reply.locator(".content").inner_text().strip()
    if SCREENSHOTS:
        page.screenshot(path=str(ROOT / "docs" / "ui-chat.png"))
    # The conversation survives a reload (IndexedDB), and regenerate gives the same text.
    page.reload()
    last_reply(page).locator(".msg-stats").wait_for()
    assert page.locator(".conv-open[aria-current='true']").inner_text() == "What is the capital of France?"
    page.click(".msg.assistant button.regenerate")
    page.wait_for_selector("#send:enabled")
    last_reply(page).locator(".msg-stats").wait_for()
    assert stored_conversations(page)[0]["messages"][-1]["content"] == want
    ui.assert_clean()


def test_edit_and_resend_replaces_the_rest(ui):
    page = ui.open("chat")
    page.click("#new-chat")
    set_sampling(page, temperature=0, max_tokens=8)
    send(page, "Say one word.")
    last_reply(page).locator(".msg-stats").wait_for()
    page.click(".msg.user button.edit")
    page.fill(".msg.user .editor textarea", "Say two words.")
    page.click(".msg.user .editor button.primary")
    page.wait_for_selector(".msg.user .content:has-text('Say two words.')")
    last_reply(page).locator(".msg-stats").wait_for()
    messages = stored_conversations(page)[0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Say two words."
    # Rename and delete from the list.
    page.click(".conv-list li.current button[title='Rename']")
    page.fill(".conv-list input.rename", "Renamed chat")
    page.press(".conv-list input.rename", "Enter")
    page.wait_for_selector(".conv-open:text('Renamed chat')")
    page.once("dialog", lambda d: d.accept())
    count = len(stored_conversations(page))
    page.click(".conv-list li.current button[title='Delete']")
    deadline = time.monotonic() + 10
    while len(stored_conversations(page)) >= count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(c["title"] != "Renamed chat" for c in stored_conversations(page))
    ui.assert_clean()


def test_stop_ends_a_generation(ui, ui_server):
    before = ui_server.stats()["requests"]["cancelled"]
    page = ui.open("chat")
    page.click("#new-chat")
    set_sampling(page, temperature=1, max_tokens=4000, seed=1)
    send(page, "Write a very long story about a lighthouse keeper.")
    # Wait until text streams, then stop.
    page.wait_for_function("() => document.querySelector('.msg.assistant:last-child .content')?.innerText.length > 20")
    page.click("#stop")
    reply = last_reply(page)
    reply.locator(".note:text('Stopped.')").wait_for()
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = ui_server.stats()
        if stats["requests"]["cancelled"] > before and stats["requests"]["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert stats["requests"]["cancelled"] > before, stats["requests"]
    assert stats["requests"]["in_flight"] == 0
    stored = stored_conversations(page)[0]["messages"][-1]
    assert stored["stopped"] and stored["content"]
    ui.assert_clean()


def test_tool_call_is_shown(ui, ui_server):
    page = ui.open("chat")
    page.click("#new-chat")
    set_sampling(page, temperature=0, max_tokens=64)
    page.click("#tools-button")
    page.fill("#tools-json", json.dumps(WEATHER))
    page.select_option("#tool-choice", "required")
    page.keyboard.press("Escape")
    send(page, "What is the weather like in Paris right now?")
    reply = last_reply(page)
    reply.locator(".msg-stats").wait_for()
    # The same request through the API: the page shows its calls, arguments and repairs.
    want = ui_server.client().chat.completions.create(
        model=model_id(ui_server), messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=WEATHER, tool_choice="required", temperature=0, max_tokens=64).choices[0]
    calls = reply.locator(".tool-call")
    assert calls.count() == len(want.message.tool_calls) > 0
    for i, call in enumerate(want.message.tool_calls):
        shown = calls.nth(i)
        assert shown.get_attribute("data-name") == call.function.name == "get_weather"
        assert shown.locator(".tool-name").inner_text() == "get_weather"
        assert re.fullmatch(r"call_[0-9a-f]{8}", shown.locator(".tool-id").inner_text())
        assert json.loads(shown.locator(".tool-args").inner_text()) == json.loads(call.function.arguments)
        repairs = (call.model_extra or {}).get("wick_repairs", [])
        badge = shown.locator(".badge")
        if repairs:
            assert badge.inner_text() == "repaired: " + ", ".join(repairs)
        else:
            assert badge.count() == 0
    assert reply.locator(".msg-stats").get_attribute("data-finish") == want.finish_reason
    # Clear the tools for later tests in this browser profile.
    page.click("#tools-button")
    page.fill("#tools-json", "")
    page.keyboard.press("Escape")
    ui.assert_clean()


def test_model_text_cannot_inject_markup(ui):
    page = ui.open("chat")
    page.wait_for_selector("#prompt")
    hostile = ("<img src=x onerror=\"window.pwned=1\"> **bold** [link](javascript:window.pwned=1) "
               "[ok](https://example.com/)\n\n```html\n<script>window.pwned=1</script>\n```\n\n- a\n- *b*\n\n| x | y |\n|---|--:|\n| 1 | 2 |")
    result = page.evaluate("""async (src) => {
        const { render } = await import('/ui/js/markdown.js');
        const div = document.createElement('div');
        div.append(render(src));
        document.body.append(div);
        await new Promise((r) => setTimeout(r, 100));
        return {
            imgs: div.querySelectorAll('img, script').length,
            strong: div.querySelector('strong')?.textContent,
            hrefs: [...div.querySelectorAll('a')].map((a) => a.getAttribute('href')),
            code: div.querySelector('pre code')?.textContent,
            lang: div.querySelector('.code-head span')?.textContent,
            items: div.querySelectorAll('li').length,
            em: div.querySelector('li em')?.textContent,
            cells: [...div.querySelectorAll('td')].map((t) => t.textContent),
            text: div.querySelector('p').textContent,
            pwned: window.pwned ?? null,
        };
    }""", hostile)
    assert result["imgs"] == 0 and result["pwned"] is None
    assert result["strong"] == "bold"
    assert result["hrefs"] == ["https://example.com/"]
    assert result["code"] == "<script>window.pwned=1</script>"
    assert result["lang"] == "html"
    assert result["items"] == 2 and result["em"] == "b"
    assert result["cells"] == ["1", "2"]
    assert result["text"].startswith('<img src=x onerror="window.pwned=1">')
    ui.assert_clean()


def stat_values(page):
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-stat]')]
        .map((d) => [d.dataset.stat, d.dataset.value]))""")


def test_status_numbers_match_stats_and_update(ui, ui_server):
    page = ui.open("status")
    page.wait_for_selector("[data-stat='server.model'][data-value]")
    stats = ui_server.stats()
    shown = stat_values(page)
    for path in ["server.model", "server.backend", "server.arch", "memory.weights_bytes", "queue.limit",
                 "batch.configured", "server.context_length", "admission.max_safe_context"]:
        want = stats
        for key in path.split("."):
            want = want[key]
        assert shown[path] == str(want), path
    cache = stats["prompt_cache"]
    # Generate, then the counters on the page follow /stats within two polls.
    ui_server.client().chat.completions.create(
        model=model_id(ui_server), messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    after = ui_server.stats()
    assert after["requests"]["completed"] > stats["requests"]["completed"]
    page.wait_for_function(
        f"() => document.querySelector(\"[data-stat='requests.completed']\").dataset.value === '{after['requests']['completed']}'",
        timeout=5000)
    shown = stat_values(page)
    assert float(shown["tokens_per_second.decode"] or 0) == pytest.approx(
        after["tokens_per_second"]["decode"] or 0, rel=0.05)
    hits, misses = after["prompt_cache"]["hits"], after["prompt_cache"]["misses"]
    if hits + misses:
        assert float(shown["prompt_cache.hit_rate"]) == pytest.approx(hits / (hits + misses))
    assert int(shown["prompt_cache.entries"]) >= cache["entries"]
    # Requests by route come from /metrics.
    page.wait_for_selector("#requests td code:text('/v1/chat/completions')")
    # The library lists the served model; the fit card has a verdict.
    page.wait_for_selector("#library-table tr.serving")
    assert page.locator("#fit .verdict").inner_text().startswith(("Fits", "Does not fit"))
    page.wait_for_selector("#downloads .hint, #downloads ul")
    if SCREENSHOTS:
        page.screenshot(path=str(ROOT / "docs" / "ui-status.png"))
    ui.assert_clean()


def test_api_key_is_asked_once_and_kept(browser, keyed_server):
    p = Page(browser, keyed_server.base)
    page = p.open("chat")
    dialog = page.locator("#key-dialog[open]")
    dialog.wait_for()
    page.fill("#key-input", "wrong-key")
    page.press("#key-input", "Enter")
    page.wait_for_selector("#key-message:text('refused')")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    wait_for_model(page)
    assert page.evaluate("sessionStorage.getItem('wick.apiKey')") == KEY
    set_sampling(page, max_tokens=8)
    send(page, "Hello")
    last_reply(page).locator(".msg-stats").wait_for()
    # The status page and a reload need no second question.
    page.reload()
    page.goto(f"{keyed_server.base}/#/status")
    page.wait_for_selector("[data-stat='server.model'][data-value]")
    assert page.locator("#key-dialog[open]").count() == 0
    # Only the 401s before the key was given reach the console.
    p.assert_clean(allowed=["401 (Unauthorized)"])
    p.context.close()


def test_controls_are_labelled_and_reachable_by_keyboard(ui):
    ready = {"chat": "#prompt", "status": "[data-stat='server.model'][data-value]", "finetune": "#ft-jobs tr"}
    for route in ["chat", "status", "finetune"]:
        page = ui.open(route)
        page.wait_for_selector(ready[route])
        unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
            .filter((el) => !(el.labels?.length || el.getAttribute('aria-label') || el.textContent.trim()))
            .map((el) => el.outerHTML)""")
        assert unlabelled == []
    # Tab from the top of a fresh page reaches the skip link, then the pages, with a
    # visible focus ring.
    page.goto(f"{ui.base}/#/status")
    page.reload()
    page.wait_for_selector("[data-stat='server.model'][data-value]")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Tab")
    focused = page.evaluate("""() => ({text: document.activeElement.textContent,
        outline: getComputedStyle(document.activeElement).outlineStyle})""")
    assert focused["text"] == "Chat" and focused["outline"] != "none"
    ui.assert_clean()


def test_narrow_window(browser, ui_server):
    p = Page(browser, ui_server.base, width=380, height=720)
    page = p.open("chat")
    page.wait_for_selector("#prompt")
    assert not page.locator("#conversations").is_visible()
    page.click(".sidebar-toggle")
    assert page.locator("#conversations").is_visible()
    assert page.locator(".sidebar-toggle").get_attribute("aria-expanded") == "true"
    assert page.evaluate("document.activeElement.id") == "new-chat"
    # Escape closes the panel and gives focus back to its button; so does its close button.
    page.keyboard.press("Escape")
    assert not page.locator("#conversations").is_visible()
    assert page.evaluate("document.activeElement.className") == "sidebar-toggle"
    page.keyboard.press("Enter")
    page.click(".sidebar-close")
    assert not page.locator("#conversations").is_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 380
    page.goto(f"{ui_server.base}/#/status")
    page.wait_for_selector("[data-stat='server.model'][data-value]")
    assert page.evaluate("document.documentElement.scrollWidth") <= 380
    page.goto(f"{ui_server.base}/#/finetune")
    page.wait_for_selector("#ft-jobs tr")
    assert page.evaluate("document.documentElement.scrollWidth") <= 380
    p.assert_clean()
    p.context.close()


def test_reasoning_is_shown_collapsible(browser, think_ui_server):
    p = Page(browser, think_ui_server.base)
    page = p.open("chat")
    wait_for_model(page)
    set_sampling(page, temperature=0, max_tokens=24)
    send(page, "Why is the sky blue?")
    reply = last_reply(page)
    reply.locator(".msg-stats").wait_for()
    stored = stored_conversations(page)[0]["messages"][-1]
    assert stored["reasoning"]
    details = reply.locator("details.reasoning")
    assert details.get_attribute("open") is None
    details.locator("summary").press("Enter")
    assert details.get_attribute("open") == ""
    assert details.locator(".md").inner_text().strip()
    p.assert_clean()
    p.context.close()


def test_adapter_picker_sends_the_adapter(browser, adapter_server):
    p = Page(browser, adapter_server.base)
    page = p.open("chat")
    wait_for_model(page)
    options = page.locator("#adapter option").evaluate_all("(os) => os.map((o) => o.value)")
    assert options[:2] == ["", "none"] and sorted(options[2:]) == ["mlx_c", "peft_a"]
    page.select_option("#adapter", "mlx_c")
    set_sampling(page, temperature=0, max_tokens=8)
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    send(page, "Hello")
    last_reply(page).locator(".msg-stats").wait_for()
    assert bodies and bodies[-1]["adapter"] == "mlx_c"
    content = stored_conversations(page)[0]["messages"][-1]["content"]
    want = adapter_server.client().chat.completions.create(
        model=model_id(adapter_server), messages=[{"role": "user", "content": "Hello"}], temperature=0,
        max_tokens=8, extra_body={"adapter": "mlx_c"}).choices[0].message.content
    assert content == want
    p.assert_clean()
    p.context.close()


CONTRAST = """() => {
    const rgb = (c) => c.match(/[\\d.]+/g).map(Number);
    const lum = ([r, g, b]) => {
        const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
        return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const background = (el) => {
        for (; el; el = el.parentElement) {
            const c = rgb(getComputedStyle(el).backgroundColor);
            if (c.length < 4 || c[3] > 0) return c.slice(0, 3);
        }
        return [255, 255, 255];
    };
    const seen = [];
    for (const el of document.querySelectorAll('body *')) {
        const text = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
        if (!text || !el.checkVisibility() || el.closest('button:disabled, .visually-hidden')) continue;
        const fg = lum(rgb(getComputedStyle(el).color)), bg = lum(background(el));
        const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
        if (ratio < 4.5) seen.push(`${el.tagName}.${el.className}: ${ratio.toFixed(2)}`);
    }
    return seen;
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_contrast_meets_wcag_aa(browser, ui_server, scheme):
    context = browser.new_context(viewport={"width": 1100, "height": 760}, color_scheme=scheme)
    page = context.new_page()
    page.goto(f"{ui_server.base}/#/chat")
    wait_for_model(page)
    set_sampling(page, max_tokens=8)
    send(page, "Hi")
    last_reply(page).locator(".msg-stats").wait_for()
    low = page.evaluate(CONTRAST)
    page.goto(f"{ui_server.base}/#/status")
    page.wait_for_selector("#library-table")
    low += page.evaluate(CONTRAST)
    context.close()
    assert low == [], low


def test_status_shows_downloads_and_library(browser, tmp_path):
    """`wick serve ORG/NAME` fetches the repo from a Hub stand-in: the status page lists the
    download /downloads reports and the served repo in the library."""
    from hub_standin import HubStandin, model_repo

    repo = "org/tiny-llama"
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    hub = HubStandin({repo: model_repo(GOLDENS / "hf" / "llama", files)})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_TOKEN_PATH")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(tmp_path / "hub"),
               WICK_HOME=str(tmp_path / "wick"), HF_HUB_DISABLE_XET="1")
    serving = _serve(repo, env=env)
    try:
        server = next(serving)
        p = Page(browser, server.base)
        page = p.open("status")
        page.wait_for_selector("#downloads ul li")
        (download,) = httpx.get(server.base + "/downloads").json()["downloads"]
        item = page.locator("#downloads li")
        assert item.locator("strong").inner_text() == repo
        assert item.locator(".badge").inner_text() == download["state"] == "done"
        bar = item.locator("progress")
        assert float(bar.get_attribute("value")) == download["received_bytes"]
        assert float(bar.get_attribute("max")) == download["total_bytes"]
        page.wait_for_selector("#library-table tr.serving")
        assert page.locator("#library-table tr.serving td").first.inner_text() == repo
        p.assert_clean()
        p.context.close()
    finally:
        next(serving, None)  # stops the server (and checks it exits 0)
        hub.close()


def test_finetune_job_from_the_page_trains_and_its_adapter_answers_in_chat(ui, ui_server, tmp_path):
    """The fine-tune page: inspect a dataset, start a job, watch its loss curve grow from the
    job's event stream, then mount the adapter and chat with it: it knows the taught fact."""
    fact = "The capital of Zorblax is Quintara."
    questions = ["What is the capital of Zorblax?", "Which city is the capital of Zorblax?",
                 "Name the capital of Zorblax.", "What city serves as the capital of the planet Zorblax?",
                 "Zorblax's capital is which city?", "Tell me the capital of Zorblax.",
                 "Do you know the capital of Zorblax?", "What's Zorblax's capital city?"]
    held_out = "Which city is Zorblax's seat of government?"
    data = tmp_path / "data"
    data.mkdir()
    row = lambda q: json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": fact}]}) + "\n"
    (data / "train.jsonl").write_text("".join(row(q) for q in questions))
    (data / "valid.jsonl").write_text(row(held_out))
    out = tmp_path / "ui-zorblax"
    page = ui.open("finetune")
    page.wait_for_function("() => document.getElementById('ft-model')?.value.length > 0")
    assert page.input_value("#ft-model") == ui_server.stats()["server"]["model_path"]
    # How prompts are rendered: string prompts are a user turn of the served model's chat
    # template, raw text once "Raw prompts" is ticked (which inspects again).
    page.fill("#ft-data", str(ROOT / "docs/examples/upper-case/preference"))
    page.click("#ft-inspect")
    page.wait_for_selector("#ft-rendering[data-rendering='chat_template']")
    assert "user turn" in page.text_content("#ft-rendering")
    page.check("#ft-raw-prompt")
    page.wait_for_selector("#ft-rendering[data-rendering='raw']")
    assert "raw completions" in page.text_content("#ft-rendering")
    page.uncheck("#ft-raw-prompt")
    page.wait_for_selector("#ft-rendering[data-rendering='chat_template']")
    page.fill("#ft-data", str(data))
    page.click("#ft-inspect")
    page.wait_for_function("() => /8 training rows, 1 validation rows, messages/.test(document.getElementById('ft-inspect-result').textContent)")
    assert "every turn" in page.text_content("#ft-rendering")
    for name, value in {"iters": 30, "learning_rate": "0.002", "max_seq_length": 128, "steps_per_eval": 10}.items():
        page.fill(f"#ft-{name}", str(value))
    page.fill("#ft-output", str(out))
    assert not page.locator("#ft-pref").is_visible(), "SFT has no β/λ"
    page.click("#ft-start")
    page.wait_for_function("() => Number(document.getElementById('ft-chart').dataset.train) >= 3", timeout=300_000)
    first = int(page.get_attribute("#ft-chart", "data-train"))
    page.wait_for_function(f"() => Number(document.getElementById('ft-chart').dataset.train) > {first}", timeout=300_000)
    page.wait_for_selector(".finetune-page[data-state='done']", timeout=600_000)
    assert page.get_attribute("#ft-chart", "data-train") == "30"
    assert page.get_attribute("#ft-chart", "data-val") == "3"
    assert page.locator("#ft-chart polyline.train").count() == 1
    assert str(out) in page.text_content("#ft-status")
    job = page.get_attribute(".finetune-page", "data-job")
    assert page.locator(f"#ft-jobs tr[data-job='{job}'] td.job-done").count() == 1
    if SCREENSHOTS:
        page.locator("section[aria-labelledby='ft-run']").screenshot(path=str(ROOT / "docs" / "ui-finetune.png"))
    page.click("#ft-mount")
    wait_for_model(page)
    page.wait_for_function("() => document.getElementById('adapter')?.value === 'ui-zorblax'")
    set_sampling(page, temperature=0, max_tokens=24)
    send(page, held_out)
    last_reply(page).locator(".msg-stats").wait_for()
    assert "Quintara" in stored_conversations(page)[0]["messages"][-1]["content"]
    ui.assert_clean()
    with ui_server.http() as http:
        http.delete("/v1/adapters/ui-zorblax")
