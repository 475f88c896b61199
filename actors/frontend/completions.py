"""POST /v1/completions: one or several prompts (text or token ids), n choices each (index =
prompt_index * n + i), echo, completions-shaped log-probs (with echo, the prompt's tokens come
first and the very first one has a null log-prob)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from actors.frontend.beam_search import beam_answer
from actors.frontend.fanout import Choice, submit_choices
from actors.frontend.generation import Answer, Generation
from actors.frontend.logprobs import CompletionLogprobs, merge_completion_logprobs, prompt_logprobs_json
from actors.frontend.params import (served_name, MAX_CHOICES, PromptInput, cache_salt, check_priority,
                                    completion_prompts, num_choices, request_timeout, stream_flags)
from actors.frontend.protocol import BadRequest, CompletionRequest
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

@dataclass(slots=True)
class _ChoiceState:
    builder: CompletionLogprobs | None
    prompt_text: str                      # echoed before the first delta ("" without echo)
    echoed: bool = False
    logprob_parts: list[dict] = field(default_factory=list)


class CompletionGeneration(Generation):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, request_id: str, model: str, choices: list[Choice], include_usage: bool,
                 answer: Answer, logprobs: int | None, echo_texts: list[str] | None) -> None:
        super().__init__(request_id, model, choices, include_usage, answer)
        self.echo = echo_texts is not None
        for c in choices:
            builder = None if logprobs is None else CompletionLogprobs(answer.text_of, logprobs)
            c.state = _ChoiceState(builder, echo_texts[c.prompt_index] if echo_texts else "")

    def _delta(self, c: Choice, out: RequestOutput) -> tuple[str, dict | None] | None:
        """(text, log-probs) newly shown by ``out``; None while an echo waits for the prompt's
        log-probs to be complete (they come with the prompt's prefill chunks)."""
        st: _ChoiceState = c.state
        if self.echo and not st.echoed and not (out.token_ids or out.finished):
            return None
        text, lp = out.text, None
        if st.builder is not None:
            lp = st.builder.empty()
            if self.echo and not st.echoed:
                st.builder.first_prompt_token(lp, c.handle.prompt_token_ids[0])
                st.builder.add(lp, c.prompt_logprobs)
            st.builder.add(lp, out.logprobs)
        if self.echo and not st.echoed:
            text = st.prompt_text + text
        st.echoed = True
        return text, lp

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        shown = self._delta(c, out)
        if shown is None or not (shown[0] or (shown[1] and shown[1]["tokens"])):
            return None
        return {"index": c.index, "text": shown[0], "logprobs": shown[1], "finish_reason": None}

    def finish(self, c: Choice, out: RequestOutput) -> dict:
        return {"index": c.index, "text": "", "logprobs": None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def observe(self, c: Choice, out: RequestOutput) -> None:
        shown = self._delta(c, out)
        if shown is not None:
            c.text.append(shown[0])
            if shown[1] is not None:
                c.state.logprob_parts.append(shown[1])

    def final(self, c: Choice) -> dict:
        lp = merge_completion_logprobs(c.state.logprob_parts) if c.state.builder is not None else None
        if c.state.builder is not None and lp is None:
            lp = c.state.builder.empty()
        return {"index": c.index, "text": "".join(c.text), "logprobs": lp,
                "finish_reason": c.last.finish_reason, "stop_reason": c.last.stop_reason}

    def choice_extras(self, c: Choice) -> dict:
        extras: dict = {}
        if self.answer.prompt_logprobs:
            extras["prompt_logprobs"] = prompt_logprobs_json(c.prompt_logprobs, self.answer.text_of)
        if self.answer.return_token_ids:
            extras.update(prompt_token_ids=c.handle.prompt_token_ids, token_ids=c.token_ids)
        return extras

    def prompt_ids_in_choice(self) -> bool:
        return True


async def completions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: CompletionRequest = await server.read(request, CompletionRequest)
    gen, stream = await start_completion(server, req, arrival)
    return await gen.respond(request, stream)


async def start_completion(server: OpenAIServer, req: CompletionRequest,
                           arrival: float) -> tuple[CompletionGeneration, bool]:
    """Check a decoded completion request and admit its choices (see ``chat.start_chat``)."""
    client = server.engine()
    n = num_choices(req)
    stream, include_usage = stream_flags(req)
    prompts = completion_prompts(req.prompt, server.vocab_size)
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices "
                         "per request", "n" if n > 1 else "prompt")
    params = req.to_sampling_params(server.vocab_size, client.max_model_len)
    echo = bool(req.echo)
    priority = check_priority(req, client.config.scheduler.policy)
    if req.use_beam_search:
        jobs = [{"prompt": p.text, "prompt_token_ids": p.token_ids, "priority": priority,
                 "add_special_tokens": req.add_special_tokens is not False, "cache_salt": cache_salt(req),
                 "lora_request": client.lora_request_for(req.model)} for p in prompts]
        echo_texts = [_prompt_text(client.tokenizer, p) for p in prompts] if echo else None
        return beam_answer(server, req, params, n, jobs, echo_texts), False
    await server.check_grammar(req, params)
    rid = client.new_request_id()
    choices = await submit_choices(
        server.submit, rid, params, n, prompts, priority=priority,
        arrival_time=arrival, add_special_tokens=req.add_special_tokens is not False,
        cache_salt=cache_salt(req), timeout_s=request_timeout(req),
        lora_request=client.lora_request_for(req.model), truncation_side=req.truncation_side or "left",
        stream_interval=req.stream_interval)
    echo_texts = [_prompt_text(client.tokenizer, p) for p in prompts] if echo else None
    gen = CompletionGeneration(rid, served_name(client, req.model), choices, include_usage, server.answer_of(req),
                               params.logprobs, echo_texts)
    return gen, stream


def _prompt_text(tokenizer, prompt: PromptInput) -> str:
    if prompt.text is not None:
        return prompt.text
    return tokenizer.decode(prompt.token_ids or [], skip_special_tokens=False)
