"""The official `ollama` client on Ollama's API of `shoal serve`: chat, generate and models,
every field and option honoured or refused with a 400 naming it, num_ctx, tools and format."""

import json

import httpx2 as httpx
import jsonschema
import ollama
import ollama._types as ollama_types
import pytest

from coordinator.server.ollama_api import CHAT_FIELDS as OLLAMA_CHAT_FIELDS
from coordinator.server.ollama_api import GENERATE_FIELDS as OLLAMA_GENERATE_FIELDS
from coordinator.server.ollama_api import NEUTRAL as OLLAMA_NEUTRAL
from coordinator.server.ollama_api import OPTIONS as OLLAMA_OPTIONS
from engine.manifest import read_manifest
from tests.integration.clients.cluster import HEADERS, HI, PERSON, WEATHER, client, post

pytestmark = pytest.mark.slow


def test_ollama_chat_generate_and_models(server, source):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    openai_text = client(server).chat.completions.create(
        model="tiny", messages=HI, max_tokens=12, temperature=0).choices[0].message.content
    reply = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 12})
    assert reply.message.content == openai_text and reply.done
    assert reply.eval_count >= 1 and reply.prompt_eval_count > 0
    streamed = list(o.chat(model="tiny", messages=HI, stream=True,
                           options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.message.content for p in streamed) == openai_text
    assert streamed[-1].done and not any(p.done for p in streamed[:-1])
    generated = o.generate(model="tiny", prompt=HI[0]["content"], stream=False,
                           options={"temperature": 0, "num_predict": 12})
    assert generated.response == openai_text
    raw = o.generate(model="tiny", prompt="the quick brown fox", raw=True, stream=False,
                     options={"temperature": 0, "num_predict": 8})
    text = client(server).completions.create(model="tiny", prompt="the quick brown fox",
                                             max_tokens=8, temperature=0).choices[0].text
    assert raw.response == text
    assert [m.model for m in o.list().models] == ["tiny"]
    manifest = read_manifest(source.parent / "sharded")
    assert o.list().models[0].size == sum(
        f.bytes for f in (*manifest.dense_files, *manifest.experts)) > 0  # Ollama's: bytes
    assert [m.model for m in o.ps().models] == ["tiny"]
    assert o.show("tiny").capabilities == ["completion", "tools"]
    assert httpx.get(server.url + "/api/version", headers=HEADERS).json()["version"]
    with pytest.raises(ollama.ResponseError, match="mirostat"):
        o.chat(model="tiny", messages=HI, options={"mirostat": 2})


OLLAMA_SAMPLES = {  # a value for each field of Ollama's chat and generate that asks something
    "model": "tiny", "messages": HI, "prompt": "hello", "stream": False, "format": "json",
    "options": {"temperature": 0, "num_predict": 3, "seed": 1}, "think": False,
    "keep_alive": "10m", "tools": [WEATHER], "logprobs": True, "top_logprobs": 2,
    "system": "Be brief.", "raw": True, "suffix": "end", "template": "{{ .Prompt }}",
    "context": [1, 2], "images": ["aGk="], "width": 64, "height": 64, "steps": 4,
}
OPTION_SAMPLES = {
    "num_predict": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 1,
    "stop": ["\n"], "repeat_penalty": 1.3, "repeat_last_n": 8, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "num_ctx": 4096, "numa": True, "num_batch": 8, "num_gpu": 1,
    "main_gpu": 1, "low_vram": True, "f16_kv": True, "logits_all": True, "vocab_only": True,
    "use_mmap": True, "use_mlock": True, "embedding_only": True, "num_thread": 2,
    "num_keep": 4, "tfs_z": 0.5, "typical_p": 0.5, "mirostat": 1, "mirostat_tau": 4.0,
    "mirostat_eta": 0.2, "penalize_newline": True, "speculative": False,
}
QUIET = {"temperature": 0, "num_predict": 3}


def test_the_ollama_sweep_knows_every_field_of_the_installed_ollama_package():
    assert set(ollama_types.ChatRequest.model_fields) <= set(OLLAMA_CHAT_FIELDS)
    assert set(ollama_types.GenerateRequest.model_fields) <= set(OLLAMA_GENERATE_FIELDS)
    assert set(ollama_types.Options.model_fields) <= set(OLLAMA_OPTIONS)
    assert set(OLLAMA_CHAT_FIELDS) | set(OLLAMA_GENERATE_FIELDS) <= set(OLLAMA_SAMPLES)
    assert set(OLLAMA_OPTIONS) <= set(OPTION_SAMPLES)


def _ollama_text(reply: httpx.Response) -> str:
    body = reply.json()
    return body["message"]["content"] if "message" in body else body["response"]


@pytest.mark.parametrize("route,fields", [("/api/chat", OLLAMA_CHAT_FIELDS),
                                          ("/api/generate", OLLAMA_GENERATE_FIELDS)])
def test_every_ollama_field_and_option_is_honoured_or_refused_with_a_400_naming_it(
    server, route, fields
):
    """As the OpenAI sweep, for the fields of each route and (on /api/chat) every option:
    200 where honoured, the same answer at a neutral value, else 400 naming it."""
    base = {"model": "tiny", "stream": False, "options": QUIET}
    base |= {"messages": HI} if route == "/api/chat" else {"prompt": "hello"}
    plain = post(server, route, base)
    assert plain.status_code == 200, plain.text
    sent = [(name, status, {**base, name: OLLAMA_SAMPLES[name]})
            for name, status in fields.items()]
    if route == "/api/chat":
        sent += [(name, status, {**base, "options": {**QUIET, name: OPTION_SAMPLES[name]}})
                 for name, status in OLLAMA_OPTIONS.items()]
    for name, status, body in sent:
        reply = post(server, route, body)
        if status == "yes":
            assert reply.status_code == 200, (name, reply.text)
        else:
            assert reply.status_code == 400, (name, reply.text)
            assert f"'{name}'" in reply.json()["error"], (name, reply.text)
    for name, values in OLLAMA_NEUTRAL.items():
        for value in values:
            body = ({**base, "options": {**QUIET, name: value}} if name in OLLAMA_OPTIONS
                    else {**base, name: value})
            reply = post(server, route, body)
            assert reply.status_code == 200, (name, value, reply.text)
            assert _ollama_text(reply) == _ollama_text(plain), (name, value)
    unload = post(server, route, {**base, "keep_alive": 0})  # the one keep_alive refused
    assert unload.status_code == 400 and "'keep_alive'" in unload.json()["error"]


def test_ollama_num_ctx_bounds_the_prompt_and_the_answer(server):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    plain = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 12})
    assert plain.eval_count > 3
    held = o.chat(model="tiny", messages=HI, stream=False,
                  options={"temperature": 0, "num_ctx": plain.prompt_eval_count + 3})
    assert held.eval_count == 3 and held.done_reason == "length"
    assert plain.message.content.startswith(held.message.content)
    with pytest.raises(ollama.ResponseError, match="'num_ctx'"):
        o.chat(model="tiny", messages=HI, stream=False,
               options={"num_ctx": plain.prompt_eval_count})


def test_ollama_tools_and_format(server):
    o = ollama.Client(host=server.url, headers=HEADERS, timeout=60)
    reply = o.chat(model="tiny", messages=HI, stream=False, format=PERSON,
                   options={"temperature": 0, "num_predict": 150})
    jsonschema.validate(json.loads(reply.message.content), PERSON)
    plain = o.chat(model="tiny", messages=HI, stream=False,
                   options={"temperature": 0, "num_predict": 2})
    with_tools = o.chat(model="tiny", messages=HI, stream=False, tools=[WEATHER],
                        options={"temperature": 0, "num_predict": 2})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count  # the tools rendered


# ---------------------------------------------------------------------------------------
# HTTP: JSON errors, the model, CORS, the access log and the start-up line


