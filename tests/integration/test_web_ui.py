"""The web page of `pagedllm serve`, in headless Chromium (Debian's `chromium`, driven by Playwright
for Python): the chat streams the API's own reply, the engine view agrees with the feed and with
/metrics under load, model output that looks like HTML stays text, and a viewer that leaves costs
the engine nothing. Screenshots of both views are saved under pytest's temporary directory
(`ui-screenshots/`; docs/img/ui-*.png are copies)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import API_KEY, Server, metrics

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright for Python is not installed (pip install -e '.[dev]')"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary on PATH: the browser tests need Debian's chromium package "
           "(make install runs apt-get install -y chromium where apt is usable)",
)

MODEL = "smollm2-135m-instruct"
LOAD_REQUESTS = 4


@pytest.fixture(scope="module")
def server(default_server: Server) -> Server:
    return default_server


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ui-screenshots")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    """A fresh browser profile; the page's key prompt is answered with the server's key."""
    context = browser.new_context(viewport={"width": 1300, "height": 820})
    pg = context.new_page()
    pg.dialogs = []
    pg.errors = []

    def on_dialog(d) -> None:
        pg.dialogs.append(d.message)
        d.accept(API_KEY) if d.type == "prompt" else d.dismiss()

    pg.on("dialog", on_dialog)
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    yield pg
    context.close()


def test_root_redirects_to_the_page_and_the_feed_needs_the_key(server: Server, http: httpx.Client) -> None:
    r = httpx.get(server.url + "/", follow_redirects=True)
    assert r.status_code == 200 and "<title>pagedllm</title>" in r.text and str(r.url).endswith("/ui/")
    for asset in ("chat.js", "engine.js", "markdown.js", "api.js", "style.css"):
        assert httpx.get(f"{server.url}/ui/{asset}").status_code == 200
    assert httpx.get(server.url + "/v1/engine/state").status_code == 401  # behind --api-key like /v1/*


def test_chat_streams_the_same_reply_as_the_api(page, server: Server, http: httpx.Client, shots: Path) -> None:
    page.goto(server.url)
    sync_api.expect(page.locator("#model-name")).to_have_text(MODEL, timeout=30_000)
    assert any("API key" in d for d in page.dialogs)  # asked once, on the first 401
    page.fill("#system-prompt", "You are a terse assistant.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#seed", "7")
    question = "Name three colours of the rainbow."
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    reply = page.locator(".msg.assistant").last
    sync_api.expect(page.locator("#stop")).to_be_enabled(timeout=30_000)
    reply.locator(".body p, .body li, .body pre").first.wait_for(timeout=60_000)  # text appears while streaming
    sync_api.expect(reply).to_have_attribute("data-done", "1", timeout=120_000)
    assert int(reply.get_attribute("data-chunks")) > 1  # streamed, chunk by chunk
    stats = reply.locator(".stats").inner_text()
    assert "TTFT" in stats and "tokens/s" in stats and "24 tokens" in stats and "cached prompt tokens" in stats
    stored = page.evaluate("JSON.parse(localStorage.getItem('pagedllm.conversations'))")
    shown = stored[0]["messages"][-1]["content"]
    api = http.post("/v1/chat/completions", json={
        "model": MODEL, "temperature": 0, "top_p": 1, "max_tokens": 24, "seed": 7,
        "messages": [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": question}],
    }).json()
    assert shown == api["choices"][0]["message"]["content"] and shown
    assert reply.locator(".body").inner_text().strip()
    page.screenshot(path=str(shots / "ui-chat.png"))
    # The conversation outlives a reload (local storage), and regenerate answers again.
    page.reload()
    sync_api.expect(page.locator(".msg.user").last).to_contain_text(question, timeout=10_000)
    page.click("#regenerate")
    sync_api.expect(page.locator(".msg.assistant").last).to_have_attribute("data-done", "1", timeout=120_000)
    assert page.locator(".msg.assistant").count() == 1
    assert not page.errors


def background_load(server: Server, stop: threading.Event) -> list[threading.Thread]:
    """LOAD_REQUESTS clients, each streaming one long completion after another until `stop`; a
    client that sees `stop` leaves mid-stream, which aborts its request (so stopping is quick)."""
    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 160, "ignore_eos": True,
                "temperature": 0.8, "stream": True}
        with server.http(timeout=600) as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(LOAD_REQUESTS)]
    for t in threads:
        t.start()
    return threads


def test_engine_view_agrees_with_the_feed_and_metrics(page, server: Server, http: httpx.Client, shots: Path) -> None:
    stop = threading.Event()
    threads = background_load(server, stop)
    try:
        page.add_init_script(f"localStorage.setItem('pagedllm.apiKey', {json.dumps(API_KEY)})")
        page.goto(server.url + "/ui/#engine")
        sync_api.expect(page.locator("#feed-status")).to_have_text("live", timeout=30_000)
        sync_api.expect(page.locator("#q-running-count")).to_have_text(str(LOAD_REQUESTS), timeout=120_000)
        num_blocks = int(page.evaluate("window.pagedllmEngine.state.hello.num_blocks"))
        agreed = 0
        for _ in range(40):
            view = page.evaluate("""() => {
                const s = window.pagedllmEngine.state, snap = s.snapshot;
                let held = 0;
                for (let i = 0; i < snap.blocks.length; i += 4) if (snap.blocks[i] >= 2 && snap.blocks[i] <= 3) held += snap.blocks[i + 3];
                return {held: held, grid: Number(document.getElementById('block-grid').dataset.used),
                        running: snap.requests.filter(r => r.queue === 1).length,
                        shownRunning: Number(document.getElementById('q-running-count').textContent),
                        waiting: snap.requests.filter(r => r.queue === 0).length,
                        shownWaiting: Number(document.getElementById('q-waiting-count').textContent),
                        rows: document.querySelectorAll('#q-running li').length};
            }""")
            m = metrics(http)
            # What the page draws is what the feed sent ...
            assert view["grid"] == view["held"] and view["shownRunning"] == view["running"] == view["rows"]
            assert view["shownWaiting"] == view["waiting"]
            # ... and the feed agrees with /metrics within one snapshot (250 ms: each running request
            # takes at most one block of 16 tokens meanwhile, and one finishing frees its blocks).
            used = round(m["pagedllm:kv_cache_usage_perc"] * num_blocks)
            if (m["pagedllm:num_requests_running"] == view["running"] == LOAD_REQUESTS
                    and abs(used - view["held"]) <= LOAD_REQUESTS):
                agreed += 1
                if agreed == 3:
                    break
            time.sleep(0.3)
        assert agreed == 3, (view, m)
        # Hovering an in-use block names its request and token range.
        box = page.locator("#block-grid").bounding_box()
        cells = page.evaluate("window.pagedllmEngine.state.cells")
        size = page.evaluate("window.pagedllmEngine.state.layout")
        i = next(k for k, c in enumerate(cells) if c[0] == 2)
        page.mouse.move(box["x"] + (i % size["cols"]) * size["size"] + 1, box["y"] + (i // size["cols"]) * size["size"] + 1)
        tip = page.locator("#block-tip")
        sync_api.expect(tip).to_be_visible()
        assert "in use" in tip.inner_text() and "tokens" in tip.inner_text() and "cmpl" in tip.inner_text()
        page.mouse.move(box["x"] + box["width"] + 50, box["y"] - 30)
        time.sleep(1.0)  # some history for the charts
        page.screenshot(path=str(shots / "ui-engine.png"))
        assert not page.errors
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def test_model_output_that_looks_like_html_renders_as_text(page, server: Server, http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "Say something."}],
        "structured_outputs": {"regex": r"<script>alert\(1\)</script>"},
    })
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text == "<script>alert(1)</script>"
    page.add_init_script(f"localStorage.setItem('pagedllm.apiKey', {json.dumps(API_KEY)})")
    page.goto(server.url + "/ui/")
    hostile = text + "\n<img src=x onerror=\"window.pwned=1\"> **bold <b>tag</b>**\n```html\n<script>window.pwned=2</script>\n```" \
                     "\n[link](javascript:window.pwned=3)"
    got = page.evaluate("""(t) => {
        const n = window.pagedllmChat.render(t);
        document.getElementById('messages').appendChild(n);
        return {elements: n.querySelectorAll('script, img, b, iframe').length, text: n.textContent,
                links: [...n.querySelectorAll('a')].map(a => a.getAttribute('href'))};
    }""", hostile)
    time.sleep(0.3)
    assert got["elements"] == 0 and got["links"] == []
    assert "<script>alert(1)</script>" in got["text"] and '<img src=x onerror="window.pwned=1">' in got["text"]
    assert page.evaluate("window.pwned") is None and not page.dialogs and not page.errors


def read_events(response: httpx.Response, count: int) -> list[tuple[str, dict]]:
    events, name, lines = [], "message", response.iter_lines()
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, json.loads(line[5:])))
            name = "message"
            if len(events) == count:
                break
    return events


def test_a_viewer_that_leaves_mid_stream_costs_the_engine_nothing(server: Server, http: httpx.Client) -> None:
    stop = threading.Event()
    threads = background_load(server, stop)
    try:
        with http.stream("GET", "/v1/engine/state") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = read_events(r, 4)
        assert events[0][0] == "hello" and events[0][1]["viewers"] == 1
        last = events[-1][1]["point"]["n"]
        assert [e[1]["point"]["n"] for e in events[1:]] == [last - 2, last - 1, last]
        snap = events[-1][1]["snapshot"]
        assert snap["num_blocks"] == events[0][1]["num_blocks"] and sum(snap["blocks"][3::4]) == snap["num_blocks"]
        time.sleep(2.0)  # gone: the engine core is told to stop at once (one snapshot may be in flight)
        with http.stream("GET", "/v1/engine/state") as r:
            hello = read_events(r, 1)[0][1]
        assert hello["viewers"] == 1 and hello["snapshots"] <= last + 2, (last, hello["snapshots"])
        # The engine goes on serving.
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
