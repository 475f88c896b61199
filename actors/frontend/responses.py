"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API as vLLM serves it
(text and function tools, no reasoning items). A request is rendered as a chat completion
(``instructions`` as the system message, then a previous response's conversation, then the
``input`` items) and answered by the chat endpoint's machinery; the answer is reshaped into a
``response`` object (output items: the assistant ``message`` with its ``output_text``, then one
``function_call`` per tool call) or, streamed, into the Responses events (``response.created``,
``response.output_text.delta``, ..., ``response.completed``), each named on its ``event:`` line.

Responses are stored (``store``, true by default as in OpenAI's API) in a bounded in-memory
store (a count and a byte budget), newest kept: GET returns one, and ``previous_response_id`` continues its conversation."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

import msgspec
from aiohttp import web

from actors.frontend import http_trace
from actors.frontend.chat import ChatGeneration, start_chat
from actors.frontend.errors import json_encoder, not_found
from actors.frontend.fanout import close_all
from actors.frontend.protocol import BadRequest, ChatCompletionRequest, require
from actors.frontend.sse import send_events

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

MAX_STORED = 1024                                  # responses kept for GET and previous_response_id
MAX_STORED_BYTES = 64 << 20                        # and at most this much of them (their JSON)
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the ``include`` value that asks for log-probs
# fields a Responses request shares with a chat completion request (vLLM's extensions among them)
SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
          "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt", "user",
          "parallel_tool_calls", "vllm_xargs", "chat_template_kwargs", "structured_outputs", "watermarking")
# a chat field's name as the Responses request calls it, in error messages
RENAMED = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
           ("messages", "input"))
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None              # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None       # {"type": "function", "name", "description", "parameters", "strict"}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None                   # "disabled" only
    background: bool | None = None                  # not supported
    reasoning: dict[str, Any] | None = None         # its effort: the chat's reasoning_effort (the template's)
    # OpenAI's, about its platform (billing, its own caches, abuse ids, built-in tool calls, the
    # stream's obfuscation): accepted and without effect here, as vLLM accepts them
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    session_id: str | None = None                   # vLLM's: names the conversation in its KV events; none here
    include_reasoning: bool | None = True           # vLLM's: with a reasoning parser (none here, so none to include)
    # vLLM 0.32's others, refused by name when set (``check``)
    enable_response_messages: bool | None = False
    previous_input_messages: list[Any] | None = None
    prompt: dict[str, Any] | None = None            # OpenAI's stored prompt templates
    kv_transfer_params: dict[str, Any] | None = None
    watermarking: bool | None = None
    ec_transfer_params: dict[str, Any] | None = None
    mm_payload: Any = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_mm_kwargs: bool | None = False
    stream_options: dict[str, Any] | None = None
    # vLLM's extensions, as in chat completions
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    vllm_xargs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def check(self) -> None:
        for name, why in (("enable_response_messages", "the Harmony message lists of gpt-oss models"),
                          ("previous_input_messages", "the Harmony message lists of gpt-oss models"),
                          ("prompt", "prompt templates stored on OpenAI's platform"),
                          ("kv_transfer_params", "prefill/decode disaggregation on /v1/responses (use the chat or "
                                                 "completions endpoint)"),
                          ("ec_transfer_params", "multimodal inputs"),
                          ("mm_payload", "multimodal inputs"), ("media_io_kwargs", "multimodal inputs"),
                          ("mm_processor_kwargs", "multimodal inputs")):
            require(not getattr(self, name), f"{name} is not supported here ({why})", name)
        require(not self.background, "background responses are not supported (each request is answered "
                "while it runs)", "background")
        require(self.truncation in (None, "disabled"), f"truncation must be \"disabled\", got {self.truncation!r}",
                "truncation")
        require(not any(v is not None for k, v in (self.reasoning or {}).items() if k != "effort"),
                "reasoning options other than effort (summary) are not supported on /v1/responses", "reasoning")
        other = [i for i in self.include or [] if i != LOGPROBS_INCLUDE]
        require(not other, f"include supports only {LOGPROBS_INCLUDE!r}, got {other}", "include")
        require(bool(self.input), "input must not be empty", "input")

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request this one is: ``history`` (a previous response's
        conversation) between the instructions and the input."""
        body: dict[str, Any] = {k: getattr(self, k) for k in SHARED if getattr(self, k) is not None}
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body["messages"] = system + history + self.input_messages()
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.stream:
            body["stream"] = True
        if self.tools is not None:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None and fmt.get("type") != "text":
            body["response_format"] = _response_format(fmt)
        if (self.reasoning or {}).get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]      # gpt-oss's template reads it
        if LOGPROBS_INCLUDE in (self.include or []):
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        return body

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: messages (text content), ``function_call`` items as an
        assistant's tool calls, ``function_call_output`` items as tool messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item.get("role"), "content": _text(i, item.get("content"))})
            elif kind == "function_call":
                call = {"id": _field(i, item, "call_id"), "type": "function",
                        "function": {"name": _field(i, item, "name"), "arguments": _field(i, item, "arguments")}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": _field(i, item, "call_id"),
                            "content": output if isinstance(output, str) else _text(i, output)})
            else:
                raise BadRequest(f"input[{i}] is a {kind!r} item: supported are messages, function_call and "
                                 "function_call_output", f"input[{i}].type")
        return out


def _field(i: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    require(isinstance(value, str), f"input[{i}].{name} must be a string", f"input[{i}].{name}")
    return value


def _text(i: int, content: Any) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or its text parts (tokenizer.chat joins
    them, or keeps them as parts, by the chat template's content format) and its
    ``input_image`` parts as chat ``image_url`` parts (a model that takes images reads them)."""
    if isinstance(content, str):
        return content
    require(isinstance(content, list) and all(isinstance(p, dict) for p in content),
            f"input[{i}].content must be a string or a list of content parts", f"input[{i}].content")
    kinds = [p.get("type") for p in content if p.get("type") not in (*TEXT_PARTS, "input_image")]
    require(not kinds, f"input[{i}].content: only text and input_image parts are supported "
            f"({', '.join(TEXT_PARTS)}, input_image), got {kinds}", f"input[{i}].content")
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if p.get("type") != "input_image":
            parts.append({"type": "text", "text": str(p.get("text", ""))})
            continue
        url = p.get("image_url")
        require(isinstance(url, str) and bool(url), "an input_image part needs an image_url (a URL or a data URL; "
                "file_id is not supported)", f"input[{i}].content[{j}].image_url")
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _chat_tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    require(tool.get("type") == "function", f"tools[{i}]: only function tools are supported, got "
            f"{tool.get('type')!r}", f"tools[{i}].type")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if tool.get(k) is not None}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    require(choice.get("type") == "function" and isinstance(choice.get("name"), str),
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


def renamed(exc: BadRequest) -> BadRequest:
    """A chat request's error in the Responses request's own field names."""
    message, param = str(exc), exc.param
    for chat, ours in RENAMED:
        message = message.replace(chat, ours)
        if param is not None and param.startswith(chat):
            param = ours + param[len(chat):]
    return BadRequest(message, param)


@dataclass(slots=True)
class Stored:
    body: dict[str, Any]                      # the response object
    conversation: list[dict[str, Any]]        # its input as chat messages (instructions left out)
    reply: list[dict[str, Any]]               # its output as chat messages


class ResponseStore:
    """The newest responses by id: at most ``capacity`` of them and ``max_bytes`` of their JSON
    (a response larger than that alone is not kept)."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, tuple[Stored, int]] = OrderedDict()

    def put(self, rid: str, item: Stored) -> None:
        size = len(json_encoder.encode([item.body, item.conversation, item.reply]))
        old = self._items.pop(rid, None)
        if old is not None:
            self.nbytes -= old[1]
        if size > self.max_bytes:
            return
        self._items[rid] = (item, size)
        self.nbytes += size
        while len(self._items) > self.capacity or self.nbytes > self.max_bytes:
            self.nbytes -= self._items.popitem(last=False)[1][1]

    def get(self, rid: str) -> Stored | None:
        kept = self._items.get(rid)
        return None if kept is None else kept[0]

    def delete(self, rid: str) -> bool:
        kept = self._items.pop(rid, None)
        if kept is not None:
            self.nbytes -= kept[1]
        return kept is not None

    def __len__(self) -> int:
        return len(self._items)


class ResponseAnswer:
    """One admitted request's answer in the Responses shape, whole or as events."""

    def __init__(self, server: OpenAIServer, req: ResponsesRequest, gen: ChatGeneration,
                 conversation: list[dict[str, Any]]) -> None:
        self.server, self.req, self.gen = server, req, gen
        self.conversation = conversation
        self._to_keep: Stored | None = None
        self.id = "resp_" + gen.id.removeprefix(gen.id_prefix)
        self.created = gen.created

    def body(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None) -> dict[str, Any]:
        req = self.req
        usage = None
        if status != "in_progress":
            u = self.gen.usage()
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.gen.model,
                "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": None,
                "store": req.store is not False, "temperature": req.temperature,
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "top_p": req.top_p,
                "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
                **self._metrics(status)}

    def _metrics(self, status: str) -> dict[str, Any]:
        """vLLM's: a finished response's timings (--enable-per-request-metrics)."""
        metrics = self.gen.metrics() if status != "in_progress" and self.gen.answer.timings else None
        return {"metrics": {**metrics, "speculative_decoding": None}} if metrics is not None else {}

    def _keep(self, body: dict[str, Any], message: dict[str, Any]) -> None:
        """Keep the response (``store``) once ``stored`` is awaited."""
        if self.req.store is not False:
            self._to_keep = Stored(body, self.conversation, [message])

    async def stored(self) -> None:
        """The response kept (with several API servers, by API server 0) before the client hears
        of it: a GET through any server finds it."""
        if self._to_keep is not None:
            await self.server.keep_response(self.id, self._to_keep)
            self._to_keep = None

    async def complete(self) -> web.Response:
        """The whole response object once generated, or the error response in its place."""
        chat = await self.gen.collect()
        if isinstance(chat, web.Response):
            return chat
        body = self.whole(chat)
        await self.stored()
        return web.Response(body=json_encoder.encode(body), content_type="application/json")

    async def whole_response(self) -> web.Response:
        """``complete`` away from HTTP (the batch runner's): the request ends with it."""
        try:
            return await self.complete()
        finally:
            close_all(self.gen.choices)

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response object of a chat completion answer (one choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning"):              # --reasoning-parser: the thinking comes first
            output.append(self._reasoning_item(message["reasoning"]))
        if message.get("content"):
            output.append(self._message_item(message["content"], (choice.get("logprobs") or {}).get("content")))
        for call in message.get("tool_calls") or []:
            output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
        body = self.body(_status(choice["finish_reason"]), output, choice["finish_reason"])
        self._keep(body, message)
        return body

    def _reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": "rs_" + self.id.removeprefix("resp_"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": None}

    def _message_item(self, text: str, logprobs: list[dict] | None, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": "msg_" + self.id.removeprefix("resp_"), "status": status,
                "role": "assistant", "content": [] if status == "in_progress" else [_text_part(text, logprobs)]}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The Responses stream of the chat generation's chunks."""
        seq = 0

        def ev(kind: str, **fields: Any) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq - 1, **fields}

        skeleton = self.body("in_progress", [])
        yield ev("response.created", response=skeleton)
        yield ev("response.in_progress", response=skeleton)
        item_id = "msg_" + self.id.removeprefix("resp_")
        text: list[str] = []
        logprobs: list[dict] = []
        calls: dict[int, dict[str, str]] = {}
        opened, finish = False, None
        output: list[dict[str, Any]] = []
        thinking: list[str] | None = None          # --reasoning-parser: the reasoning item's text so far
        reasoning_id = "rs_" + self.id.removeprefix("resp_")

        def close_reasoning() -> Iterator[dict[str, Any]]:
            """The reasoning item's last events (it is output item 0, before the message)."""
            nonlocal thinking
            if thinking is None:
                return
            done = "".join(thinking)
            thinking = None
            yield ev("response.reasoning_text.done", item_id=reasoning_id, output_index=0, content_index=0,
                     text=done)
            item = self._reasoning_item(done)
            yield ev("response.output_item.done", output_index=0, item=item)
            output.append(item)

        async for chunk in self.gen.events():
            if "error" in chunk:
                err = chunk["error"]
                yield ev("error", code=str(err.get("code")), message=err.get("message"), param=err.get("param"))
                return
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                lp = (choice.get("logprobs") or {}).get("content") or []
                if delta.get("reasoning"):
                    if thinking is None and not output:
                        thinking = []
                        yield ev("response.output_item.added", output_index=0,
                                 item={**self._reasoning_item(""), "content": [], "status": "in_progress"})
                    if thinking is not None:
                        thinking.append(delta["reasoning"])
                        yield ev("response.reasoning_text.delta", item_id=reasoning_id, output_index=0,
                                 content_index=0, delta=delta["reasoning"])
                if delta.get("content") or lp:
                    if not opened:
                        for event in close_reasoning():
                            yield event
                        opened = True
                        yield ev("response.output_item.added", output_index=len(output),
                                 item=self._message_item("", None, "in_progress"))
                        yield ev("response.content_part.added", item_id=item_id, output_index=len(output),
                                 content_index=0, part=_text_part("", []))
                    text.append(delta.get("content") or "")
                    logprobs.extend(lp)
                    yield ev("response.output_text.delta", item_id=item_id, output_index=len(output), content_index=0,
                             delta=delta.get("content") or "", logprobs=lp)
                for tc in delta.get("tool_calls") or []:
                    call = calls.setdefault(tc.get("index", len(calls)), {"id": "", "name": "", "arguments": ""})
                    fn = tc.get("function") or {}
                    call["id"] = tc.get("id") or call["id"]
                    call["name"] = fn.get("name") or call["name"]
                    call["arguments"] += fn.get("arguments") or ""
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
        for event in close_reasoning():
            yield event
        content = "".join(text)
        if opened:
            index = len(output)
            part = _text_part(content, logprobs if self.gen.top is not None else None)
            yield ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=content,
                     logprobs=[])
            yield ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
            item = self._message_item(content, part.get("logprobs"))
            yield ev("response.output_item.done", output_index=index, item=item)
            output.append(item)
        for _, call in sorted(calls.items()):
            index = len(output)
            item = _call_item(call["id"], call["name"], call["arguments"])
            yield ev("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=call["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     arguments=call["arguments"])
            yield ev("response.output_item.done", output_index=index, item=item)
            output.append(item)
        status = _status(finish)
        body = self.body(status, output, finish)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for _, c in sorted(calls.items())]
        self._keep(body, message)
        await self.stored()
        yield ev("response.incomplete" if status == "incomplete" else "response.completed", response=body)


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled", "error": "failed"}.get(finish_reason or "", "completed")


def _text_part(text: str, logprobs: list[dict] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


async def create_response(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: ResponsesRequest = await server.read(request, ResponsesRequest)
    answer = await start_response(server, req, arrival)
    gen = answer.gen
    http_trace.serving(c.handle.request_id for c in gen.choices)
    http_trace.mark("receive")
    header_id = request.headers.get("X-Request-Id") or answer.id
    try:
        if req.stream:
            return await send_events(request, answer.events(), header_id, named=True)
        response = await answer.complete()
        response.headers["X-Request-Id"] = header_id
        return response
    finally:
        close_all(gen.choices)


async def start_response(server: OpenAIServer, req: ResponsesRequest, arrival: float) -> ResponseAnswer:
    """Check a decoded Responses request and admit it as a chat completion (the batch runner
    answers its lines through this too)."""
    req.check()
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prior = await server.stored_response(req.previous_response_id)
        if prior is None:
            raise not_found(f"Previous response with id '{req.previous_response_id}' not found.",
                            "previous_response_id")
        history = prior.conversation + prior.reply
    try:
        chat_req = server.decode(json_encoder.encode(req.chat_body(history)), ChatCompletionRequest)
        gen, _ = await start_chat(server, chat_req, arrival)
    except BadRequest as exc:
        raise renamed(exc) from None
    return ResponseAnswer(server, req, gen, history + req.input_messages())


async def retrieve_response(server: OpenAIServer, request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    stored = await server.stored_response(rid)
    if stored is None:
        raise not_found(f"Response with id '{rid}' not found.", "response_id")
    return web.Response(body=json_encoder.encode(stored.body), content_type="application/json")


async def delete_response(server: OpenAIServer, request: web.Request) -> web.Response:
    """OpenAI's DELETE: the stored response is forgotten (a later previous_response_id naming it is a 404)."""
    rid = request.match_info["response_id"]
    if not await server.forget_response(rid):
        raise not_found(f"Response with id '{rid}' not found.", "response_id")
    return web.Response(body=json_encoder.encode({"id": rid, "object": "response", "deleted": True}),
                        content_type="application/json")


async def cancel_response(server: OpenAIServer, request: web.Request) -> web.Response:
    """Only a background response can be cancelled, and this server runs none."""
    rid = request.match_info["response_id"]
    if await server.stored_response(rid) is None:
        raise not_found(f"Response with id '{rid}' not found.", "response_id")
    raise BadRequest("Only background responses can be cancelled (this server answers each request while it "
                     "runs).", "response_id")
