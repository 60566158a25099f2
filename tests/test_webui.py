"""The web chat page (`GET /`, server/webui.py + server/static/): plain HTTP checks, then a real headless
Chromium driven by selenium against a real gunicorn server on a scripted model (tests/webui_fakes.py).

Browser availability: without selenium, chromium or chromedriver the browser tests skip with the reason.
Under CI (CI=true, as .ci/run sets) a *broken* install fails instead of skipping: selenium missing (it is in
the `test` extra), only one of chromium / chromedriver present, or a browser that is there but cannot start.
Neither binary present means .ci/run's best-effort apt install did not happen (it says so): those skip.
"""
from __future__ import annotations

import fnmatch
import http.client
import json
import os
import re
import shutil
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from server import webui
from tests.ci_oracles import ci_mode
from tests.server_fakes import REPO_ROOT, ServerProcess, metrics_value
from tests.webui_fakes import CODE_BLOCK, MARKDOWN_ANSWER

API_KEY = "webui-test-key"
STATIC_DIR = REPO_ROOT / "server" / "static"


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess("fake", env={"JITKERN_API_KEY": API_KEY, "JITKERN_MAX_MODEL_LEN": 4096,
                                        "JITKERN_ENGINE_FACTORY": "tests.webui_fakes:make_engine",
                                        "JITKERN_FAKE_STEP_DELAY": "0.02"})
    try:
        server.wait_ready()
    except RuntimeError as e:
        server.kill()
        pytest.fail(str(e), pytrace=False)
    yield server
    server.close()


def http_request(srv, method: str, path: str, body=None, key: str | None = None):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    headers = {}
    if body is not None:
        body = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class _PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.scripts, self.stylesheets, self.inline_script, self.bad_attrs = [], [], [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.bad_attrs += [(tag, k) for k in a if k.startswith("on") or k == "style"]
        if tag == "script":
            self.scripts.append(a.get("src"))
            self._in_script = True
        if tag == "link" and a.get("rel") == "stylesheet":
            self.stylesheets.append(a.get("href"))
        if tag == "style":
            self.inline_script.append("<style>")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline_script.append(data)


# ================================================================================ plain HTTP

def test_page_is_public_with_security_headers_and_no_inline_script(srv):
    status, headers, body = http_request(srv, "GET", "/")          # no key: the page itself is public
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    csp = headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"
    assert directives["connect-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert headers["x-content-type-options"] == "nosniff"
    assert body == (STATIC_DIR / "index.html").read_bytes()
    page = _PageParser()
    page.feed(body.decode())
    assert page.scripts == ["webui/webui.js"] and page.stylesheets == ["webui/webui.css"]
    assert page.inline_script == [] and page.bad_attrs == []


@pytest.mark.parametrize("name, ctype", sorted(webui.STATIC_FILES.items()))
def test_static_files_are_served_with_their_content_type(srv, name, ctype):
    status, headers, body = http_request(srv, "GET", "/webui/" + name)
    assert status == 200
    assert headers["content-type"] == ctype
    assert ctype.split(";")[0] in ("text/javascript", "text/css")
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["content-security-policy"] == webui.CONTENT_SECURITY_POLICY
    assert body == (STATIC_DIR / name).read_bytes()


@pytest.mark.parametrize("path", ["/webui/index.html", "/webui/nope.js", "/webui/..%2fapp.py", "/webui/../app.py",
                                  "/webui/", "/webui/webui.js/x", "/index.html", "/static/webui.js"])
def test_nothing_else_is_served(srv, path):
    status, headers, body = http_request(srv, "GET", path)
    assert status in (400, 401, 404), (path, status)
    assert b"<html" not in body and b"use strict" not in body


def test_only_get_on_the_page(srv):
    status, _, _ = http_request(srv, "POST", "/", body={})
    assert status == 405


def test_v1_routes_still_need_the_key(srv):
    assert http_request(srv, "GET", "/v1/models")[0] == 401
    assert http_request(srv, "GET", "/v1/models", key="wrong")[0] == 401
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http_request(srv, "POST", "/v1/chat/completions", body=chat)[0] == 401
    assert http_request(srv, "GET", "/v1/models", key=API_KEY)[0] == 200
    status, _, body = http_request(srv, "POST", "/v1/chat/completions", body=chat, key=API_KEY)
    assert status == 200, body


def test_static_files_are_package_data():
    """setup.cfg's package_data covers every file of server/static/ (so a wheel ships the page)."""
    from setuptools.config.setupcfg import read_configuration
    patterns = read_configuration(str(REPO_ROOT / "setup.cfg"))["options"].get("package_data", {}).get("server", [])
    files = sorted(p.relative_to(REPO_ROOT / "server").as_posix() for p in STATIC_DIR.iterdir())
    assert {webui.PAGE_FILE, *webui.STATIC_FILES} <= {Path(f).name for f in files}
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), (f, patterns)
    for name in (webui.PAGE_FILE, *webui.STATIC_FILES):
        assert webui.read_static(name) == (STATIC_DIR / name).read_bytes()


# ================================================================================ the browser

def _unavailable(reason: str, broken: bool):
    if broken and ci_mode():
        pytest.fail(f"CI is set and the browser test setup is broken: {reason}", pytrace=False)
    pytest.skip(reason)


def _which(names) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser(srv):
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if webdriver is None:
        _unavailable("selenium is not installed (the `test` extra: pip install -e '.[test]')", broken=True)
    chrome = os.environ.get("JITKERN_TEST_CHROMIUM") or _which(("chromium", "chromium-browser", "google-chrome"))
    driver = os.environ.get("JITKERN_TEST_CHROMEDRIVER") or _which(("chromedriver",))
    if not chrome and not driver:
        _unavailable("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)",
                     broken=False)
    if not chrome or not driver:
        _unavailable(f"half a browser: chromium={chrome}, chromedriver={driver} (apt-get install chromium "
                     f"chromium-driver)", broken=True)
    opts = Options()
    opts.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    failure = None
    try:
        # Explicit paths: selenium must not go looking for (or downloading) a driver.
        drv = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    except WebDriverException as e:
        failure = f"chromium ({chrome}) / chromedriver ({driver}) could not start a session: {e.msg}"
    if failure:
        _unavailable(failure, broken=True)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


def wait(browser, cond, timeout=20.0, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda d: cond(d), message=f"waiting for {what}")


def by_id(browser, name):
    from selenium.webdriver.common.by import By
    return browser.find_element(By.ID, name)


def css(node, selector):
    from selenium.webdriver.common.by import By
    return node.find_elements(By.CSS_SELECTOR, selector)


def open_page(browser, srv, fresh_storage: bool = True):
    """Loads the page (with the settings of a first visit) and signs in with the key if it asks."""
    browser.get(srv.base_url + "/")
    if fresh_storage:
        browser.execute_script("localStorage.clear()")
        browser.get(srv.base_url + "/")
    wait(browser, lambda d: d.execute_script("return document.body.dataset.connected === 'true' || "
                                             "!document.getElementById('key-form').hidden"), what="the page to start")
    if by_id(browser, "key-form").is_displayed():
        by_id(browser, "api-key").send_keys(API_KEY)
        css(browser, "#key-form button[type=submit]")[0].click()
    wait(browser, lambda d: d.execute_script("return document.body.dataset.connected === 'true'"), what="connected")


def send_prompt(browser, text):
    from selenium.webdriver.common.keys import Keys
    box = by_id(browser, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    return wait(browser, lambda d: css(d, ".msg.assistant")[-1:] or None, what="the answer bubble")[0]


def answer_state(bubble):
    return bubble.get_attribute("data-state")


def wait_done(browser, bubble, timeout=30.0):
    wait(browser, lambda d: answer_state(bubble) != "streaming", timeout, what="the answer to end")
    return answer_state(bubble)


def csp_errors(browser):
    return [e["message"] for e in browser.get_log("browser")
            if "Content Security Policy" in e["message"] or "Refused to" in e["message"]]


def test_page_asks_for_the_key_and_rejects_a_wrong_one(browser, srv):
    browser.get(srv.base_url + "/")
    browser.execute_script("sessionStorage.clear(); localStorage.clear()")
    browser.get(srv.base_url + "/")
    form = wait(browser, lambda d: by_id(d, "key-form") if by_id(d, "key-form").is_displayed() else None,
                what="the key form")
    by_id(browser, "api-key").send_keys("not-the-key")
    css(form, "button[type=submit]")[0].click()
    wait(browser, lambda d: by_id(d, "key-error").is_displayed(), what="the key error")
    assert "refused" in by_id(browser, "key-error").text
    assert browser.execute_script("return document.body.dataset.connected") is None
    by_id(browser, "api-key").send_keys(API_KEY)
    css(form, "button[type=submit]")[0].click()
    wait(browser, lambda d: d.execute_script("return document.body.dataset.connected === 'true'"), what="connected")
    assert not by_id(browser, "key-form").is_displayed()
    assert by_id(browser, "model-name").text == "model: fake-model"
    # The page's own script and style ran under the policy; nothing was refused.
    assert csp_errors(browser) == []


def test_answer_streams_in_and_shows_tokens_per_second(browser, srv):
    open_page(browser, srv)
    bubble = send_prompt(browser, "hello there")
    lengths = []
    while answer_state(bubble) == "streaming":
        lengths.append(len(css(bubble, ".content")[0].get_attribute("textContent")))
        time.sleep(0.03)
    partial = sorted({n for n in lengths if n > 0})
    assert len(partial) >= 3, f"the text did not arrive piecewise: lengths seen while streaming {lengths}"
    assert answer_state(bubble) == "done"
    assert by_id(browser, "send").is_enabled() and not by_id(browser, "stop").is_enabled()
    # The server's own count for the same conversation, without streaming.
    status, _, body = http_request(srv, "POST", "/v1/chat/completions", key=API_KEY,
                                   body={"messages": [{"role": "user", "content": "hello there"}]})
    assert status == 200
    reference = json.loads(body)
    assert reference["choices"][0]["message"]["content"] == MARKDOWN_ANSWER
    stats = css(bubble, ".stats")[0].text
    m = re.match(r"(\d+) tokens · ([\d.]+) tokens/s · first token after ([\d.]+) s · (\d+) prompt tokens · "
                 r"finish: stop$", stats)
    assert m, stats
    assert int(m.group(1)) == reference["usage"]["completion_tokens"]
    assert int(m.group(4)) == reference["usage"]["prompt_tokens"]
    # The fake model takes >= 20 ms a step: the rate is positive and below 50 tokens/s plus slack.
    assert 0 < float(m.group(2)) < 80


def test_markdown_renders_and_model_html_stays_text(browser, srv):
    open_page(browser, srv)
    bubble = send_prompt(browser, "show me some markdown")
    assert wait_done(browser, bubble) == "done"
    content = css(bubble, ".content")[0]
    code = css(content, "pre code")
    assert len(code) == 1
    assert code[0].get_attribute("class") == "language-python"
    assert code[0].get_attribute("textContent") == CODE_BLOCK
    assert [e.text for e in css(content, "p strong")] == ["bold"]
    assert [e.text for e in css(content, "p em")] == ["italic"]
    assert [e.text for e in css(content, "p > code")] == ["inline code"]
    assert [e.text for e in css(content, "ul > li")] == ["first item", "second item"]
    assert [e.text for e in css(content, "ol > li")] == ["one", "two"]
    links = css(content, "a")
    assert [(a.text, a.get_attribute("href")) for a in links] == [("the docs", "https://example.com/docs")]
    assert "noopener" in links[0].get_attribute("rel")
    text = content.get_attribute("textContent")
    assert "[bad](javascript:alert(1))" in text
    assert '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">' in text
    assert css(content, "script, img, b") == []
    time.sleep(0.3)
    assert browser.execute_script("return window.__pwned === undefined && document.scripts.length === 1")


def test_finished_answer_is_not_rendered_again_by_a_late_frame(browser, srv):
    # Frames 400 ms late: the last streamed update's render is still pending when the answer ends, and
    # must not replace the finished bubble's nodes (CI once saw them go stale under a test reading them).
    open_page(browser, srv)
    browser.execute_script("window.requestAnimationFrame = (f) => setTimeout(f, 400); "
                           "window.cancelAnimationFrame = (id) => clearTimeout(id)")
    bubble = send_prompt(browser, "show me some markdown")
    assert wait_done(browser, bubble) == "done"
    first = css(css(bubble, ".content")[0], "*")[0]
    time.sleep(0.8)
    assert browser.execute_script("return arguments[0].isConnected", first)


RENDER_CASES = [
    ("[x](javascript:alert(1))", None),
    ("[x](JaVaScRiPt:alert(1))", None),
    ("[x](java\tscript:alert(1))", None),
    ("[x](data:text/html,hi)", None),
    ("[x](vbscript:msgbox)", None),
    ("<javascript:alert(1)>", None),
    ("[x](https://ok.example/a?b=1)", "https://ok.example/a?b=1"),
    ("see https://ok.example/path.", "https://ok.example/path"),
    ("<mailto:me@example.com>", "mailto:me@example.com"),
]


@pytest.mark.parametrize("src, href", RENDER_CASES)
def test_renderer_links_keep_safe_schemes_only(browser, srv, src, href):
    if "connected" not in (browser.execute_script("return document.body && document.body.dataset.connected") or ""):
        open_page(browser, srv, fresh_storage=False)
    got = browser.execute_script(
        "const d = jitkernMarkdown.render(arguments[0]);"
        "return [Array.from(d.querySelectorAll('a')).map(a => a.href), d.textContent];", src)
    hrefs, text = got
    assert hrefs == ([href] if href else [])
    if href is None:
        assert text == src                              # refused links stay visible as written


def test_renderer_structure(browser, srv):
    open_page(browser, srv, fresh_storage=False)
    out = browser.execute_script("""
        const r = (s) => jitkernMarkdown.render(s);
        const d1 = r("**a *b* c** and `x <y> z`");
        const d2 = r("```js\\nlet a = '<i>';\\n");              // unclosed fence (still streaming)
        const d3 = r("# Title\\n\\n> quoted *q*\\n\\n- a\\n  - nested\\n- b\\n\\n3. three\\n4. four");
        return [d1.innerHTML, d2.querySelector('pre code').textContent, d2.querySelector('code').className,
                d3.querySelector('h1').textContent, d3.querySelector('blockquote em').textContent,
                Array.from(d3.querySelectorAll('ul > li > ul > li')).map(e => e.textContent),
                d3.querySelector('ol').start, Array.from(d3.querySelectorAll('ol > li')).map(e => e.textContent)];
    """)
    assert out[0] == "<p><strong>a <em>b</em> c</strong> and <code>x &lt;y&gt; z</code></p>"
    assert out[1:3] == ["let a = '<i>';", "language-js"]
    assert out[3:] == ["Title", "q", ["nested"], 3, ["three", "four"]]


def engine_counts(srv) -> tuple[float, float]:
    """(requests running in the engine, requests finished as aborted) from /metrics."""
    status, _, body = http_request(srv, "GET", "/metrics")
    assert status == 200
    text = body.decode()
    aborted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)
    return metrics_value(text, "vllm:num_requests_running"), aborted


def test_stop_button_ends_a_long_stream(browser, srv):
    open_page(browser, srv)
    _, aborted_before = engine_counts(srv)
    bubble = send_prompt(browser, "please ramble forever")
    wait(browser, lambda d: len(css(bubble, ".content")[0].get_attribute("textContent")) > 40, what="some text")
    by_id(browser, "stop").click()
    assert wait_done(browser, bubble, timeout=10) == "stopped"
    frozen = css(bubble, ".content")[0].get_attribute("textContent")
    assert "tick tock" in frozen
    time.sleep(1.0)                                   # ~50 more tokens would have arrived by now
    assert css(bubble, ".content")[0].get_attribute("textContent") == frozen
    assert css(bubble, ".stats")[0].text.startswith("stopped · ")
    assert by_id(browser, "send").is_enabled() and not by_id(browser, "stop").is_enabled()
    # The server saw the disconnect and aborted the generation (the engine runs nothing any more).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running, aborted = engine_counts(srv)
        if running == 0 and aborted == aborted_before + 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the server did not abort the stopped stream (running {running}, aborted {aborted}, "
                    f"{aborted_before} before):\n" + srv.log_tail())
    # The conversation goes on: the stopped answer stays in it and the next one completes.
    bubble2 = send_prompt(browser, "thanks, now something short")
    assert wait_done(browser, bubble2) == "done"
    assert len(css(browser, ".msg.assistant")) == 2


def test_sampling_settings_are_sent_and_kept(browser, srv):
    open_page(browser, srv)
    by_id(browser, "toggle-settings").click()
    values = {"system-prompt": "You are terse.", "temperature": "0.3", "top-p": "0.9", "max-tokens": "7"}
    for field, value in values.items():
        by_id(browser, field).send_keys(value)
    by_id(browser, "prompt").click()                  # blur: the last field's change event saves the settings
    browser.execute_script("""
        window.__bodies = [];
        const original = window.fetch;
        window.fetch = function (url, opts) {
            if (opts && opts.body) window.__bodies.push(opts.body);
            return original.apply(this, arguments);
        };""")
    bubble = send_prompt(browser, "hello")
    assert wait_done(browser, bubble) == "done"
    sent = [json.loads(b) for b in browser.execute_script("return window.__bodies")]
    assert len(sent) == 1
    body = sent[0]
    assert body["messages"] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.3, 0.9, 7)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"
    stats = css(bubble, ".stats")[0].text
    assert stats.startswith("7 tokens · ") and stats.endswith("finish: length"), stats
    # A reload keeps the settings (localStorage), and the key for this tab (sessionStorage).
    open_page(browser, srv, fresh_storage=False)
    assert {f: by_id(browser, f).get_attribute("value") for f in values} == values
    browser.execute_script("localStorage.clear()")
