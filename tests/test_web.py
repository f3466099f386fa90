"""The web chat page (GET /) in a real headless browser: Debian's chromium driven by playwright. Type a
message and see the reply stream in (several updates, equal to the API's greedy answer), stop a long reply
(the row is freed), a second turn sends the whole conversation, and nothing is fetched from elsewhere."""
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serve_fixtures import ServerThread, shared_checkpoint  # noqa: E402

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("NANOEULER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("chromium is not installed (apt-get install chromium)", allow_module_level=True)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SHOT = os.environ.get("NANOEULER_SCREENSHOT")  # write the README's screenshot here when set


def greedy_reply(client, messages, max_tokens):
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_chat_page_streams_stops_and_keeps_the_conversation():
    import openai

    from nanoeuler.serve.app import create_app
    d, model, tok = shared_checkpoint()
    app = create_app(model, tok, "tiny", max_batch=4)
    batcher = app.state.service.batcher
    step = batcher.step

    def slow_step():  # a visible pace: tokens arrive one by one (slower than serve's 10 ms hand-over window, which
        time.sleep(0.02)  # folds the tokens of one window into one write), and a long reply is still running when stopped
        return step()
    batcher.step = slow_step
    with ServerThread(app) as srv, sync_api.sync_playwright() as pw:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        first = "Who is there?"
        want1, _ = greedy_reply(client, [{"role": "user", "content": first}], 64)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 560})
            requests = []
            page.on("request", lambda r: requests.append((r.url, r.post_data)))
            page.goto(srv.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "64")
            # count how many times the reply's text changes while it streams
            page.evaluate("""() => { window.updates = 0; new MutationObserver(() => window.updates++)
                .observe(document.getElementById('messages'), {subtree: true, characterData: true, childList: true}); }""")
            page.fill("#input", first)
            page.press("#input", "Enter")
            page.wait_for_function("!document.getElementById('send').disabled && document.querySelectorAll('.msg.assistant').length == 1")
            reply1 = page.inner_text(".msg.assistant >> nth=0 >> .text")
            assert reply1 == want1 and page.evaluate("window.updates") > 5
            # second turn: the page sends the whole conversation, the reply equals the API's for it
            second = "Long live the king!"
            page.fill("#input", second)
            page.click("#send")
            page.wait_for_function("!document.getElementById('send').disabled && document.querySelectorAll('.msg.assistant').length == 2")
            msgs = [{"role": "user", "content": first}, {"role": "assistant", "content": want1},
                    {"role": "user", "content": second}]
            want2, _ = greedy_reply(client, msgs, 64)
            assert page.inner_text(".msg.assistant >> nth=1 >> .text") == want2
            posted = [p for u, p in requests if u.endswith("/v1/chat/completions")]
            assert '"Long live the king!"' in posted[-1] and '"Who is there?"' in posted[-1]
            if SHOT:
                page.screenshot(path=SHOT)
            # a long reply, stopped while it streams: the text stops growing and the server frees the row
            submit = batcher.submit
            batcher.submit = lambda job: (setattr(job, "stop_ids", ()), submit(job))[1]  # no early </s>
            page.fill("#max-tokens", "1000")
            page.fill("#temperature", "1")
            page.fill("#input", "Speak the speech, I pray you.")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.msg.assistant')[2].innerText.length > 10")
            page.click("#stop")
            page.wait_for_selector(".msg.assistant >> nth=2 >> .note:text-is('[stopped]')")
            text = page.inner_text(".msg.assistant >> nth=2 >> .text")
            deadline = time.time() + 3
            while batcher.stats()["active"] and time.time() < deadline:
                time.sleep(0.02)
            assert batcher.stats()["active"] == 0
            time.sleep(0.1)
            assert page.inner_text(".msg.assistant >> nth=2 >> .text") == text
            assert all(u.startswith(srv.url) for u, _ in requests)  # no CDN, nothing from elsewhere
        finally:
            browser.close()
