"""gpt-oss's harmony answers read by the ``openai_gptoss`` reasoning parser and the ``openai`` tool
parser: the analysis channel as the reasoning, the final channel as the content, messages to
``functions.NAME`` as calls (the recipient before or after the channel), the output's end
closing a message whose end marker is the eos token; whole or streamed in any chunking."""
from __future__ import annotations

import json
import random

import pytest

from actors.frontend import harmony
from actors.frontend.reasoning import REASONING_PARSERS
from actors.frontend.tool_parsers import TOOL_PARSERS

ANSWER = ("<|channel|>analysis<|message|>The user wants 2 + 2. Easy: <4>.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is 4 (a |> and a <| inside).")
CALL = ("<|channel|>analysis<|message|>Need the weather; call the tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo", "days": [1, 2]}<|call|>')
CALL_FIRST = ("<|channel|>analysis<|message|>Two cities.<|end|>"
              '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
              '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}')
BUILTIN = ("<|channel|>analysis<|message|>Search first.<|end|>"
           '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "oslo"}<|call|>'
           "<|start|>assistant<|channel|>final<|message|>Done.")
PREAMBLE = ("<|channel|>commentary<|message|>Checking now.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}')

reasoning_parser = REASONING_PARSERS["openai_gptoss"]


def _stream_split(text: str, sizes: list[int]) -> tuple[str, str]:
    stream, got, pos = reasoning_parser.stream(), ["", ""], 0
    for n in sizes:
        r, c = stream.feed(text[pos:pos + n], final=pos + n >= len(text))
        got[0], got[1], pos = got[0] + r, got[1] + c, pos + n
        if pos >= len(text):
            break
    return got[0], got[1]


@pytest.mark.parametrize("text, reasoning, content", [
    (ANSWER, "The user wants 2 + 2. Easy: <4>.", "It is 4 (a |> and a <| inside)."),
    (ANSWER + "<|return|>", "The user wants 2 + 2. Easy: <4>.", "It is 4 (a |> and a <| inside)."),
    ("<|channel|>analysis<|message|>still thinking", "still thinking", None),    # cut off while reasoning
    ("Plain words, no harmony.", None, "Plain words, no harmony."),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", "a", None),   # header cut off
])
def test_the_analysis_channel_is_the_reasoning_and_the_final_one_the_content(text, reasoning, content):
    assert reasoning_parser.split(text) == (reasoning, content)
    rng = random.Random(0)
    for sizes in ([1] * len(text), *([rng.randint(1, 9) for _ in text] for _ in range(25))):
        assert _stream_split(text, sizes) == (reasoning or "", content or "")


@pytest.mark.parametrize("text, calls, content", [
    (CALL, [("get_weather", '{"city": "Oslo", "days": [1, 2]}')], ""),
    (CALL_FIRST, [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')], ""),
    (PREAMBLE, [("f", "{}")], "Checking now."),
    (ANSWER, [], "It is 4 (a |> and a <| inside)."),
    (BUILTIN, [], "Done."),                        # a built-in tool's message: no call, not the content
])
def test_messages_to_functions_are_calls_read_from_the_raw_output_or_from_the_reasoning_parsers_content(
        text, calls, content):
    tool_parser = TOOL_PARSERS["openai"]()
    assert tool_parser.keeps_special_tokens and reasoning_parser.keeps_special_tokens
    reading = tool_parser.read(text, True)
    assert [(c.name, c.arguments) for c in reading.calls] == calls and reading.content == content
    for c in reading.calls:
        json.loads(c.arguments)
    reasoning, after_reasoning = reasoning_parser.split(text)   # the calls stay in the content, whole
    assert reasoning is None or "{" not in reasoning        # no tool's arguments in the reasoning
    again = tool_parser.read(after_reasoning or "", True)
    assert [(c.name, c.arguments) for c in again.calls] == calls and again.content == content


def test_any_chunking_of_a_streamed_call_adds_up_to_the_whole_reading():
    from test_tool_parsers import stream_all
    parser = TOOL_PARSERS["openai"]()
    final = parser.read(CALL_FIRST, True)
    rng = random.Random(1)
    for sizes in ([1] * len(CALL_FIRST), *([rng.randint(1, 7) for _ in CALL_FIRST] for _ in range(30))):
        content, calls, _ = stream_all(parser, CALL_FIRST, sizes)
        assert content == final.content
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in final.calls]


def test_headers_name_the_channel_and_recipient_in_either_order():
    assert harmony.header_fields("<|channel|>analysis") == ("analysis", None)
    assert harmony.header_fields("<|start|>assistant to=functions.f<|channel|>commentary json") == \
        ("commentary", "functions.f")
    assert harmony.header_fields("<|start|>assistant<|channel|>commentary to=functions.g <|constrain|>json") == \
        ("commentary", "functions.g")


def test_the_parser_needs_the_markers_as_tokens():
    class Words:           # a tokenizer that spells the markers out
        def encode(self, text):
            return list(text)
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss: the model's tokenizer has no <|channel|>"):
        reasoning_parser.check(Words())


def test_a_thinking_budget_opens_at_the_analysis_header_and_forces_the_final_channels():
    """thinking_token_budget with openai_gptoss: the reasoning opens at the analysis message's
    header, a spent budget forces its end and the final channel's header, and the model's own
    <|end|> closes it."""
    from actors.engine.config import ReasoningConfig
    from actors.frontend.reasoning import resolve_reasoning

    class Tokens:          # the markers as single ids, each character of other text as one
        has_text = True

        def encode(self, text, add_special_tokens=False):
            ids, i = [], 0
            while i < len(text):
                marker = next((m for m in harmony.MARKERS if text.startswith(m, i)), None)
                ids.append(harmony.MARKERS.index(marker) if marker else 100 + ord(text[i]))
                i += len(marker) if marker else 1
            return ids
    t = Tokens()
    r = resolve_reasoning(ReasoningConfig(reasoning_parser="openai_gptoss"), t)
    assert r.start_token_ids == tuple(t.encode("<|channel|>analysis<|message|>"))
    assert r.end_token_ids == tuple(t.encode("<|end|><|start|>assistant<|channel|>final<|message|>"))
    assert r.natural_end_token_ids == (harmony.MARKERS.index("<|end|>"),)


def test_a_responses_reasoning_effort_becomes_the_chats_and_a_summary_is_refused():
    """gpt-oss's template reads reasoning_effort: /v1/responses passes its reasoning.effort on."""
    import msgspec

    from actors.frontend.protocol import BadRequest
    from actors.frontend.responses import ResponsesRequest
    req = msgspec.convert({"model": "m", "input": "Hi", "reasoning": {"effort": "low"}}, ResponsesRequest)
    req.check()
    assert req.chat_body([])["reasoning_effort"] == "low"
    assert "reasoning_effort" not in msgspec.convert({"model": "m", "input": "Hi"}, ResponsesRequest).chat_body([])
    summary = msgspec.convert({"model": "m", "input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}},
                              ResponsesRequest)
    with pytest.raises(BadRequest, match="reasoning options other than effort"):
        summary.check()
