"""The actor dashboard in a real browser (Debian's Chromium driven by Playwright) against the real
server under load: the page loads without console errors and shows the actors of all three
processes; its figures move while requests run; a request's waterfall lists its hops in time
order, from the HTTP actor through the tokenizer and the scheduler to the detokenizer; the page
and its data ask for the API key like /v1/*. The server runs under vLLM's --root-path: the page
and the load are reached under it (the page's own requests with it), the checks of the key
without it. A screenshot is left in test-artifacts/."""
from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from server import ROOT, Server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no browser: Chromium is not installed at {CHROMIUM} (`make test` installs "
                "Debian's chromium with apt-get when run as root)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                               "(pip install -e '.[test]')")

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ROOT_PATH = "/troupe"      # --root-path: the page and the load go through it, the key checks without it
KEY = "dashboard-test-key"
ARTIFACTS = os.path.join(ROOT, "test-artifacts")
# Quiet and offline: without the background-networking flags Chromium keeps calling home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY, "--root-path", ROOT_PATH)
    yield s
    s.stop()


class Load:
    """Two clients streaming short chat and text completions until ``stop``."""

    def __init__(self, url: str) -> None:
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        self.done: list[str] = []         # the response ids of finished requests, newest last
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in (0, 1)]
        for t in self.threads:
            t.start()

    def run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                self.done.extend(self.one(i))
            except openai.OpenAIError as exc:
                self.failures.append(repr(exc))
            i += 2

    def one(self, i: int) -> set[str]:
        client = self.client
        if i % 2:
            stream = client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=12,
                messages=[{"role": "user", "content": f"Count to {i % 9 + 2}."}])
        else:
            stream = client.completions.create(model=MODEL, stream=True, max_tokens=12,
                                               prompt=f"Once upon a time, {i}")
        return {chunk.id for chunk in stream}

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


@pytest.fixture(scope="module")
def load(server):
    loader = Load(server.url + ROOT_PATH)
    yield loader
    loader.close()


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=WAIT_MS)
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def errors() -> list[str]:
    """What the page wrote to the console as errors, and its uncaught exceptions."""
    return []


@pytest.fixture(scope="module")
def page(server, load, browser, errors):
    """The dashboard, opened as a person would under --api-key: the key once in the URL, then
    the cookie it sets carries the page's own requests (EventSource included)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    p.set_default_timeout(WAIT_MS)
    p.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    p.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    p.requested = []          # every address the page asks for
    p.on("request", lambda req: p.requested.append(req.url))
    p.goto(server.url + ROOT_PATH + f"/dashboard?api_key={KEY}")
    yield p
    context.close()


def test_page_shows_the_actors_of_every_process(page, errors, server):
    page.wait_for_selector('#actors-table tbody tr[data-node="worker0"]')
    rows = page.eval_on_selector_all("#actors-table tbody tr[data-actor]",
                                     "rows => rows.map(r => r.dataset.node + '/' + r.dataset.actor)")
    for actor in ("frontend/http", "frontend/tokenizer", "frontend/detokenizer",
                  "engine/scheduler", "engine/executor", "worker0/worker"):
        assert actor in rows, rows
    drawn = page.eval_on_selector_all("#graph g.actor", "gs => gs.map(g => g.dataset.node)")
    assert {"frontend", "engine", "worker0"} <= set(drawn)
    assert page.locator("#graph path.edge").count() > 0           # some sender -> receiver
    assert page.locator("#banner").is_hidden(), page.inner_text("#banner")
    assert errors == []
    # the page's script, style and streams under the root path it was opened under
    assert len(page.requested) >= 4 and all(u.startswith(page.url.split("/dashboard")[0] + "/") for u in page.requested)
    assert page.url.startswith(server.url + ROOT_PATH + "/dashboard")
    assert {u.split("?")[0].removeprefix(server.url) for u in page.requested} >= {
        ROOT_PATH + "/dashboard", ROOT_PATH + "/dashboard/static/dashboard.js", ROOT_PATH + "/debug/live"}


def test_figures_move_while_requests_run(page, errors):
    cell = '#actors-table tbody tr[data-node="engine"][data-actor="scheduler"] td[data-col="handled"]'
    page.wait_for_selector(cell)
    before = page.inner_text(cell)
    page.wait_for_function("([sel, old]) => document.querySelector(sel)?.textContent !== old",
                           arg=[cell, before], timeout=WAIT_MS)
    page.wait_for_selector("#steps g.step")                        # the engine steps drawn
    page.wait_for_function("() => [...document.querySelectorAll('#series polyline')]"
                           ".some(p => p.getAttribute('points'))", timeout=WAIT_MS)
    assert errors == []


def hops(page) -> list[dict]:
    return page.eval_on_selector_all("#waterfall .hop", """hops => hops.map(h => ({
        name: h.dataset.name, actor: h.dataset.actor, start: Number(h.dataset.start)}))""")


def check_hops(drawn: list[dict]) -> None:
    starts = [h["start"] for h in drawn]
    assert starts == sorted(starts), drawn
    actors = {h["actor"] for h in drawn}
    assert {"http", "tokenizer", "scheduler", "detokenizer"} <= actors, drawn
    # The path, in order: HTTP receive, tokenize, queue, the steps, detokenize, the chunks sent.
    names = [h["name"] for h in drawn]
    assert names[0] == "http.receive", names
    order = [names.index(n) for n in ("http.receive", "tokenize", "queue", "step", "detokenize")]
    assert order == sorted(order), names
    assert names.index("detokenize") < len(names) - 1 - names[::-1].index("http.chunk"), names


def test_waterfall_lists_a_requests_hops_in_order(page, errors):
    item = page.wait_for_selector('#requests li[data-status="finished"]')
    rid = item.get_attribute("data-id")
    item.click()
    page.wait_for_selector(f'#waterfall[data-id="{rid}"] .hop')
    check_hops(hops(page))
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "dashboard.png"), full_page=True)
    assert errors == []


def test_search_finds_a_request_by_its_openai_id(page, errors, load):
    deadline = time.monotonic() + WAIT_MS / 1000
    while not load.done and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load.done, f"no streamed request finished: {load.failures}"
    wanted = load.done[-1]                             # chatcmpl-... or cmpl-...
    page.fill("#request-search", wanted)
    page.press("#request-search", "Enter")
    page.wait_for_function("""id => { const w = document.querySelector('#waterfall');
        return (w.dataset.id === id || w.dataset.requestId === id) && w.querySelector('.hop'); }""",
                           arg=wanted, timeout=WAIT_MS)
    check_hops(hops(page))
    assert errors == []


def test_an_unknown_request_shows_in_the_banner(page, errors, load):
    page.fill("#request-search", "chatcmpl-no-such-request")
    page.press("#request-search", "Enter")
    page.wait_for_selector("#banner:not([hidden])")
    assert "chatcmpl-no-such-request" in page.inner_text("#banner")
    # The browser itself logs the 404 response; nothing else may be there.
    assert [e for e in errors if "404" not in e] == []
    assert load.failures == []


def status(url: str, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get_content_type()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type()


def test_the_page_and_its_data_need_the_api_key(server):
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/debug/live", "/debug/actors"):
        assert status(server.url + path, {})[0] == 401, path
        assert status(server.url + ROOT_PATH + path, {})[0] == 401, ROOT_PATH + path
    auth = {"Authorization": f"Bearer {KEY}"}
    assert status(server.url + "/dashboard", auth) == (200, "text/html")
    assert status(server.url + "/dashboard/static/dashboard.js", auth) == (200, "text/javascript")
    assert status(server.url + "/dashboard/static/dashboard.css", auth) == (200, "text/css")
    assert status(server.url + "/dashboard/static/app.py", auth)[0] == 404


def test_the_key_in_the_dashboards_url_opens_the_page_and_its_data_only(server):
    assert status(server.url + "/dashboard?api_key=wrong", {})[0] == 401
    req = urllib.request.Request(server.url + f"/dashboard?api_key={KEY}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        cookie = resp.headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in resp.headers["Set-Cookie"]
    assert status(server.url + "/debug/actors", {"Cookie": cookie})[0] == 200
    assert status(server.url + "/dashboard/static/dashboard.js", {"Cookie": cookie})[0] == 200
    assert status(server.url + "/v1/models", {"Cookie": cookie})[0] == 401      # never the API
    assert status(server.url + ROOT_PATH + "/v1/models", {"Cookie": cookie})[0] == 401
    assert status(server.url + "/debug/actors", {"Cookie": "troupe_api_key=wrong"})[0] == 401
    assert status(server.url + "/debug/actors", {"Authorization": "Bearer \u00e9"})[0] == 401
