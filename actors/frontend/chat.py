"""POST /v1/chat/completions: messages rendered with the model's chat template, n choices,
plain or streamed (a role chunk per choice first), chat-shaped log-probs."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from actors.frontend.fanout import Choice, submit_choices
from actors.frontend.generation import Generation
from actors.frontend.logprobs import TokenText, chat_logprobs
from actors.frontend.params import (cache_salt, chat_messages, check_chat_flags, check_priority,
                                    num_choices, request_timeout, stream_flags)
from actors.frontend.protocol import ChatCompletionRequest
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer


class ChatGeneration(Generation):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, request_id: str, model: str, choices: list[Choice], include_usage: bool,
                 token_text: TokenText, top_logprobs: int | None) -> None:
        super().__init__(request_id, model, choices, include_usage)
        self.token_text = token_text
        self.top = top_logprobs          # None: no log-probs asked for
        for c in choices:
            c.state = []                 # log-prob entries so far (non-streamed)

    def _logprobs(self, out: RequestOutput) -> list[dict[str, Any]] | None:
        if self.top is None:
            return None
        return chat_logprobs(out.logprobs, self.token_text, self.top)

    def start_chunks(self) -> list[dict]:
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}]) for c in self.choices]

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        lp = self._logprobs(out)
        if not out.text and not lp:
            return None
        return {"index": c.index, "delta": {"content": out.text},
                "logprobs": None if lp is None else {"content": lp}, "finish_reason": None}

    def finish(self, c: Choice, out: RequestOutput) -> dict:
        return {"index": c.index, "delta": {}, "logprobs": None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def observe(self, c: Choice, out: RequestOutput) -> None:
        c.text.append(out.text)
        lp = self._logprobs(out)
        if lp:
            c.state.extend(lp)

    def final(self, c: Choice) -> dict:
        last = c.last
        return {"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": None if self.top is None else {"content": c.state},
                "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}


async def chat_completions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: ChatCompletionRequest = await server.read(request, ChatCompletionRequest)
    client = server.engine()
    n = num_choices(req)
    stream, include_usage = stream_flags(req)
    messages = chat_messages(req.messages)
    add_generation_prompt = req.add_generation_prompt is not False
    continue_final_message = bool(req.continue_final_message)
    check_chat_flags(add_generation_prompt, continue_final_message)
    params = req.to_sampling_params(server.vocab_size, client.max_model_len)
    await server.check_grammar(req, params)
    priority = check_priority(req, client.config.scheduler.policy)
    rid = client.new_request_id()
    choices = await submit_choices(
        server.submit, rid, params, n, None, messages=messages,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs, priority=priority, arrival_time=arrival,
        cache_salt=cache_salt(req), timeout_s=request_timeout(req))
    gen = ChatGeneration(rid, client.model_name, choices, include_usage, server.token_text,
                         params.logprobs)
    return await gen.respond(request, stream)
