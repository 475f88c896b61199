"""vLLM's scale-out endpoints (``--enable-scale-out``): a request rendered to token ids and
sampling parameters in one place and generated from token ids in another, as a frontend that
tokenizes apart from the engine (or an RL loop that keeps its own token ids) drives vLLM.

  POST /v1/chat/completions/render   a chat request -> vLLM's GenerateRequest (its prompt rendered
                                     with the chat template and tokenized, its sampling parameters)
  POST /v1/completions/render        a completion request -> one GenerateRequest per prompt
  POST /v1/responses/render          a Responses request -> the GenerateRequest of the chat it becomes
  POST /v1/messages/render           an Anthropic Messages request -> the GenerateRequest of the chat
                                     it is answered as
  POST /inference/v1/generate        a GenerateRequest -> the generated token ids (``output_mode``
                                     "tokens"), or token ids and text ("text"); streamed with
                                     ``"stream": true``
  POST /inference/v1/abort_requests  ``{"request_ids": [...]}``: end those generations
  POST /v1/chat/completions/derender a whole token-mode generate response (and the chat request
                                     it came from) -> the chat completion the chat endpoint answers
  POST /v1/completions/derender      one generate response per prompt -> the completion

Rendering goes through the same checks and the same tokenization as admitting the request would
(the Tokenizer actor's), so generating from a render's output gives the tokens the chat or
completion endpoint gives. Without the flag these routes answer 403, as vLLM's do."""
from __future__ import annotations

import base64
import functools
import io
import json
import time
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from actors.engine.sampling_params import SamplingParams
from actors.frontend import anthropic
from actors.frontend.chat import start_chat
from actors.frontend.completions import start_completion
from actors.frontend.errors import bad_request, error_response, json_encoder
from actors.frontend.fanout import Choice, submit_choices
from actors.frontend.generation import Answer, Generation
from actors.engine.messages import Logprobs
from actors.frontend.logprobs import CompletionLogprobs, chat_logprobs, finite, prompt_logprobs_json
from actors.frontend.params import PromptInput
from actors.frontend.responses import ResponsesRequest, renamed
from actors.frontend.protocol import (MAX_REQUEST_ID_CHARS, PRIORITY_RANGE, BadRequest, ChatCompletionRequest, CompletionRequest,
                                      StreamOptions, check_kv_transfer_params, require, require_in)
from actors.frontend.streams import RequestOutput

if TYPE_CHECKING:
    from actors.frontend.app import OpenAIServer

DISABLED = ("Scale-out endpoints are disabled. Restart the server with --enable-scale-out to enable them.")
MAX_CHOICES = 128

# vLLM SamplingParams fields a render writes or a client may send that change nothing here
_INERT = {"output_kind", "skip_clone", "output_text_buffer_length", "spaces_between_special_tokens",
          "routed_experts_prompt_start"}
# vLLM SamplingParams fields Troupe does not implement: refused when set to something
_UNSUPPORTED = {"trace_decode_token_ids"}
_OURS = set(SamplingParams.__struct_fields__) - {"bad_words_token_ids", "truncate_prompt_tokens"}


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's GenerateRequest (what /render answers and /inference/v1/generate takes)."""
    token_ids: list[int]
    sampling_params: dict[str, Any]
    request_id: str | None = None
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None          # multimodal: not served here
    content_parts: list[dict[str, Any]] | None = None
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


def numpy_base64(array: np.ndarray) -> str:
    """vLLM's encoding of an array in an answer: base64 of its ``.npy`` file (``np.load`` reads it)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def vllm_sampling_params(params: SamplingParams, n: int) -> dict[str, Any]:
    """``params`` as vLLM's SamplingParams JSON (the fields not at their defaults)."""
    out = msgspec.to_builtins(params)
    out.pop("truncate_prompt_tokens", None)       # applied by the render already
    out.pop("bad_words_token_ids", None)
    out.pop("n", None)
    if n > 1:
        out["n"] = n
    return out


def sampling_params_of(given: dict[str, Any]) -> tuple[SamplingParams, int, int]:
    """vLLM's SamplingParams JSON as Troupe's, with its ``n`` and ``stream_interval``; a field
    Troupe does not know, or does not implement, is a 400 naming it."""
    fields = dict(given)
    for name in _INERT:
        fields.pop(name, None)
    for name in _UNSUPPORTED:
        value = fields.pop(name, None)
        if value not in (None, False, [], 0):
            raise BadRequest(f"sampling_params.{name} is not supported by this server", f"sampling_params.{name}")
    interval = fields.pop("stream_interval", None)
    interval = 1 if interval is None else interval
    for name in ("stop", "stop_token_ids", "bad_words"):
        if fields.get(name, 0) is None:
            del fields[name]
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    unknown = sorted(set(fields) - _OURS)
    if unknown:
        raise BadRequest(f"unknown field `sampling_params.{unknown[0]}`", f"sampling_params.{unknown[0]}")
    try:
        params = msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid sampling_params: {exc}", "sampling_params") from None
    n = params.n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"sampling_params.n must be in [1, {MAX_CHOICES}], got {n!r}", "sampling_params.n")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise BadRequest("sampling_params.stream_interval must be a positive integer", "sampling_params.stream_interval")
    return msgspec.structs.replace(params, n=1), n, interval


def _render_id(request: web.Request, gen: Generation) -> str:
    """vLLM's: the answer's prefix and the X-Request-Id header, else the answer's id (the
    request's own request_id, else the server's)."""
    header = request.headers.get("X-Request-Id")
    return gen.id_prefix + header if header else gen.id


def _rendered(choices: list[Choice], request_id: str, req: ChatCompletionRequest | CompletionRequest,
              stream: bool) -> dict[str, Any]:
    """The GenerateRequest of one rendered prompt (its first choice's; ``n`` of them)."""
    first = choices[0].handle
    return {"request_id": request_id, "token_ids": first.prompt_token_ids, "token_offsets": first.token_offsets,
            "features": None, "content_parts": None,
            "sampling_params": vllm_sampling_params(first.params, len(choices)),
            "model": req.model, "reasoning_ended": None, "reasoning_parser_kwargs": None,
            "return_token_ids": None, "output_mode": "tokens", "stream": stream,
            "stream_options": msgspec.to_builtins(req.stream_options) if stream and req.stream_options else None,
            "cache_salt": req.cache_salt, "priority": req.priority or 0,
            "kv_transfer_params": req.kv_transfer_params, "ec_transfer_params": None}


def _renderer(server: OpenAIServer, req: ChatCompletionRequest | CompletionRequest) -> Any:
    """What renders (and does not admit) each choice of ``req``."""
    return functools.partial(server.submit, render_only=True, return_token_offsets=bool(req.return_token_offsets))


def _json(body: Any) -> web.Response:
    return web.Response(body=json_encoder.encode(body), content_type="application/json")


async def render_chat(server: OpenAIServer, request: web.Request) -> web.Response:
    req: ChatCompletionRequest = await server.read(request, ChatCompletionRequest)
    if req.use_beam_search:
        raise BadRequest("Beam search is not supported by the render endpoint", "use_beam_search")
    gen, stream = await start_chat(server, req, time.time(), _renderer(server, req))
    return _json(_rendered(gen.choices, _render_id(request, gen), req, stream))


async def render_completion(server: OpenAIServer, request: web.Request) -> web.Response:
    req: CompletionRequest = await server.read(request, CompletionRequest)
    if req.use_beam_search:
        raise BadRequest("Beam search is not supported by the render endpoint", "use_beam_search")
    gen, stream = await start_completion(server, req, time.time(), _renderer(server, req))
    by_prompt: dict[int, list[Choice]] = {}
    for c in gen.choices:
        by_prompt.setdefault(c.prompt_index, []).append(c)
    base = _render_id(request, gen)
    single = len(by_prompt) == 1
    return _json([_rendered(choices, base if single else f"{base}-{p}", req, stream)
                  for p, choices in sorted(by_prompt.items())])


async def render_response(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's /v1/responses/render: a Responses request rendered as the chat completion it is
    answered as (stateless: no previous_response_id)."""
    req: ResponsesRequest = await server.read(request, ResponsesRequest)
    if req.previous_response_id is not None:
        raise BadRequest("previous_response_id is not supported by the stateless render endpoint.",
                         "previous_response_id")
    req.check()
    try:
        chat = server.decode(json_encoder.encode(req.chat_body([])), ChatCompletionRequest)
        gen, _ = await start_chat(server, chat, time.time(), _renderer(server, chat))
    except BadRequest as exc:
        raise renamed(exc) from None
    header = request.headers.get("X-Request-Id")
    rid = "resp_" + (header or gen.id.removeprefix(gen.id_prefix))
    return _json(_rendered(gen.choices, rid, chat, bool(req.stream)))


async def render_messages(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's /v1/messages/render: an Anthropic Messages request rendered as the chat completion
    /v1/messages answers it with (the same conversion, so the same tokens)."""
    req = await server.read(request, anthropic.MessagesRequest)
    chat = server.decode(json_encoder.encode(anthropic.chat_body(req, anthropic.merges_inline_system(server),
                                                                 server.engine().thinking_budgets)),
                         ChatCompletionRequest)
    gen, stream = await start_chat(server, chat, time.time(), _renderer(server, chat))
    return _json(_rendered(gen.choices, _render_id(request, gen), chat, stream))


class TokensGeneration(Generation):
    """One GenerateRequest being answered in vLLM's GenerateResponse shape."""
    id_prefix = "generate-tokens-"

    def __init__(self, server: OpenAIServer, body: GenerateRequest, request_id: str, choices: list[Choice],
                 params: SamplingParams) -> None:
        options = body.stream_options
        answer = Answer(server.token_text, body.request_id,
                        continuous_usage=bool(body.stream and options and options.include_usage
                                              and options.continuous_usage_stats),
                        timings=server.options.per_request_metrics)
        include_usage = bool(body.stream and options and options.include_usage)
        super().__init__(request_id, body.model or server.engine().model_name, choices, include_usage, answer)
        self.aliases = (body.request_id,) if body.request_id else ()
        self.text_mode = body.output_mode == "text"
        self.return_token_ids = bool(body.return_token_ids)
        self.num_logprobs = params.num_logprobs
        self.prompt_logprobs = params.prompt_logprobs is not None
        self.kv_transfer = body.kv_transfer_params
        self._sent_prompt = False
        for c in choices:
            c.state = []                               # the log-prob entries so far

    def _logprobs(self, out: RequestOutput) -> list[dict[str, Any]] | None:
        if self.num_logprobs is None or out.logprobs is None:
            return None
        if self.text_mode:
            return chat_logprobs(out.logprobs, self.answer.text_of, self.num_logprobs)
        top = self.num_logprobs
        return [{"token_id": ids[0], "logprob": finite(values[0]), "rank": rank,
                 "top_logprobs": [{"token_id": t, "logprob": finite(v), "rank": r}
                                  for r, (t, v) in enumerate(zip(ids[1:top + 1], values[1:top + 1]), start=1)]}
                for ids, values, rank in zip(out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks)]

    def _entry(self, c: Choice, token_ids: list[int], logprobs: list | None, text: str,
               finish_reason: str | None, stop_reason: Any, sampling_mask: list[list[int]] | None,
               weight_versions: list[tuple[str, int, int]] | None) -> dict[str, Any]:
        entry = {"index": c.index, "finish_reason": finish_reason, "stop_reason": stop_reason,
                 "token_ids": token_ids, "routed_experts": None, "sampling_mask": sampling_mask,
                 "weight_versions": None if weight_versions is None else
                 [{"version": v, "start": start, "end": end} for v, start, end in weight_versions]}
        if self.text_mode:
            entry["text"] = text
        entry["logprobs"] = None if logprobs is None else {"content": logprobs}
        return entry

    def chunk(self, choices: list[dict], **extra: Any) -> dict:
        out: dict[str, Any] = {"request_id": self.id, "usage": extra.get("usage")}
        if self.return_token_ids and not self._sent_prompt:
            self._sent_prompt = True
            out["prompt_token_ids"] = self.choices[0].handle.prompt_token_ids
        out["output_mode"] = "text" if self.text_mode else "tokens"
        out["choices"] = choices
        return out

    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        """A chunk per output with tokens; the last carries the finish reason (vLLM's chunks)."""
        if not (out.token_ids or out.finished):
            return None
        return self._entry(c, out.token_ids, self._logprobs(out), out.text,
                           out.finish_reason if out.finished else None, out.stop_reason if out.finished else None,
                           out.sampling_mask, out.weight_versions if out.finished else None)

    def finish(self, c: Choice, out: RequestOutput) -> None:
        return None

    def observe(self, c: Choice, out: RequestOutput) -> None:
        c.text.append(out.text)
        lp = self._logprobs(out)
        if lp is not None:
            c.state.extend(lp)

    def final(self, c: Choice) -> dict:
        lp = c.state if self.num_logprobs is not None else None
        return self._entry(c, c.token_ids, lp, "".join(c.text), c.last.finish_reason, c.last.stop_reason,
                           c.sampling_mask, c.last.weight_versions)

    async def collect(self) -> dict[str, Any] | web.Response:
        body = await super().collect()
        if not isinstance(body, dict):
            return body
        first = self.choices[0]
        return {"request_id": body["id"], "model": body["model"], "created": body["created"],
                "usage": body["usage"],
                "prompt_logprobs": (prompt_logprobs_json(first.prompt_logprobs, self.answer.text_of)
                                    if self.prompt_logprobs else None),
                "prompt_token_id_logprobs": (numpy_base64(np.concatenate(first.prompt_scores))
                                             if first.prompt_scores else None),
                "prompt_token_ids": first.handle.prompt_token_ids if self.return_token_ids else None,
                "mm_placeholders": None, "metrics": body.get("metrics"),
                "kv_transfer_params": body.get("kv_transfer_params"),
                "ec_transfer_params": None, "output_mode": "text" if self.text_mode else "tokens",
                "choices": body["choices"]}


async def generate(server: OpenAIServer, request: web.Request) -> web.StreamResponse:
    arrival = time.time()
    body: GenerateRequest = await server.read(request, GenerateRequest)
    client = server.engine()
    for name in ("features", "content_parts", "ec_transfer_params"):
        if getattr(body, name) is not None:
            raise BadRequest(f"{name}: multimodal inputs are not supported by this server (a text-only model)", name)
    if not body.token_ids:
        raise BadRequest("token_ids must not be empty", "token_ids")
    if body.output_mode != "tokens" and not client.tokenizer.has_text:    # its text would be empty
        raise BadRequest(f"output_mode={body.output_mode!r} requires a tokenizer, but this server does not load one "
                         "(--tokens-only or --skip-tokenizer-init). Send the request to a server that loads a "
                         "tokenizer, or use output_mode='tokens'.", "output_mode")
    given = body.request_id
    require(given is None or (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable()),
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable characters", "request_id")
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options may only be set when stream is true", "stream_options")
    if body.cache_salt is not None and not 1 <= len(body.cache_salt) <= 1024:
        raise BadRequest("cache_salt must be 1 to 1024 characters", "cache_salt")
    require_in(body.priority, *PRIORITY_RANGE, "priority")
    if body.priority != 0 and client.config.scheduler.policy != "priority":
        raise BadRequest(f"priority {body.priority} needs a server started with --scheduling-policy priority",
                         "priority")
    params, n, interval = sampling_params_of(body.sampling_params)
    if body.kv_transfer_params is not None:     # a KV connector's, as the OpenAI endpoints take them
        extra = {**(params.extra_args or {}), "kv_transfer_params": check_kv_transfer_params(body.kv_transfer_params)}
        params = msgspec.structs.replace(params, extra_args=extra)
    if params.structured_outputs is not None:
        await server.check_grammar_spec(params.structured_outputs, "sampling_params.structured_outputs")
    rid = client.new_request_id()
    choices = await submit_choices(
        server.submit, rid, params, n, [PromptInput(None, list(body.token_ids))], priority=body.priority,
        arrival_time=arrival, cache_salt=body.cache_salt, lora_request=client.lora_request_for(body.model),
        stream_interval=interval)
    gen = TokensGeneration(server, body, rid, choices, params)
    return await gen.respond(request, bool(body.stream))


async def abort_requests(server: OpenAIServer, request: web.Request) -> web.Response:
    """vLLM's /inference/v1/abort_requests: ``request_ids`` (required) end with finish reason
    "abort"; an id names a generation as its GenerateRequest did (or its answer's id)."""
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"JSON decode error: {exc}") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise bad_request("Missing 'request_ids' in request body (a list of strings)", "request_ids")
    await server.abort_everywhere(ids)
    return web.Response(status=200)


async def disabled(server: OpenAIServer, request: web.Request) -> web.Response:
    return error_response(403, DISABLED)


# -- derender: token ids back to the OpenAI answer ------------------------------------------------
class GenerateChoice(msgspec.Struct, kw_only=True):
    """A choice of vLLM's GenerateTokensResponse (the fields derender reads; the others pass)."""
    index: int
    token_ids: list[int] | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    logprobs: dict[str, Any] | None = None


class GenerateResponse(msgspec.Struct, kw_only=True):
    """vLLM's GenerateTokensResponse, as /inference/v1/generate answers it."""
    request_id: str
    choices: list[GenerateChoice]
    output_mode: Literal["tokens"] = "tokens"
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: Any = None
    kv_transfer_params: dict[str, Any] | None = None


class DerenderChatRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's: ``prompt_tokens`` counts the prompt in the usage; ``prompt_token_ids`` (its tail is
    enough) seed the decoding; ``chat_request`` is the request as /render took it."""
    generate_response: GenerateResponse
    stream: Literal[False] = False
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None


class DerenderCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    generate_responses: list[GenerateResponse]
    stream: Literal[False] = False
    model: str | None = None
    prompt_tokens: list[int] | None = None
    prompt_token_ids: list[list[int] | None] | None = None
    completion_request: dict[str, Any] | None = None


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One chunk of a streamed /inference/v1/generate answer (token mode)."""
    request_id: str
    choices: list[GenerateChoice]
    output_mode: Literal["tokens"] = "tokens"
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None


class DerenderStreamRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's streamed derender (chat or completion): one generate chunk at a time, with the
    ``stream_state`` the previous call answered (None on the first)."""
    stream: Literal[True]
    generate_chunk: GenerateChunk
    model: str | None = None
    stream_state: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    chat_request: dict[str, Any] | None = None
    completion_request: dict[str, Any] | None = None


SEED_TOKENS = 4          # prompt tokens decoded before the output, so its first token reads as it would after them
PREFIX_WINDOW = 5        # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


def _original(server: OpenAIServer, raw: dict[str, Any] | None, typ: type, param: str) -> Any:
    """The chat or completion request a derender names, decoded as its endpoint decodes it."""
    if raw is None:
        return None
    try:
        return server.decode(json_encoder.encode(raw), typ)
    except BadRequest as exc:
        raise BadRequest(f"{param}: {exc}", param) from None


def _check_bounds(server: OpenAIServer, responses: list[GenerateResponse], prompt_ids: list[list[int] | None]) -> None:
    """vLLM's bounds on what a derender decodes: no more sequences, tokens or log-probs than a
    generation could have made."""
    limit, longest = MAX_CHOICES, server.engine().max_model_len
    require(len(responses) <= limit, f"generate_responses count ({len(responses)}) exceeds {limit}",
            "generate_responses")
    for gen in responses:
        require(len(gen.choices) <= limit, f"choices count ({len(gen.choices)}) exceeds {limit}", "choices")
        _check_choices(server, gen.choices)
    for ids in prompt_ids:
        require(ids is None or len(ids) <= longest,
                f"prompt_token_ids length exceeds max_model_len ({longest})", "prompt_token_ids")


def _check_choices(server: OpenAIServer, choices: list[GenerateChoice], streamed: bool = False) -> None:
    """Each choice's token ids (some, unless a streamed chunk: maybe none) in the vocabulary and
    no more of them, or of their log-probs, than the context holds."""
    longest = server.engine().max_model_len
    for c in choices:
        ids = c.token_ids or []
        require(streamed or bool(ids), f"choice {c.index} has empty or null token_ids", "token_ids")
        require(len(ids) <= longest, f"token_ids length ({len(ids)}) in choice {c.index} "
                f"exceeds max_model_len ({longest})", "token_ids")
        bad = [t for t in ids if not 0 <= t < server.vocab_size]
        require(not bad, f"token ids must be in [0, {server.vocab_size}), got {bad[:5]}", "token_ids")
        content = (c.logprobs or {}).get("content") or []
        require(len(content) <= longest, f"logprobs.content length in choice {c.index} exceeds "
                f"max_model_len ({longest})", "logprobs")


def _decode(server: OpenAIServer, ids: list[int], seed: list[int] | None, skip_special: bool) -> str:
    """``ids`` decoded as they read after the prompt's last tokens (a SentencePiece token's
    leading space, a character split across the boundary)."""
    tok = server.engine().tokenizer
    tail = [t for t in (seed or [])[-SEED_TOKENS:] if 0 <= t < server.vocab_size]
    if tail:
        before = tok.decode(tail, skip_special_tokens=skip_special)
        whole = tok.decode(tail + ids, skip_special_tokens=skip_special)
        if whole.startswith(before):
            return whole[len(before):]
    return tok.decode(ids, skip_special_tokens=skip_special)


def _stop_cut(text: str, choice: GenerateChoice, include_stop: bool) -> str:
    """The text up to the stop string that ended it (the engine's truncation, which token ids
    do not carry)."""
    if isinstance(choice.stop_reason, str):
        at = text.find(choice.stop_reason)
        if at >= 0:
            return text[:at + len(choice.stop_reason)] if include_stop else text[:at]
    return text


def _token_logprobs(choice: GenerateChoice) -> tuple[Logprobs | None, int]:
    """A choice's vLLM token-id log-probs as the engine's Logprobs, and how many alternatives
    each position lists."""
    content = (choice.logprobs or {}).get("content")
    if not content:
        return None, 0
    lp = Logprobs([], [], [])
    top = 0
    try:
        for entry in content:
            alts = entry.get("top_logprobs") or []
            top = max(top, len(alts))
            lp.token_ids.append([int(entry["token_id"]), *(int(a["token_id"]) for a in alts)])
            lp.logprobs.append([float(entry["logprob"]), *(float(a["logprob"]) for a in alts)])
            lp.ranks.append(int(entry.get("rank") or 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise BadRequest(f"malformed logprobs entry in choice {choice.index}: {exc}", "logprobs") from None
    return lp, top


class StreamState:
    """vLLM's DerenderStreamState, which the client carries from call to call: the incremental
    detokenizer's window (``prev_tokens`` as token strings, ``prefix_offset``, ``read_offset``:
    transformers' algorithm, so vLLM's state and this one are the same thing), whether the
    role was sent, the last token ids (log-prob context) and the completion log-probs' text
    offset. Fields this server does not use pass through unchanged."""

    def __init__(self, server: OpenAIServer, given: dict[str, Any] | None, seed: list[int] | None,
                 skip_special: bool) -> None:
        self.tok = server.engine().tokenizer
        self.skip_special = skip_special
        self.special = set(self.tok.all_special_ids)
        self.fields = dict(given or {})
        if given is None:
            tokens = self.tok.convert_ids_to_tokens([t for t in (seed or [])[-(PREFIX_WINDOW + 2):]
                                                     if 0 <= t < server.vocab_size])
            self.fields.update(prev_tokens=[t for t in tokens if t is not None],
                               prefix_offset=max(len(tokens) - PREFIX_WINDOW, 0), read_offset=len(tokens))
        try:
            self.prev = [str(t) for t in self.fields.get("prev_tokens") or []]
            self.prefix = int(self.fields.get("prefix_offset") or 0)
            self.read = int(self.fields.get("read_offset") or 0)
        except (TypeError, ValueError):
            raise BadRequest("stream_state is malformed", "stream_state") from None
        if not 0 <= self.prefix <= self.read <= len(self.prev):
            raise BadRequest("stream_state offsets are out of range", "stream_state")

    def text(self, ids: list[int]) -> str:
        """The text ``ids`` add (transformers' incremental detokenization, token by token)."""
        out = []
        for tid in ids:
            if self.skip_special and tid in self.special:
                continue
            self.prev += [t for t in self.tok.convert_ids_to_tokens([tid]) if t is not None]
            before = self.tok.convert_tokens_to_string(self.prev[self.prefix:self.read])
            after = self.tok.convert_tokens_to_string(self.prev[self.prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                out.append(after[len(before):])
                self.prefix, self.read = self.read, len(self.prev)
            self.prev, self.read, self.prefix = self.prev[self.prefix:], self.read - self.prefix, 0
        return "".join(out)

    def answer(self, **changed: Any) -> dict[str, Any]:
        return {**self.fields, "prev_tokens": self.prev, "prefix_offset": self.prefix, "read_offset": self.read,
                **changed}


def _stream_usage(chunk: GenerateChunk, prompt_tokens: int | None) -> dict[str, int] | None:
    if chunk.usage is None:
        return None
    prompt = prompt_tokens if prompt_tokens is not None else int(chunk.usage.get("prompt_tokens") or 0)
    completion = int(chunk.usage.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _derender_stream(server: OpenAIServer, raw: bytes, chat: bool) -> web.Response:
    """One chunk of a streamed generation derendered (vLLM's streamed derender, plain path):
    ``{"chunk": ..., "stream_state": ...}``, at most one choice per chunk."""
    body: DerenderStreamRequest = server.decode(raw, DerenderStreamRequest)
    chunk = body.generate_chunk
    require(len(chunk.choices) <= 1, "a streamed derender takes at most one choice per chunk", "generate_chunk")
    typ, given = (ChatCompletionRequest, body.chat_request) if chat else (CompletionRequest, body.completion_request)
    original = _original(server, given, typ, "chat_request" if chat else "completion_request")
    seed = body.prompt_token_ids if body.prompt_token_ids is not None else chunk.prompt_token_ids
    _check_choices(server, chunk.choices, streamed=True)
    require(seed is None or len(seed) <= server.engine().max_model_len,
            "prompt_token_ids length exceeds max_model_len", "prompt_token_ids")
    state = StreamState(server, body.stream_state, seed, original is None or original.skip_special_tokens is not False)
    include_stop = original is not None and bool(original.include_stop_str_in_output)
    return_ids = original is not None and bool(original.return_token_ids)
    context = [int(t) for t in state.fields.get("logprob_context_token_ids") or []]
    offset = int(state.fields.get("logprob_text_offset") or 0)
    role_sent = bool(state.fields.get("role_sent"))
    choices = []
    for c in chunk.choices:
        ids = c.token_ids or []
        text = state.text(ids)
        if c.finish_reason is not None:
            text = _stop_cut(text, c, include_stop)
        lp, top = _token_logprobs(c)
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if not role_sent else {}
            if text:
                delta["content"] = text
            logprobs = None if lp is None else {"content": chat_logprobs(lp, server.token_text, top)}
            choices.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "token_ids": ids if return_ids else None})
            role_sent = True
        else:
            logprobs = None
            if lp is not None:
                builder = CompletionLogprobs(server.token_text, top)
                builder.offset = offset
                logprobs = builder.empty()
                builder.add(logprobs, lp)
                offset = builder.offset
            choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "token_ids": ids if return_ids else None})
        context = (context + ids)[-SEED_TOKENS:]
    out = {"id": chunk.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()), "model": body.model or server.engine().model_name, "choices": choices,
           "usage": _stream_usage(chunk, body.prompt_tokens)}
    return _json({"chunk": out, "stream_state": state.answer(role_sent=role_sent, logprob_context_token_ids=context,
                                                              logprob_text_offset=offset)})


def _streamed(raw: bytes) -> bool:
    """Whether a derender body asks for the streamed form (``"stream": true``)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False              # the decoder says what is wrong
    return isinstance(body, dict) and body.get("stream") is True


async def derender_chat(server: OpenAIServer, request: web.Request) -> web.Response:
    raw = await request.read()
    if _streamed(raw):
        return await _derender_stream(server, raw, chat=True)
    body: DerenderChatRequest = server.decode(raw, DerenderChatRequest)
    chat = _original(server, body.chat_request, ChatCompletionRequest, "chat_request")
    gen = body.generate_response
    seed = body.prompt_token_ids if body.prompt_token_ids is not None else gen.prompt_token_ids
    _check_bounds(server, [gen], [seed])
    skip = chat is None or chat.skip_special_tokens is not False
    include_stop = chat is not None and bool(chat.include_stop_str_in_output)
    text_of = server.token_text
    choices = []
    for c in gen.choices:
        text = _stop_cut(_decode(server, c.token_ids, seed, skip), c, include_stop)
        lp, top = _token_logprobs(c)
        choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                        "logprobs": None if lp is None else {"content": chat_logprobs(lp, text_of, top)},
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        "token_ids": c.token_ids if chat is not None and chat.return_token_ids else None})
    prompt = body.prompt_tokens or 0
    completion = sum(len(c.token_ids) for c in gen.choices)
    return _json({"id": gen.request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": body.model or server.engine().model_name, "choices": choices,
                  "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion},
                  "prompt_logprobs": gen.prompt_logprobs, "kv_transfer_params": gen.kv_transfer_params})


async def derender_completion(server: OpenAIServer, request: web.Request) -> web.Response:
    raw = await request.read()
    if _streamed(raw):
        return await _derender_stream(server, raw, chat=False)
    body: DerenderCompletionRequest = server.decode(raw, DerenderCompletionRequest)
    gens = body.generate_responses
    require(bool(gens), "generate_responses must not be empty", "generate_responses")
    for name in ("prompt_tokens", "prompt_token_ids"):
        given = getattr(body, name)
        require(given is None or len(given) == len(gens),
                f"{name} length ({len(given or [])}) must equal generate_responses length ({len(gens)})", name)
    done = _original(server, body.completion_request, CompletionRequest, "completion_request")
    seeds = [(body.prompt_token_ids or [None] * len(gens))[i] or g.prompt_token_ids for i, g in enumerate(gens)]
    _check_bounds(server, gens, seeds)
    skip = done is None or done.skip_special_tokens is not False
    include_stop = done is not None and bool(done.include_stop_str_in_output)
    choices, index = [], 0
    for gen, seed in zip(gens, seeds):
        for c in gen.choices:
            text = _stop_cut(_decode(server, c.token_ids, seed, skip), c, include_stop)
            lp, top = _token_logprobs(c)
            logprobs = None
            if lp is not None:
                builder = CompletionLogprobs(server.token_text, top)
                logprobs = builder.empty()
                builder.add(logprobs, lp)
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids if done is not None and done.return_token_ids else None})
            index += 1
    prompt = sum(body.prompt_tokens or [])
    completion = sum(len(c.token_ids) for g in gens for c in g.choices)
    kv = gens[0].kv_transfer_params if all(g.kv_transfer_params == gens[0].kv_transfer_params for g in gens) else None
    return _json({"id": gens[0].request_id, "object": "text_completion", "created": int(time.time()),
                  "model": body.model or server.engine().model_name, "choices": choices,
                  "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                            "total_tokens": prompt + completion}, "kv_transfer_params": kv})


GENERATE = "/inference/v1/generate"
ROUTES = [("POST", "/v1/chat/completions/render", render_chat),
          ("POST", "/v1/completions/render", render_completion),
          ("POST", "/v1/responses/render", render_response),
          ("POST", "/v1/messages/render", render_messages),
          ("POST", GENERATE, generate),
          ("POST", "/inference/v1/abort_requests", abort_requests),
          ("POST", "/v1/chat/completions/derender", derender_chat),
          ("POST", "/v1/completions/derender", derender_completion)]


def routes(enabled: bool) -> list[tuple[str, str, Any]]:
    return ROUTES if enabled else [(method, path, disabled) for method, path, _ in ROUTES]
