"""The chat page in a real browser: headless Chromium (Debian's `chromium`, installed by `make
test` where apt can) driven by playwright, against `edgespec serve`'s app on the real SmolLM2."""

import shutil

import pytest

pytestmark = pytest.mark.integration

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("fastapi")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(not CHROMIUM, reason="no chromium on this machine (make test installs it with apt where it can)")
def test_the_chat_page_streams_a_reply_in_a_browser():
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.server import make_app
    from edgespec.targets import resolve_target
    from test_server import Server

    llm = SpeculativeLlama(str(resolve_target("smollm2-135m")), n_ctx=1024, draft="default")
    srv = Server(make_app(llm, "smollm2-135m"))
    question = "Name three colours."
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(srv.url + "/")
                page.fill("#msg", question)
                page.click("#send")
                # streamed text shows up, then the final statistics replace the progress line
                page.wait_for_function("() => { const a = document.querySelector('#log .assistant');"
                                       " return a && a.textContent.length > 0; }", timeout=120000)
                page.wait_for_function("() => document.getElementById('stats').textContent"
                                       ".includes('tokens per target pass: ') && "
                                       "!document.getElementById('stats').textContent.includes(': -')",
                                       timeout=120000)
                user = page.text_content("#log .user")
                reply = page.text_content("#log .assistant")
                stats = page.text_content("#stats")
                assert page.is_disabled("#stop")  # the reply finished
            finally:
                browser.close()
        assert user == question and reply.strip() and "tokens/s: " in stats
        # greedy: the page's streamed reply is what the API returns for the same request
        direct = llm.create_chat_completion(messages=[{"role": "user", "content": question}],
                                            max_tokens=256, temperature=0)
        assert reply == direct["choices"][0]["message"]["content"]
    finally:
        srv.stop()
