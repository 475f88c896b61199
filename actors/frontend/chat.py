"""POST /v1/chat/completions: messages (and tools) rendered with the model's chat template, n
choices, plain or streamed (a role chunk per choice first), chat-shaped log-probs, and the tool
calls read out of each choice's text (``tools.py``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from actors.tokenizer.multimodal import extract_images, has_images
from actors.frontend.beam_search import beam_answer
from actors.frontend.fanout import Choice, Submit, submit_choices
from actors.frontend.generation import Answer, Generation
from actors.frontend.logprobs import chat_logprobs, prompt_logprobs_json
from actors.frontend.params import (served_name, cache_salt, chat_messages, check_chat_flags, check_priority,
                                    num_choices, reasoning_kwargs, request_timeout, stream_flags)
from actors.frontend.protocol import BadRequest, ChatCompletionRequest
from actors.frontend.reasoning import ReasoningParser, ReasoningStream
from actors.frontend.streams import RequestOutput
from actors.frontend.structured import NotStructured
from actors.frontend.tool_parsers import ToolCallStream
from actors.frontend.tools import ToolUse, strict_tool_constraint, template_tools, tool_use
from actors.tokenizer.chat import content_to_text

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer


class ChatGeneration(Generation):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, request_id: str, model: str, choices: list[Choice], include_usage: bool,
                 answer: Answer, top_logprobs: int | None, tools: ToolUse | None = None, echo: str = "",
                 prompt_text: str | None = None, reasoning: ReasoningParser | None = None,
                 show_reasoning: bool = True, role: str = "assistant") -> None:
        """``reasoning``: the --reasoning-parser that splits each choice's text into reasoning
        and content (shown as ``reasoning`` unless ``show_reasoning`` is off: include_reasoning).
        ``role``: the answer message's (vLLM's --response-role, or the last message's when the
        request did not add the generation prompt)."""
        super().__init__(request_id, model, choices, include_usage, answer)
        self.role = role
        self.prompt_text = prompt_text   # return_prompt_text: in the answer, or the stream's first chunk
        self.reasoning = reasoning
        self.show_reasoning = show_reasoning
        self.token_text = answer.text_of
        self.echo = echo                 # shown before each choice's content (vLLM's echo)
        self.top = top_logprobs          # None: no log-probs asked for
        self.tools = tools               # None: the text is all content
        for c in choices:
            # log-prob entries so far (non-streamed); the tool calls read so far; the reasoning split
            c.state = ChoiceState([], tools.stream() if tools is not None else None,
                                  reasoning.stream() if reasoning is not None else None)

    def _logprobs(self, out: RequestOutput) -> list[dict[str, Any]] | None:
        if self.top is None:
            return None
        return chat_logprobs(out.logprobs, self.token_text, self.top)

    def start_chunks(self) -> list[dict]:
        usage = {"usage": self.usage()} if self.answer.continuous_usage else {}    # every chunk, the first too
        chunks = [self.chunk([{"index": c.index, "delta": {"role": self.role, "content": ""},
                               "logprobs": None, "finish_reason": None}], **usage,
                             **({"prompt_token_ids": c.handle.prompt_token_ids} if self.answer.return_token_ids else {}))
                  for c in self.choices]
        if self.prompt_text is not None:
            chunks[0]["prompt_text"] = self.prompt_text
        if self.echo:
            chunks += [self.chunk([{"index": c.index, "delta": {"content": self.echo}, "logprobs": None,
                                    "finish_reason": None}]) for c in self.choices]
        return chunks

    def _split(self, c: Choice, out: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) of this output's text (all content without a reasoning parser)."""
        split = c.state.reasoning
        if split is None:
            return "", out.text
        reasoning, content = split.feed(out.text, out.finished)
        c.state.reasoning_text.append(reasoning)
        return reasoning, content

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        lp = self._logprobs(out)
        reasoning, text = self._split(c, out)
        delta: dict[str, Any] = {"content": text}
        calls = c.state.calls
        if calls is not None:
            content, entries = calls.feed(text, out.finished)
            delta = {"content": content} if content else {}
            if entries:
                delta["tool_calls"] = entries
        elif c.state.reasoning is not None and not text:
            delta = {}
        if reasoning and self.show_reasoning:
            delta = {"reasoning": reasoning, **delta}
        if not delta.get("content") and "tool_calls" not in delta and "reasoning" not in delta and not lp:
            return None
        return {"index": c.index, "delta": delta,
                "logprobs": None if lp is None else {"content": lp}, "finish_reason": None}

    def finish(self, c: Choice, out: RequestOutput) -> dict:
        return {"index": c.index, "delta": {}, "logprobs": None,
                "finish_reason": self._finish_reason(c, out), "stop_reason": out.stop_reason}

    def _finish_reason(self, c: Choice, out: RequestOutput) -> str | None:
        """vLLM's rule: "stop" becomes "tool_calls" when "auto" or "required" made calls (a
        named function's call finishes as "stop", as OpenAI's does)."""
        calls = c.state.calls
        if (out.finish_reason == "stop" and calls is not None and calls.reading.calls
                and self.tools is not None and self.tools.finish_as_tool_calls):
            return "tool_calls"
        return out.finish_reason

    def observe(self, c: Choice, out: RequestOutput) -> None:
        _, text = self._split(c, out)
        c.text.append(text)
        if c.state.calls is not None:
            c.state.calls.feed(text, out.finished)
        lp = self._logprobs(out)
        if lp:
            c.state.logprobs.extend(lp)

    def final(self, c: Choice) -> dict:
        last = c.last
        message: dict[str, Any] = {"role": self.role, "content": "".join(c.text)}
        calls = c.state.calls
        if calls is not None:
            made = calls.message_calls()
            content = calls.reading.content
            message = {"role": self.role, "content": None if made and not content.strip() else content,
                       "tool_calls": made}
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        if c.state.reasoning is not None:
            reasoning = "".join(c.state.reasoning_text)
            if calls is None and not message["content"] and c.state.reasoning.reasoned:
                message["content"] = None                # all of it was reasoning
            if self.show_reasoning:
                message["reasoning"] = reasoning or None
        return {"index": c.index, "message": message,
                "logprobs": None if self.top is None else {"content": c.state.logprobs},
                "finish_reason": self._finish_reason(c, last), "stop_reason": last.stop_reason}


    def choice_extras(self, c: Choice) -> dict[str, Any]:
        return {"token_ids": c.token_ids} if self.answer.return_token_ids else {}

    def body_extras(self) -> dict[str, Any]:
        """The prompt's log-probs and token ids, once for all choices (one prompt), as vLLM's."""
        first = self.choices[0]
        extras: dict[str, Any] = {}
        if self.answer.prompt_logprobs:
            extras["prompt_logprobs"] = prompt_logprobs_json(first.prompt_logprobs, self.token_text)
        if self.answer.return_token_ids:
            extras["prompt_token_ids"] = first.handle.prompt_token_ids
        if self.prompt_text is not None:
            extras["prompt_text"] = self.prompt_text
        return extras


@dataclass(slots=True)
class ChoiceState:
    logprobs: list[dict[str, Any]]
    calls: ToolCallStream | None
    reasoning: ReasoningStream | None = None
    reasoning_text: list[str] = field(default_factory=list)


async def chat_completions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: ChatCompletionRequest = await server.read(request, ChatCompletionRequest)
    gen, stream = await start_chat(server, req, arrival)
    return await gen.respond(request, stream)


async def start_chat(server: OpenAIServer, req: ChatCompletionRequest, arrival: float,
                     submit: Submit | None = None) -> tuple[ChatGeneration, bool]:
    """Check a decoded chat request and admit its choices; the generation answers it (whole or
    streamed) and whether the client asked for a stream. The batch runner answers its lines
    through this too. ``submit``: what admits each choice (server.submit; the render endpoint's
    renders it only)."""
    client = server.engine()
    n = num_choices(req)
    stream, include_usage = stream_flags(req, server.options.force_include_usage)
    messages = chat_messages(req.messages)
    add_generation_prompt = req.add_generation_prompt is not False
    continue_final_message = bool(req.continue_final_message)
    check_chat_flags(add_generation_prompt, continue_final_message)
    params = req.to_sampling_params(server.vocab_size, client.max_model_len)
    try:
        tools = tool_use(req, server.options.tool_call_parser if server.options.enable_auto_tool_choice else None)
    except NotStructured as exc:
        raise BadRequest(str(exc), exc.param) from None
    if ((tools is not None and tools.parser.keeps_special_tokens)
            or (server.reasoning_parser is not None and server.reasoning_parser.keeps_special_tokens)):
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    template_kwargs = server.template_kwargs(req.chat_template_kwargs)
    if req.tools:
        template_kwargs = {"tools": template_tools(req, server.options.exclude_tools_when_tool_choice_none),
                           **(template_kwargs or {})}
    if req.documents is not None:
        template_kwargs = {"documents": req.documents, **(template_kwargs or {})}
    if req.reasoning_effort is not None:
        template_kwargs = reasoning_kwargs(req.reasoning_effort, template_kwargs)
    if req.chat_template is not None and not server.options.trust_request_chat_template:
        raise BadRequest("Chat template is passed with request, but --trust-request-chat-template is not set. "
                         "Refused request with untrusted chat template.", "chat_template")
    priority = check_priority(req, client.config.scheduler.policy)
    if req.use_beam_search:
        if req.tools:
            raise BadRequest("tools cannot be combined with beam search", "tools")
        if has_images(messages):
            raise BadRequest("beam search is not supported with image, video or audio input (its later steps send token ids)",
                             "use_beam_search")
        job = {"messages": messages, "add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message, "chat_template_kwargs": template_kwargs,
               "priority": priority, "cache_salt": cache_salt(req), "lora_request": client.lora_request_for(req.model),
               "chat_template": req.chat_template, "add_special_tokens": bool(req.add_special_tokens)}
        return beam_answer(server, req, params, n, [job]), False      # type: ignore[return-value]
    if server.reasoning_parser is not None and params.structured_outputs is not None:
        param = req.constraint().param
        raise BadRequest(f"{param} cannot be combined with --reasoning-parser here (the grammar would constrain "
                         "the reasoning as well as the answer)", param)
    await server.check_grammar(req, params)
    if params.structured_outputs is None and server.reasoning_parser is None:
        held = strict_tool_constraint(req, tools, server.options.tool_strict_level)
        if held is not None:            # --tool-strict-level: "auto" calls held to the parser's format
            await server.check_grammar_spec(held.params, held.param)
            params = msgspec.structs.replace(params, structured_outputs=held.params)
    answer = server.answer_of(req)          # checked before anything is admitted (a 400 leaves nothing open)
    rid = client.new_request_id()
    choices = await submit_choices(
        submit or server.submit, rid, params, n, None, messages=messages,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        chat_template_kwargs=template_kwargs, priority=priority, arrival_time=arrival,
        cache_salt=cache_salt(req), timeout_s=request_timeout(req),
        lora_request=client.lora_request_for(req.model), truncation_side=req.truncation_side,
        chat_template=req.chat_template, add_special_tokens=bool(req.add_special_tokens),
        stream_interval=req.stream_interval, mm_processor_kwargs=req.mm_processor_kwargs,
        media_io_kwargs=req.media_io_kwargs)
    last = messages[-1]
    echo = content_to_text(last.get("content")) if req.echo and last["role"] == "assistant" else ""
    prompt_text = None
    if req.return_prompt_text:        # vLLM's: the prompt as the template rendered it (it rendered already)
        shown = extract_images(messages)[0] if has_images(messages) else messages    # images as placeholders
        prompt_text = client.tokenizer.apply_chat_template(
            shown, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=req.chat_template, **(template_kwargs or {}))
    role = server.options.response_role if add_generation_prompt else last["role"]
    gen = ChatGeneration(rid, served_name(client, req.model), choices, include_usage, answer,
                         params.num_logprobs, tools, echo, prompt_text, server.reasoning_parser,
                         req.include_reasoning is not False, role)
    return gen, stream
