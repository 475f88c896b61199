"""The Anthropic Messages API's conversions (actors/frontend/anthropic.py), as vLLM makes them: a
Messages request to the chat completion it is answered as, and the chat answer back to a
message or to Anthropic's stream of events; errors in Anthropic's shape."""
from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from aiohttp import web

from actors.frontend import anthropic
from actors.frontend.errors import error_response
from actors.frontend.protocol import BadRequest


def _req(cls=anthropic.MessagesRequest, **fields) -> anthropic.MessagesRequest:
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    if cls is anthropic.MessagesRequest:
        base["max_tokens"] = 64
    return msgspec.convert(base | fields, cls)


def test_system_blocks_join_and_claude_codes_billing_header_is_dropped():
    body = anthropic.chat_body(_req(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                                            {"type": "text", "text": "You are terse. "},
                                            {"type": "text", "text": "Answer in French."}]), False)
    assert body["messages"][0] == {"role": "system", "content": "You are terse. Answer in French."}
    assert body["max_tokens"] == 64 and "stream" not in body


def test_inline_system_messages_stay_in_place_or_join_the_leading_one():
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "reminder"},
                {"role": "user", "content": "b"}]
    kept = anthropic.chat_body(_req(system="S", messages=messages), False)["messages"]
    assert [m["role"] for m in kept] == ["system", "user", "system", "user"]
    merged = anthropic.chat_body(_req(system="S", messages=messages), True)["messages"]
    assert merged == [{"role": "system", "content": "Sreminder"}, {"role": "user", "content": "a"},
                      {"role": "user", "content": "b"}]


def test_tool_use_thinking_and_tool_results_become_chat_messages_in_order():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat = anthropic.chat_body(_req(messages=messages), False)["messages"]
    assert chat[1] == {"role": "assistant", "content": "Let me check.", "reasoning": "I should call the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert chat[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"}
    assert chat[3] == {"role": "user", "content": "And tomorrow?"}
    only_result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]
    assert anthropic.chat_body(_req(messages=only_result), False)["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": "ok"}]          # no empty user message after it


def test_image_blocks_become_chat_image_parts_where_they_stand():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
        {"type": "image", "source": {"type": "url", "url": "https://h/b.png"}}]}]
    chat = anthropic.chat_body(_req(messages=messages), False)["messages"]
    assert chat == [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
        {"type": "image_url", "image_url": {"url": "https://h/b.png"}}]}]


def test_tools_choices_formats_thinking_and_streams_take_the_chat_requests_names():
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {"properties": {"city": {"type": "string"}}}}]
    body = anthropic.chat_body(_req(tools=tools, stream=True, stop_sequences=["\n\n"], temperature=0.2, top_k=5,
                                    output_config={"effort": "low", "format": {"type": "json_schema",
                                                                             "schema": {"type": "object"}}}), False)
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "description": "Weather"}}]
    assert body["tool_choice"] == "auto" and body["stop"] == ["\n\n"] and body["top_k"] == 5
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                            "schema": {"type": "object"}}}
    assert body["reasoning_effort"] == "low"
    for choice, expected in (({"type": "any"}, "required"), ({"type": "none"}, "none"),
                             ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                              {"type": "function", "function": {"name": "get_weather"}})):
        body = anthropic.chat_body(_req(tools=tools, tool_choice=choice), False)
        assert body["tool_choice"] == expected
    assert body["parallel_tool_calls"] is False
    assert anthropic.chat_body(_req(thinking={"type": "disabled"}), False)["reasoning_effort"] == "none"
    enabled = _req(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)
    assert "reasoning_effort" not in anthropic.chat_body(enabled, False)
    # budget_tokens caps the reasoning where the server knows the reasoning tags (vLLM's thinking_token_budget)
    assert anthropic.chat_body(enabled, False, thinking_budgets=True)["thinking_token_budget"] == 1024
    assert "thinking_token_budget" not in anthropic.chat_body(enabled, False)


@pytest.mark.parametrize("fields, param, message", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be positive"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens", "at least 1024"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 1500}, "thinking.budget_tokens",
     "less than max_tokens"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice",
     "tool_choice.name is required"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": "u"}}]}]},
     "messages[0].content[0]", "document blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0]", "must be base64 data"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0]",
     "unknown content block type 'hologram'"),
])
def test_requests_that_cannot_be_answered_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(BadRequest) as exc:
        anthropic.chat_body(_req(**fields), False)
    assert exc.value.param == param and message in str(exc.value)


def test_stop_reasons_and_usage_are_anthropics():
    assert anthropic.stop_reason("length", None, True, False) == ("max_tokens", None)
    assert anthropic.stop_reason("stop", "\n\n", False, False) == ("stop_sequence", "\n\n")
    assert anthropic.stop_reason("stop", 2, False, False) == ("end_turn", None)          # a stop token id
    assert anthropic.stop_reason("stop", None, True, True) == ("tool_use", None)
    assert anthropic.stop_reason("abort", None, False, False) == (None, None)
    assert anthropic.usage({"prompt_tokens": 30, "completion_tokens": 5}) == {"input_tokens": 30, "output_tokens": 5}
    assert anthropic.usage({"prompt_tokens": 30, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}}) \
        == {"input_tokens": 14, "output_tokens": 5, "cache_read_input_tokens": 16}


class _Gen:
    """A chat generation's stream, as ChatGeneration.events yields it."""
    id, id_prefix = "chatcmpl-req-1", "chatcmpl-"

    def __init__(self, chunks):
        self.chunks = chunks

    async def events(self):
        for c in self.chunks:
            yield c


def _chunk(delta=None, finish=None, stop=None, usage=(10, 0)):
    u = {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}
    if delta is None:
        return {"id": "chatcmpl-req-1", "model": "m", "choices": [], "usage": u}
    return {"id": "chatcmpl-req-1", "model": "m", "usage": u,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}]}


async def _events(chunks):
    return [e async for e in anthropic.MessagesAnswer(_Gen(chunks)).events()]


def test_a_stream_opens_and_closes_one_block_per_kind_with_a_signature_after_thinking():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = asyncio.run(_events([
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "Think"}, usage=(10, 1)), _chunk({"reasoning": "ing."}, usage=(10, 2)),
        _chunk({"content": "Sure."}, usage=(10, 3)),
        _chunk({"tool_calls": [call]}, usage=(10, 4)),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, usage=(10, 5)),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, "tool_calls", usage=(10, 6)),
        _chunk(usage=(10, 6))]))
    kinds = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
             for e in events]
    assert kinds == [("message_start", None, None),
                     ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                     ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
                     ("content_block_stop", 0, None),
                     ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
                     ("content_block_stop", 1, None),
                     ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
                     ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
                     ("message_delta", None, None), ("message_stop", None, None)]
    assert events[0]["message"]["id"] == "msg_req-1" and events[0]["message"]["usage"] == {"input_tokens": 10,
                                                                                          "output_tokens": 0}
    assert "".join(e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta") \
        == '{"city": "Paris"}'
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 10, "output_tokens": 6}


def test_a_stream_that_fails_ends_with_an_anthropic_error_event():
    failing = [_chunk({"role": "assistant", "content": ""}),
               {"error": {"message": "the request failed: boom", "type": "InternalServerError", "code": 500}}]
    events = asyncio.run(_events(failing))
    assert events[-1] == {"type": "error", "error": {"type": "InternalServerError",
                                                     "message": "the request failed: boom"}}


def test_a_whole_answer_has_thinking_text_and_tool_use_blocks():
    chat = {"model": "m", "usage": {"prompt_tokens": 9, "completion_tokens": 4},
            "choices": [{"finish_reason": "tool_calls", "stop_reason": None, "message": {
                "role": "assistant", "content": "Checking.", "reasoning": "Hmm.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}
    body = anthropic.MessagesAnswer(_Gen([])).whole(chat)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    assert (body["stop_reason"], body["id"], body["type"], body["role"]) == ("tool_use", "msg_req-1", "message",
                                                                            "assistant")
    empty = {**chat, "choices": [{"finish_reason": "stop", "stop_reason": None,
                                  "message": {"role": "assistant", "content": ""}}]}
    assert anthropic.MessagesAnswer(_Gen([])).whole(empty)["content"] == [{"type": "text", "text": ""}]


def test_errors_are_rewritten_in_anthropics_shape():
    out = anthropic.anthropic_error(error_response(404, "The model `x` does not exist.", "model"))
    assert out.status == 404 and json.loads(out.body) == {
        "type": "error", "error": {"type": "NotFoundError", "message": "The model `x` does not exist."}}
    ok = web.Response(text="fine")
    assert anthropic.anthropic_error(ok) is ok
