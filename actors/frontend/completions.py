"""POST /v1/completions: one or several prompts (text or token ids), n choices each (index =
prompt_index * n + i), echo, completions-shaped log-probs (with echo, the prompt's tokens come
first and the very first one has a null log-prob)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from actors.frontend.beam_search import beam_answer
from actors.frontend.fanout import Choice, Submit, submit_choices
from actors.frontend.generation import Answer, Generation
from actors.frontend.logprobs import CompletionLogprobs, merge_completion_logprobs, prompt_logprobs_json
from actors.frontend.params import (served_name, MAX_CHOICES, PromptInput, cache_salt, check_priority,
                                    completion_prompts, num_choices, request_timeout, stream_flags)
from actors.tokenizer.prompt_embeds import ENABLE_ERROR, check_hidden_size, completion_embeds
from actors.frontend.protocol import MAX_N, BadRequest, CompletionRequest, require
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

@dataclass(slots=True)
class _ChoiceState:
    builder: CompletionLogprobs | None
    prompt_text: str                      # echoed before the first delta ("" without echo)
    echoed: bool = False
    logprob_parts: list[dict] = field(default_factory=list)
    logprob_sum: float = 0.0              # of the sampled tokens (best_of ranks the choices by its mean)
    num_sampled: int = 0


class CompletionGeneration(Generation):
    object_name = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, request_id: str, model: str, choices: list[Choice], include_usage: bool,
                 answer: Answer, logprobs: int | None, echo_texts: list[str] | None,
                 keep: int | None = None, echo_only: bool = False) -> None:
        """``keep``: best_of, the choices per prompt to return, the most likely first (the
        choices carry their sampled tokens' log-probs for that). ``echo_only``: each choice's
        text is its prompt alone (the token computed after it is not shown)."""
        super().__init__(request_id, model, choices, include_usage, answer)
        self.echo = echo_texts is not None
        self.echo_only = echo_only
        self.keep = keep
        for c in choices:
            builder = None if logprobs is None else CompletionLogprobs(answer.text_of, logprobs)
            c.state = _ChoiceState(builder, echo_texts[c.prompt_index] if echo_texts else "")

    def _delta(self, c: Choice, out: RequestOutput) -> tuple[str, dict | None] | None:
        """(text, log-probs) newly shown by ``out``; None while an echo waits for the prompt's
        log-probs to be complete (they come with the prompt's prefill chunks)."""
        st: _ChoiceState = c.state
        if self.echo and not st.echoed and not (out.token_ids or out.finished):
            return None
        if self.echo_only and st.echoed:
            return None
        text, lp = ("" if self.echo_only else out.text), None
        if st.builder is not None:
            lp = st.builder.empty()
            if self.echo and not st.echoed:
                st.builder.first_prompt_token(lp, c.handle.prompt_token_ids[0])
                st.builder.add(lp, c.prompt_logprobs)
            if not self.echo_only:
                st.builder.add(lp, out.logprobs)
        if self.echo and not st.echoed:
            text = st.prompt_text + text
        st.echoed = True
        return text, lp

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        shown = self._delta(c, out)
        if shown is None or not (shown[0] or (shown[1] and shown[1]["tokens"])):
            if not (self.answer.ids_only and self.answer.return_token_ids and out.token_ids):
                return None
            shown = ("", None)     # no text to wait for: the new token ids go out as they come
        return {"index": c.index, "text": shown[0], "logprobs": shown[1], "finish_reason": None}

    def finish(self, c: Choice, out: RequestOutput) -> dict:
        return {"index": c.index, "text": "", "logprobs": None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    def observe(self, c: Choice, out: RequestOutput) -> None:
        if self.keep is not None and out.logprobs is not None:
            c.state.logprob_sum += sum(lp[0] for lp in out.logprobs.logprobs)
            c.state.num_sampled += len(out.logprobs.logprobs)
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

    async def collect(self) -> dict | web.Response:
        """With best_of: each prompt's ``keep`` choices of the highest mean log-prob per token, as
        OpenAI ranks them; the usage counts every sampled choice."""
        body = await super().collect()
        if self.keep is None or not isinstance(body, dict):
            return body
        by_prompt: dict[int, list[tuple[float, int, dict]]] = {}
        for c, entry in zip(self.choices, body["choices"]):
            score = c.state.logprob_sum / max(c.state.num_sampled, 1)
            by_prompt.setdefault(c.prompt_index, []).append((-score, c.index, entry))
        kept = []
        for p in sorted(by_prompt):
            for i, (_, _, entry) in enumerate(sorted(by_prompt[p])[:self.keep]):
                entry["index"] = p * self.keep + i
                if self.choices[0].state.builder is None:
                    entry["logprobs"] = None
                kept.append(entry)
        body["choices"] = kept
        return body


async def completions(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    req: CompletionRequest = await server.read(request, CompletionRequest)
    gen, stream = await start_completion(server, req, arrival)
    return await gen.respond(request, stream)


async def start_completion(server: OpenAIServer, req: CompletionRequest, arrival: float,
                           submit: Submit | None = None) -> tuple[CompletionGeneration, bool]:
    """Check a decoded completion request and admit its choices (see ``chat.start_chat``)."""
    client = server.engine()
    n = num_choices(req)
    stream, include_usage = stream_flags(req, server.options.force_include_usage)
    prompts = _prompts(server, req)
    sampled = best_of(req, n, stream)
    if len(prompts) * sampled > MAX_CHOICES:
        what = "best_of" if sampled > n else "n"
        raise BadRequest(f"{len(prompts)} prompts x {what}={sampled} is more than {MAX_CHOICES} choices "
                         "per request", what if sampled > 1 else "prompt")
    params = req.to_sampling_params(server.vocab_size, client.max_model_len)
    echo = bool(req.echo)
    priority = check_priority(req, client.config.scheduler.policy)
    if req.use_beam_search:
        require(not req.echo_only, "echo with max_tokens 0 does not go with use_beam_search", "max_tokens")
        jobs = [{"prompt": p.text, "prompt_token_ids": p.token_ids, "priority": priority,
                 "add_special_tokens": req.add_special_tokens is not False, "cache_salt": cache_salt(req),
                 "lora_request": client.lora_request_for(req.model)} for p in prompts]
        echo_texts = [_prompt_text(client.tokenizer, p) for p in prompts] if echo else None
        return beam_answer(server, req, params, n, jobs, echo_texts), False
    await server.check_grammar(req, params)
    answer = server.answer_of(req)          # checked before anything is admitted (a 400 leaves nothing open)
    rid = client.new_request_id()
    engine_params = params
    if sampled > n and params.logprobs is None:          # best_of ranks by the sampled tokens' log-probs
        engine_params = msgspec.structs.replace(params, logprobs=0)
    choices = await submit_choices(
        submit or server.submit, rid, engine_params, sampled, prompts, priority=priority,
        arrival_time=arrival, add_special_tokens=req.add_special_tokens is not False,
        cache_salt=cache_salt(req), timeout_s=request_timeout(req),
        lora_request=client.lora_request_for(req.model), truncation_side=req.truncation_side,
        stream_interval=req.stream_interval)
    echo_texts = [_prompt_text(client.tokenizer, p) for p in prompts] if echo else None
    gen = CompletionGeneration(rid, served_name(client, req.model), choices, include_usage, answer,
                               params.num_logprobs, echo_texts, keep=n if sampled > n else None,
                               echo_only=req.echo_only)
    return gen, stream


def _prompts(server: OpenAIServer, req: CompletionRequest) -> list[PromptInput]:
    """The request's prompts: those of ``prompt_embeds`` first (vLLM's order), then ``prompt``'s."""
    embeds: list[PromptInput] = []
    if req.prompt_embeds is not None:
        model = server.engine().config.model
        require(model.enable_prompt_embeds, ENABLE_ERROR, "prompt_embeds")
        require(not req.echo, "Echo is unsupported with prompt embeds.", "echo")
        require(req.prompt_logprobs is None, "prompt_logprobs is not compatible with prompt embeds.",
                "prompt_logprobs")
        require(not req.use_beam_search, "use_beam_search is not supported with prompt embeds", "use_beam_search")
        hidden_size = model.arch.hidden_size
        try:
            embeds = [PromptInput(None, None, rows) for rows in completion_embeds(req.prompt_embeds)]
            for p in embeds:
                check_hidden_size(p.embeds, hidden_size)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt_embeds") from None
    if req.prompt is None or (req.prompt == "" and embeds):
        require(bool(embeds), "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return embeds
    return embeds + completion_prompts(req.prompt, server.vocab_size)


def best_of(req: CompletionRequest, n: int, stream: bool) -> int:
    """Choices to sample per prompt: OpenAI's best_of (at least n, not streamed), else n."""
    k = req.best_of
    if k is None or k == n:
        return n
    require(n <= k <= MAX_N, f"best_of must be in [n, {MAX_N}] (n is {n}), got {k}", "best_of")
    require(not stream, "best_of cannot be streamed: the choices returned are known only once all finished",
            "best_of")
    require(not req.use_beam_search, "best_of cannot be combined with beam search", "best_of")
    return k


def _prompt_text(tokenizer, prompt: PromptInput) -> str:
    if prompt.text is not None:
        return prompt.text
    return tokenizer.decode(prompt.token_ids or [], skip_special_tokens=False)
