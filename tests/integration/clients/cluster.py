"""What the client tests share: the request bodies, the tiny checkpoint with a tool template
(tests/integration/tool_template.jinja) and how to reach the server; conftest.py starts it."""

import json
import shutil
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx2 as httpx
import openai
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors

KEY = "sk-test-clients"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://app.example"
TEMPLATE = Path(__file__).parents[1] / "tool_template.jinja"
HI = [{"role": "user", "content": "What is the capital of France?"}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def with_tool_template(checkpoint: Path, out: Path) -> Path:
    shutil.copytree(checkpoint, out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE.read_text()
    config_file.write_text(json.dumps(config))
    return out


class Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b"<!doctype html><html><body>a page</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass



def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)


def mlx_lm_text(mlx_lm_model, prompt: list[int], max_tokens: int, **processors) -> str:
    """Greedy text of mlx-lm's stream_generate with mlx-lm's logits processors."""
    model, tokenizer = mlx_lm_model
    text = ""
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                             logits_processors=make_logits_processors(**processors)):
        if r.finish_reason == "stop":
            break
        text += r.text
    return text


# ---------------------------------------------------------------------------------------
# The schema sweep
