"""vLLM's Anthropic Messages API: ``POST /v1/messages`` (whole, or streamed as Anthropic's events)
and ``POST /v1/messages/count_tokens``, so the Anthropic SDK and the tools built on it talk to
the server unchanged but for the base URL.

As vLLM does, a Messages request is answered as the chat completion it converts to: the system
prompt, text, ``thinking``, ``tool_use`` and ``tool_result`` blocks become chat messages (an
assistant's thinking its ``reasoning``, a tool result a ``tool`` message), ``tools`` and
``tool_choice`` (``any`` is ``required``) OpenAI's, ``output_config.format`` a JSON schema
``response_format``, ``thinking`` the template's reasoning switch; the answer's reasoning,
text and tool calls come back as ``thinking``, ``text`` and ``tool_use`` blocks with
Anthropic's stop reasons and usage. Errors have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``) with vLLM's error types. Unknown request
fields are ignored, as Anthropic's clients send many this server has no use for."""
from __future__ import annotations

import functools
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

import msgspec
from aiohttp import web

from actors.frontend import http_trace
from actors.frontend.chat import ChatGeneration, start_chat
from actors.frontend.errors import error_type, json_encoder
from actors.frontend.fanout import close_all
from actors.frontend.protocol import BadRequest, ChatCompletionRequest
from actors.frontend.sse import send_events

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
MIN_THINKING_BUDGET = 1024                   # Anthropic's (and vLLM's) smallest budget_tokens
BILLING_HEADER = "x-anthropic-billing-header"   # Claude Code's per-request system line: dropped
                                                 # (its hash would defeat the prefix cache)


class ContentBlock(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class Message(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(msgspec.Struct):
    type: Literal["json_schema"] = "json_schema"
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Thinking(msgspec.Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """What ``count_tokens`` reads: the parts of a Messages request that make its prompt."""
    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # vLLM's fields beyond Anthropic's
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    watermarking: bool | None = None          # vLLM's: opts out of (false) the server's watermark


# -- the request as a chat completion ---------------------------------------------------------

def chat_body(req: CountTokensRequest, merge_inline_system: bool, thinking_budgets: bool = False) -> dict[str, Any]:
    """The chat completion request ``req`` is answered as (vLLM's conversion).
    ``merge_inline_system``: the chat template takes a system message first only, so the
    conversation's own system messages join the leading one. ``thinking_budgets``: the server
    knows the model's reasoning tags, so ``thinking.budget_tokens`` caps the reasoning (vLLM's
    thinking_token_budget); without them it is left out (vLLM refuses the request)."""
    _check(req)
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    inline = [m for m in req.messages if m.role == "system"] if merge_inline_system else []
    system += "".join(_system_text(m.content) for m in inline)
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if m.role == "system":
            if not merge_inline_system and (text := _system_text(m.content)):
                messages.append({"role": "system", "content": text})
            continue
        messages += _chat_messages(i, m)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    if isinstance(req, MessagesRequest):
        body |= {k: v for k, v in (("max_tokens", req.max_tokens), ("stop", req.stop_sequences),
                                   ("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                                   ("cache_salt", req.cache_salt), ("kv_transfer_params", req.kv_transfer_params),
                                   ("vllm_xargs", req.vllm_xargs), ("watermarking", req.watermarking))
                 if v is not None}
        if req.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    config = req.output_config
    if config is not None and config.format is not None and config.format.schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "json_schema", "schema": config.format.schema}}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    if req.thinking is not None and req.thinking.type == "disabled":
        body["reasoning_effort"] = "none"       # the template's enable_thinking off
    if (isinstance(req, MessagesRequest) and req.thinking is not None and req.thinking.type == "enabled"
            and thinking_budgets):
        body["thinking_token_budget"] = req.thinking.budget_tokens
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"any": "required"}.get(choice.type, choice.type))
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": {"type": "object", **t.input_schema},
            **({"description": t.description} if t.description is not None else {}),
            **({"strict": t.strict} if t.strict is not None else {})}} for t in req.tools]
        body.setdefault("tool_choice", "auto")
    return body


def _check(req: CountTokensRequest) -> None:
    if not req.model:
        raise BadRequest("model is required", "model")
    if isinstance(req, MessagesRequest) and req.max_tokens <= 0:
        raise BadRequest(f"max_tokens must be positive, got {req.max_tokens}", "max_tokens")
    if req.tool_choice is not None and req.tool_choice.type == "tool" and not req.tool_choice.name:
        raise BadRequest("tool_choice.name is required when type is 'tool'", "tool_choice")
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None or budget < MIN_THINKING_BUDGET:
            raise BadRequest(f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}, got {budget}",
                             "thinking.budget_tokens")
        if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
            raise BadRequest("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None:
        return ""
    blocks = [system] if isinstance(system, str) else [b.text for b in system if b.type == "text" and b.text]
    return "".join(t for t in blocks if not t.startswith(BILLING_HEADER))


def _chat_messages(i: int, m: Message) -> list[dict[str, Any]]:
    """Message ``i`` as chat messages: a user's tool results first, each a ``tool`` message,
    then the message itself when anything is left of it."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[str | dict[str, Any]] = []       # text, and image_url parts where the images are
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, b in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text":
            if b.text:
                texts.append(b.text)
        elif b.type == "thinking":
            if b.thinking is not None:
                reasoning.append(b.thinking)
        elif b.type == "redacted_thinking":       # opaque: accepted (and left out) so a client may echo it back
            continue
        elif b.type == "tool_use":
            calls.append({"id": b.id or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}})
        elif b.type == "tool_result":
            if m.role == "user":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": _result_text(b, where)})
            else:
                texts.append(f"Tool result: {b.content if b.content else ''}")
        elif b.type == "image":
            texts.append({"type": "image_url", "image_url": {"url": _image_url(b, where)}})
        elif b.type == "document":
            raise BadRequest(f"{where}: document blocks are not supported", where)
        else:
            raise BadRequest(f"{where}: unknown content block type {b.type!r}", where)
    msg: dict[str, Any] = {"role": m.role}
    if len(texts) == 1 and isinstance(texts[0], str):
        msg["content"] = texts[0]
    elif texts:
        msg["content"] = [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if len(msg) > 1:
        out.append(msg)
    return out


def _image_url(block: ContentBlock, where: str) -> str:
    """An image block's source as a chat image URL: base64 data as a data URL, a URL as it is."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise BadRequest(f"{where}: an image block's source must be base64 data (with its media_type) or a url", where)


def _result_text(block: ContentBlock, where: str) -> str:
    if isinstance(block.content, str) or block.content is None:
        return block.content or ""
    parts = []
    for item in block.content:
        if item.get("type") == "text":
            parts.append(str(item.get("text", "")))
        elif item.get("type") == "image":
            raise BadRequest(f"{where}: images in tool results are not supported", where)
    return "\n".join(parts)


def merges_inline_system(server: OpenAIServer) -> bool:
    """Whether the model's chat template refuses a system message after the first turn (Qwen's
    templates do): then a conversation's own system messages join the leading one (found once)."""
    client = server.engine()
    if server.anthropic_merge_system is None:
        try:
            client.tokenizer.apply_chat_template(
                [{"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                 {"role": "system", "content": "t"}, {"role": "user", "content": "t"}],
                add_generation_prompt=False)
            server.anthropic_merge_system = False
        except Exception:
            server.anthropic_merge_system = True
    return server.anthropic_merge_system


# -- the answer as a message ----------------------------------------------------------------------

def stop_reason(finish: str | None, stop: Any, tool_used: bool, tool_complete: bool) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's finish (vLLM's mapping)."""
    if finish == "length":
        return "max_tokens", None
    if finish not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens without those the prefix cache served (those are
    cache_read_input_tokens, present when there were any)."""
    if chat_usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage.get("completion_tokens") or 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        out["input_tokens"] = max(0, out["input_tokens"] - cached)
        out["cache_read_input_tokens"] = cached
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class MessagesAnswer:
    """One admitted Messages request's answer, whole or as Anthropic's stream of events."""

    def __init__(self, gen: ChatGeneration) -> None:
        self.gen = gen
        self.id = "msg_" + gen.id.removeprefix(gen.id_prefix)

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        content: list[dict[str, Any]] = []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        complete = bool(calls)
        for call in calls:
            args = call["function"]["arguments"]
            whole = _is_json(args)              # a call max_tokens cut short: no input (stop_reason says why)
            complete = complete and whole
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(args) if whole else {}})
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls), complete)
        body = {"id": self.id, "type": "message", "role": "assistant",
                "content": content or [{"type": "text", "text": ""}], "model": chat["model"],
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(chat.get("usage"))}
        if chat.get("kv_transfer_params") is not None:
            body["kv_transfer_params"] = chat["kv_transfer_params"]
        return body

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """message_start; per content block content_block_start, its deltas (text_delta,
        thinking_delta then signature_delta, input_json_delta) and content_block_stop;
        message_delta with the stop reason and usage; message_stop."""
        index = -1                      # the open block's index
        kind: str | None = None         # the open block's type
        call_id: str | None = None      # the open tool_use block's call
        ids: dict[int, str] = {}        # tool call index -> its id
        finish, stop, tool_used = None, None, False
        last_args: list[str] = []
        started = False

        def open_block(block: dict[str, Any]) -> list[dict[str, Any]]:
            nonlocal index, kind, call_id
            out = close_block()
            index += 1
            kind, call_id = block["type"], block.get("id")
            return out + [{"type": "content_block_start", "index": index, "content_block": block}]

        def close_block() -> list[dict[str, Any]]:
            nonlocal kind, call_id
            if kind is None:
                return []
            out = []
            if kind == "thinking":
                out.append({"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": uuid.uuid4().hex}})
            out.append({"type": "content_block_stop", "index": index})
            kind = call_id = None
            return out

        async for chunk in self.gen.events():
            if "error" in chunk:
                err = chunk["error"]
                yield {"type": "error", "error": {"type": err.get("type") or error_type(500),
                                                  "message": err.get("message", "")}}
                return
            if not started:
                started = True
                yield {"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "content": [], "model": chunk["model"],
                    "stop_reason": None, "stop_sequence": None, "usage": usage(chunk.get("usage"))}}
            if not chunk["choices"]:                  # the last chunk: the usage
                for event in close_block():
                    yield event
                reason, sequence = stop_reason(finish or "stop", stop, tool_used,
                                               tool_used and _is_json("".join(last_args)))
                yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": usage(chunk.get("usage"))}
                continue
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is not None:
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
            delta = choice.get("delta") or {}
            for field, block in (("reasoning", "thinking"), ("content", "text")):   # the thinking first
                if delta.get(field):
                    if kind != block:
                        for event in open_block({"type": block, block: ""}):
                            yield event
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": f"{block}_delta", block: delta[field]}}
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    ids[call.get("index", 0)] = call["id"]
                    if call_id != call["id"] and fn.get("name") is not None:
                        tool_used, last_args = True, []
                        for event in open_block({"type": "tool_use", "id": call["id"], "name": fn["name"],
                                                 "input": {}}):
                            yield event
                if fn.get("arguments") and call_id is not None and ids.get(call.get("index", 0)) == call_id:
                    last_args.append(fn["arguments"])
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}
        for event in close_block():
            yield event
        yield {"type": "message_stop"}


# -- the endpoints --------------------------------------------------------------------------------

async def create_message(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return anthropic_error(await server.answer(lambda: _create_message(server, request), f"POST {MESSAGES}"))


async def _create_message(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: MessagesRequest = await server.read(request, MessagesRequest)
    chat = server.decode(json_encoder.encode(chat_body(req, merges_inline_system(server),
                                                       server.engine().thinking_budgets)), ChatCompletionRequest)
    gen, stream = await start_chat(server, chat, arrival)
    answer = MessagesAnswer(gen)
    http_trace.serving(c.handle.request_id for c in gen.choices)
    http_trace.mark("receive")
    header_id = request.headers.get("X-Request-Id") or answer.id
    try:
        if stream:
            return await send_events(request, answer.events(), header_id, named=True)
        body = await gen.collect()
        if isinstance(body, web.Response):
            return body
        return web.Response(body=json_encoder.encode(answer.whole(body)), content_type="application/json",
                            headers={"X-Request-Id": header_id})
    finally:
        close_all(gen.choices)


async def count_tokens(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    return anthropic_error(await server.answer(lambda: _count_tokens(server, request), f"POST {COUNT_TOKENS}"))


async def _count_tokens(server: OpenAIServer, request: web.Request) -> web.Response:
    """The prompt's tokens as the chat template renders the request (nothing is generated)."""
    req: CountTokensRequest = await server.read(request, CountTokensRequest)
    chat = server.decode(json_encoder.encode(chat_body(req, merges_inline_system(server))), ChatCompletionRequest)
    gen, _ = await start_chat(server, chat, time.time(), functools.partial(server.submit, render_only=True))
    tokens = sum(len(c.handle.prompt_token_ids) for c in gen.choices)
    return web.Response(body=json_encoder.encode({"input_tokens": tokens,
                                                  "context_management": {"original_input_tokens": tokens}}),
                        content_type="application/json")


def anthropic_error(response: web.StreamResponse) -> web.StreamResponse:
    """An error answer in Anthropic's shape (the OpenAI-shaped one the server made, rewritten)."""
    if response.status < 400 or response.prepared or not isinstance(response, web.Response):
        return response
    try:
        err = json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return response
    body = {"type": "error", "error": {"type": err.get("type") or error_type(response.status),
                                       "message": err.get("message", "")}}
    out = web.Response(status=response.status, body=json_encoder.encode(body), content_type="application/json")
    for name in ("Retry-After", "X-Request-Id"):
        if name in response.headers:
            out.headers[name] = response.headers[name]
    return out
