"""Beam search over the engine, as vLLM runs it: each step asks the model for one token of every
live beam (one engine request per beam, its prompt the beam's tokens so far, so the prefix cache
serves all but the newest block), with ``2 * beam_width`` log-probs; the candidates, every beam
extended by each of its alternatives, are ranked by cumulative log-prob and the best
``beam_width`` live on. A candidate ending in an end-of-sequence token is finished instead. After
``max_tokens`` steps (or when no beam lives) the finished and live beams are ranked by
``cumulative_logprob / len(tokens) ** length_penalty`` (tokens: prompt and output, an ending EOS
not counted) and the best ``beam_width`` returned.

The offline API (``LLM.beam_search``) and the server (``use_beam_search`` with ``n`` beams) run
it."""
from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from actors.tokenizer.multimodal import has_images
from actors.engine.sampling_params import SamplingParams
from actors.frontend.errors import error_response, json_encoder
from actors.frontend.generation import usage
from actors.frontend.logprobs import ranked_positions
from actors.frontend.params import served_name
from actors.frontend.protocol import require

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer
    from actors.frontend.client import EngineClient
    from actors.frontend.protocol import GenerationRequest

log = logging.getLogger("troupe.beam_search")
_BEAM_WARNED: list[bool] = []             # the watermark warning, once per process
MAX_BEAM_WIDTH = 128


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def check(self) -> None:
        """ValueError naming the first value beam search cannot run with."""
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """vLLM's: ``tokens`` are the prompt's and the output's; ``text`` the output's, decoded;
    ``logprobs`` per output token, its alternatives by token id."""
    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None        # "stop" (an EOS) or "length"; "abort" when it was aborted
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """vLLM's: the best ``beam_width`` sequences, best first."""
    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)


def score(tokens: list[int], cum_logprob: float, eos: frozenset[int], length_penalty: float) -> float:
    """vLLM's (and transformers') length-penalized score of a whole sequence."""
    n = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearchFailed(RuntimeError):
    """A step's request ended in an error: the search stops with it."""


async def _one_token(submit: Any, params: SamplingParams, request_id: str,
                     what: dict[str, Any]) -> tuple[list[int], dict[int, float], str | None]:
    """One step of one beam: (the prompt's token ids, the next token's log-probs by id, how the
    request ended). The request ends with its first token (closed sooner, it is aborted)."""
    handle = await submit(params, request_id=request_id, **what)
    alternatives: dict[int, float] = {}
    finish = None
    try:
        async for out in handle:
            if out.error is not None:
                raise BeamSearchFailed(out.error)
            finish = out.finish_reason
            if out.logprobs is not None and out.logprobs.token_ids:
                alternatives.update({tok: lp for tok, (lp, _) in next(ranked_positions(out.logprobs)).items()})
                break
    finally:
        handle.close()
    return handle.prompt_token_ids, alternatives, finish


async def beam_search(client: EngineClient, params: BeamSearchParams, submit: Any = None,
                      **what: Any) -> BeamSearchOutput:
    """Beam search from one prompt; ``what`` is what ``client.submit`` takes of a prompt
    (``prompt``, ``prompt_token_ids`` or ``messages`` with their options, ``lora_request``,
    ``cache_salt``, ``priority``): the first step renders and tokenizes it, the others send the
    beams' token ids. ``submit``: how each step's request is admitted (the server's maps refusals
    to HTTP errors; default ``client.submit``)."""
    submit = submit or client.submit
    params.check()
    if what.get("multi_modal_data") or has_images(what.get("messages")):
        raise ValueError("beam search is not supported with image, video or audio input (its later steps send token ids)")
    width = params.beam_width
    eos = frozenset(client.config.model.arch.eos_token_ids)
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width,
                                 ignore_eos=True, watermarking=False)    # beams are chosen, not sampled
    if client.config.watermark is not None and not _BEAM_WARNED:
        _BEAM_WARNED.append(True)
        log.warning("Watermarking is enabled, but beam search cannot be watermarked. This and subsequent beam "
                    "search requests will run without watermarking.")
    keep = {k: what[k] for k in ("lora_request", "cache_salt", "priority", "timeout_s") if k in what}
    base = client.new_request_id()
    # the first step is admitted with the whole search's max_tokens, so a prompt that leaves no
    # room for them is refused as any request is (it stops at its first token all the same)
    whole = params.max_tokens if params.max_tokens < client.max_model_len else None
    first = await _one_token(submit, msgspec.structs.replace(step_params, max_tokens=whole), f"{base}-0-0", what)
    prompt_ids = list(first[0])
    beams = [BeamSearchSequence(list(prompt_ids))]
    done: list[BeamSearchSequence] = []
    for step in range(params.max_tokens):
        if step and len(beams[0].tokens) >= client.max_model_len - 1:     # the context is full
            break
        results = [first] if step == 0 else await asyncio.gather(*(
            _one_token(submit, step_params, f"{base}-{step}-{i}", {"prompt_token_ids": b.tokens, **keep})
            for i, b in enumerate(beams)))
        if any(finish == "abort" for _, _, finish in results):
            for b in beams:
                b.finish_reason = "abort"
            break
        steps = [alternatives for _, alternatives, _ in results]
        candidates: list[BeamSearchSequence] = []
        for beam, alts in zip(beams, steps):
            for tok, lp in alts.items():
                if tok in eos and not params.ignore_eos:      # finished: the EOS kept only when asked
                    tokens = beam.tokens + [tok] if params.include_stop_str_in_output else beam.tokens
                    done.append(BeamSearchSequence(tokens, beam.cum_logprob + lp, beam.logprobs + [alts],
                                                   finish_reason="stop", stop_reason=tok))
                else:
                    candidates.append(BeamSearchSequence(beam.tokens + [tok], beam.cum_logprob + lp,
                                                         beam.logprobs + [alts]))
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        beams = candidates[:width]
        if not beams:
            break
    done.extend(beams)
    done.sort(key=lambda b: score(b.tokens, b.cum_logprob, eos, params.length_penalty), reverse=True)
    best = done[:width]
    n_prompt = len(prompt_ids)
    for b in best:
        b.finish_reason = b.finish_reason or "length"
        b.text = client.tokenizer.decode(b.tokens[n_prompt:], skip_special_tokens=params.skip_special_tokens)
    return BeamSearchOutput(best, list(prompt_ids))


class BeamAnswer:
    """A chat or completion request with ``use_beam_search`` (vLLM's): each prompt searched with
    ``n`` beams, the beams its choices (best first), answered whole (no stream, as in vLLM)."""

    def __init__(self, server: OpenAIServer, chat: bool, model: str, shown_id: str, params: BeamSearchParams,
                 jobs: list[dict[str, Any]], echo_texts: list[str] | None = None) -> None:
        self.server, self.chat, self.model, self.id = server, chat, model, shown_id
        self.params, self.jobs, self.echo_texts = params, jobs, echo_texts
        self.created = int(time.time())

    async def respond(self, request: web.Request, stream: bool) -> web.Response:
        response = await self.whole()
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or self.id
        return response

    async def whole(self) -> web.Response:
        client = self.server.engine()
        try:
            outs = await asyncio.gather(*(beam_search(client, self.params, self.server.submit, **job)
                                          for job in self.jobs))
        except BeamSearchFailed as exc:
            return error_response(500, f"the request failed: {exc}")
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, out in enumerate(outs):
            prompt_tokens += len(out.prompt_token_ids)
            for i, seq in enumerate(out.sequences):
                completion_tokens += len(seq.tokens) - len(out.prompt_token_ids)
                entry: dict[str, Any] = {"index": p * self.params.beam_width + i}
                if self.chat:
                    job = self.jobs[p]
                    role = (self.server.options.response_role if job["add_generation_prompt"]
                            else job["messages"][-1]["role"])
                    entry["message"] = {"role": role, "content": seq.text}
                else:
                    entry["text"] = (self.echo_texts[p] if self.echo_texts else "") + seq.text
                entry.update(logprobs=None, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
                choices.append(entry)
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens)}
        return web.Response(body=json_encoder.encode(body), content_type="application/json")


def beam_answer(server: OpenAIServer, req: GenerationRequest, params: SamplingParams, n: int,
                jobs: list[dict[str, Any]], echo_texts: list[str] | None = None) -> BeamAnswer:
    """A request's beam search, checked: vLLM's rules (no stream) and what this search gives
    (text, not log-probs or structured outputs)."""
    chat = req.prompt_param == "messages"
    require(not req.stream, "Streaming is not currently supported with beam search", "stream")
    require(params.logprobs is None and params.prompt_logprobs is None,
            "log-probs are not returned with beam search", "logprobs")
    require(params.structured_outputs is None, "structured outputs cannot be combined with beam search",
            "use_beam_search")
    penalty = 1.0 if req.length_penalty is None else req.length_penalty
    require(math.isfinite(penalty), f"length_penalty must be a finite number, got {penalty}", "length_penalty")
    client = server.engine()
    search = BeamSearchParams(n, params.max_tokens or client.max_model_len, params.ignore_eos, params.temperature,
                              penalty, params.include_stop_str_in_output, params.skip_special_tokens)
    answer = server.answer_of(req)
    rid = client.new_request_id()
    shown = ("chatcmpl-" if chat else "cmpl-") + (answer.shown_id or rid)
    return BeamAnswer(server, chat, served_name(client, req.model), shown, search, jobs, echo_texts)
