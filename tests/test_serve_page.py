"""The chat page of `pyinfer serve` in a real headless Chromium (selenium with Debian's chromium-driver):
load /, type a question, read the streamed answer from the page, and compare it with what the API answers
to the same conversation at temperature 0. A screenshot lands in the test's temp folder."""
from __future__ import annotations

import re
import shutil

import pytest
from serve_harness import live_server

from pyinfer.hub.pull import SMALLEST_MODEL, pull

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="no headless browser: apt-get install chromium chromium-driver (.ci/run does)")

CONCISE = "You are a concise assistant. Answer in one sentence."
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1000,800"]
MAX_TOKENS = 48


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")  # a new empty profile
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _ask_on_page(driver, question: str) -> tuple[str, str, int]:
    """Types the question, waits for the answer to finish; (answer, stats line, text updates while streaming)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    n_before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.execute_script("""
        window.updates = 0;
        window.observer = new MutationObserver(() => window.updates++);
        window.observer.observe(document.getElementById('messages'), {subtree: true, characterData: true,
                                                                       childList: true});""")
    driver.find_element(By.ID, "input").send_keys(question + Keys.ENTER)
    wait = WebDriverWait(driver, 120)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > n_before)
    answer = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    wait.until(lambda d: answer.get_attribute("data-state") != "streaming")
    assert answer.get_attribute("data-state") == "done", driver.find_element(By.ID, "messages").text
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg.error")
    updates = driver.execute_script("window.observer.disconnect(); return window.updates;")
    return answer.find_element(By.CSS_SELECTOR, ".text").text, answer.find_element(By.CSS_SELECTOR, ".stats").text, \
        updates


def test_chat_page_streams_answers_and_keeps_the_conversation(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model = pull(SMALLEST_MODEL, progress=False)
    with live_server(model, tmp_path, "-c", "1024") as server:
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(lambda d: model.stem in d.find_element(By.ID, "model").text)
        browser.find_element(By.TAG_NAME, "summary").click()  # open the settings
        for field, value in (("system", CONCISE), ("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)

        client = server.client()
        history = [{"role": "system", "content": CONCISE}]
        for question in ("What is the capital of France?", "What river flows through it?"):
            answer, stats, updates = _ask_on_page(browser, question)
            history.append({"role": "user", "content": question})
            want = client.chat.completions.create(model=model.stem, messages=history, temperature=0,
                                                  max_tokens=MAX_TOKENS).choices[0].message.content
            assert answer == want.strip()  # the page shows the text as it came (trailing white space aside)
            history.append({"role": "assistant", "content": want})
            assert updates > 3, updates  # it arrived in pieces, not at once
            assert re.search(r"\d+ tokens · [\d.]+ tokens/s", stats), stats
        assert "Paris" in history[2]["content"]
        cached = int(re.search(r"\((\d+) cached\)", stats).group(1))
        assert cached > 0  # the second turn reused the first from the KV cache
        shot = tmp_path / "chat-page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 1000


def test_answers_render_as_markdown_and_never_as_html(browser, tmp_path):
    """The page's renderer, in the browser under the server's CSP: a fenced code block with a copy button,
    inline code, bold, lists; HTML in the model's text (a script, an image with onerror) stays text, and
    nothing of it runs. A stopped answer's stats count what arrived."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    answer = ("Use this:\n```python\nprint('<b>hi</b>')\n```\n- **bold** and `x<y`\n- <script>window.pwned=1</script>\n"
              "<img src=x onerror=\"window.pwned=2\">\n```js\nunclosed(")
    with live_server(pull(SMALLEST_MODEL, progress=False), tmp_path, "-c", "128") as server:
        browser.get(server.url + "/")
        WebDriverWait(browser, 30).until(lambda d: "context" in d.find_element(By.ID, "model").text)
        got = browser.execute_script("""
            const div = document.createElement('div');
            div.className = 'text';
            document.getElementById('messages').appendChild(div);
            renderMarkdown(div, arguments[0]);
            return {codes: [...div.querySelectorAll('pre > code')].map((c) => c.textContent),
                    langs: [...div.querySelectorAll('pre > code')].map((c) => c.dataset.lang),
                    buttons: div.querySelectorAll('pre > button').length,
                    inline: [...div.querySelectorAll(':not(pre) > code')].map((c) => c.textContent),
                    strong: [...div.querySelectorAll('strong')].map((c) => c.textContent),
                    items: div.querySelectorAll('ul > li').length,
                    html: div.querySelectorAll('script, img, b').length,
                    text: div.textContent, pwned: window.pwned === undefined ? null : window.pwned,
                    stopped: statsLine(null, null, 2.0, 7)};""", answer)
        browser.find_element(By.TAG_NAME, "summary").click()  # open the settings
        key = browser.find_element(By.ID, "api-key")
        key.send_keys("sk-page")
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'));", key)
        kept = browser.execute_script("return [sessionStorage.getItem('pyinfer.api-key'), "
                                      "localStorage.getItem('pyinfer.api-key')];")
    assert got["codes"] == ["print('<b>hi</b>')", "unclosed("] and got["langs"] == ["python", "js"]
    assert got["buttons"] == 2 and got["inline"] == ["x<y"] and got["strong"] == ["bold"] and got["items"] == 2
    assert got["html"] == 0 and got["pwned"] is None
    assert "<script>window.pwned=1</script>" in got["text"] and '<img src=x onerror="window.pwned=2">' in got["text"]
    assert got["stopped"] == "7 tokens \u00b7 3.5 tokens/s \u00b7 stopped \u00b7 2.00 s"
    assert kept == ["sk-page", None]  # the key lives for the tab's session, not in the browser for good
