"""`shoal serve`'s HTTP side: JSON errors, the model, CORS (also from a real browser page),
the access log and the start-up line, with and without a key."""

import time

import httpx2 as httpx
import openai
import pytest
from playwright.sync_api import sync_playwright

from tests.integration.clients.cluster import HEADERS, HI, KEY, ORIGIN, client

pytestmark = pytest.mark.slow


def test_models_retrieve_and_json_404s(server):
    c = client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="no model 'other'"):
        c.models.retrieve("other")
    missing = httpx.get(server.url + "/v1/nothing", headers=HEADERS)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route GET /v1/nothing"
    wrong = httpx.get(server.url + "/v1/chat/completions", headers=HEADERS)
    assert wrong.status_code == 405 and "does not take GET" in wrong.json()["error"]["message"]


def test_cors_lets_the_named_origin_in_and_without_cors_options_is_a_json_405(
    server, quiet_server
):
    preflight_headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization, content-type"}
    preflight = httpx.request("OPTIONS", server.url + "/v1/chat/completions",
                              headers=preflight_headers)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    reply = httpx.get(server.url + "/v1/models", headers={**HEADERS, "Origin": ORIGIN})
    assert reply.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={**HEADERS,
                                                          "Origin": "http://elsewhere"})
    assert "access-control-allow-origin" not in other.headers
    off = httpx.request("OPTIONS", quiet_server.url + "/v1/chat/completions",
                        headers=preflight_headers)  # no --cors-origin: no preflight answer
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    assert off.json()["error"] == {"message": "/v1/chat/completions does not take OPTIONS",
                                   "type": "invalid_request_error", "param": None,
                                   "code": 405}


FETCH = """async ({url, key}) => {
  try {
    const reply = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "What is the capital of France?"}],
                            max_tokens: 6, temperature: 0})});
    const body = await reply.json();
    return {status: reply.status, content: body.choices[0].message.content};
  } catch (e) {
    return {error: e.name};
  }
}"""


def test_a_browser_page_of_the_named_origin_can_call_the_api_and_others_cannot(server, pages,
                                                                              chromium):
    """Debian's chromium, driven by playwright: fetch() from a page of the --cors-origin
    origin (a preflight, then the call with its key) gets the answer; from another origin
    the browser refuses it."""
    expected = client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=6, temperature=0).choices[0].message.content
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            results = []
            for origin in pages:
                page.goto(origin + "/", timeout=30_000)
                results.append(page.evaluate(FETCH, {"url": server.url, "key": KEY}))
        finally:
            browser.close()
    assert results[0] == {"status": 200, "content": expected}
    assert results[1] == {"error": "TypeError"}  # "Failed to fetch": CORS refused it


def _log_when(local, text: str, timeout: float = 10.0) -> str:
    """The server's log once it holds `text` (the access line follows the answer)."""
    deadline = time.monotonic() + timeout
    while text not in (log := local.log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return log


def test_the_log_says_a_key_is_needed_and_has_a_line_per_request(server):
    httpx.get(server.url + "/v1/models/tiny", headers=HEADERS)
    log = _log_when(server, '"GET /v1/models/tiny" 200')
    assert "an API key is required" in log and ORIGIN in log
    assert '"GET /v1/models/tiny" 200' in log


def test_at_log_level_warning_no_key_is_asked_and_no_request_is_logged(quiet_server):
    """Last to use the quiet server: it stops it, so that everything it wrote is in the log
    before the log is read."""
    [line] = [line for line in quiet_server.log.read_text().splitlines()
              if " requests decoded together)" in line]
    assert line.startswith(f"shoal serve: tiny on {quiet_server.url}/v1 (")
    assert line.endswith("; no API key is required"), line
    bare = openai.OpenAI(base_url=quiet_server.url + "/v1", api_key="any", max_retries=0,
                         timeout=60)  # a key it does not check
    assert bare.models.retrieve("tiny").id == "tiny"
    assert bare.chat.completions.create(model="tiny", messages=HI, max_tokens=2,
                                        temperature=0).choices[0].message.content
    quiet_server.stop()
    assert quiet_server.proc.returncode == 0
    log = quiet_server.log.read_text()
    assert "shoal.access" not in log and "/v1/models/tiny" not in log, log
    assert " INFO " not in log, log  # neither Shoal's info lines nor uvicorn's
