"""What chat and text completions share once their choices are admitted: collecting outputs
into one response, or streaming them as chunks (one finish chunk per choice, then an optional
usage chunk), with usage accounting and error mapping. Subclasses shape the choices."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from aiohttp import web

from actors.frontend import http_trace
from actors.frontend.errors import error_body, error_response, json_encoder
from actors.frontend.fanout import Choice, close_all, merged_outputs
from actors.frontend.logprobs import TokenIdText, TokenText
from actors.frontend.sse import send_events
from actors.frontend.streams import RequestOutput, StreamTimeout

if TYPE_CHECKING:
    from actors.frontend.protocol import GenerationRequest

# The answers being given: an answer's id (and the X-Request-Id it came with) -> its engine
# requests, so POST /abort_requests can name a request as its client knows it.
OPEN_ANSWERS = web.AppKey("open_answers", dict)


@dataclass(frozen=True, slots=True)
class Answer:
    """What a request asks its answer to show besides the text (vLLM's request fields)."""
    text_of: TokenText | TokenIdText      # how log-prob tokens read (return_tokens_as_token_ids)
    shown_id: str | None = None           # request_id: the answer's id after the prefix
    return_token_ids: bool = False        # the prompt's token ids and each choice's
    prompt_logprobs: bool = False         # the prompt's log-probs (prompt_logprobs set)
    continuous_usage: bool = False        # streamed: the usage so far in every chunk (vLLM's continuous_usage_stats)
    ids_only: bool = False                # the server loads no tokenizer (--skip-tokenizer-init): no text, ever
    timings: bool = False                 # a one-choice answer's metrics (--enable-per-request-metrics)
    fingerprint: str | None = None        # system_fingerprint (--fingerprint-mode)

    @classmethod
    def of(cls, req: GenerationRequest, token_text: TokenText, as_token_ids: bool,
           force_usage: bool = False, timings: bool = False, fingerprint: str | None = None) -> Answer:
        """``as_token_ids``: the server's --return-tokens-as-token-ids (the request's field wins);
        ``force_usage``: its --enable-force-include-usage (the usage in every streamed chunk);
        ``timings``: its --enable-per-request-metrics; ``fingerprint``: its system_fingerprint."""
        ids = as_token_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids
        options = req.stream_options
        return cls(TokenIdText(token_text) if ids else token_text, req.shown_id(), bool(req.return_token_ids),
                   req.prompt_logprobs is not None and not req.stream,
                   bool(req.stream and (force_usage or (options and options.include_usage
                                                        and options.continuous_usage_stats))),
                   not getattr(token_text.tokenizer, "has_text", True), timings, fingerprint)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def _failure(out: RequestOutput | None) -> str:
    if out is None:
        return "the request ended without output"
    return f"the request failed: {out.error}"


class Generation(ABC):
    """One admitted chat or completion request: its choices and how to answer with them."""
    object_name = ""       # "chat.completion" | "text_completion"
    chunk_object = ""      # "chat.completion.chunk" | "text_completion"
    id_prefix = ""         # "chatcmpl-" | "cmpl-"

    def __init__(self, request_id: str, model: str, choices: list[Choice],
                 include_usage: bool, answer: Answer) -> None:
        self.id = self.id_prefix + (answer.shown_id or request_id)
        self.model = model
        self.choices = choices
        self.include_usage = include_usage
        self.answer = answer
        self.created = int(time.time())
        self._shown_prompt_ids: set[int] = set()     # streamed choices whose prompt ids were sent
        self.aliases: tuple[str, ...] = ()             # other ids a client may abort it by

    # -- what subclasses shape ---------------------------------------------------------------
    def start_chunks(self) -> list[dict]:
        return []

    @abstractmethod
    def delta(self, c: Choice, out: RequestOutput) -> dict | None:
        """The streamed choice entry for this output (None: nothing to show yet)."""

    @abstractmethod
    def finish(self, c: Choice, out: RequestOutput) -> dict | None:
        """The streamed choice entry that closes choice ``c`` (None: its last delta did)."""

    @abstractmethod
    def final(self, c: Choice) -> dict:
        """The choice entry of a non-streamed response (after every output was seen)."""

    @abstractmethod
    def observe(self, c: Choice, out: RequestOutput) -> None:
        """Non-streamed: take in one output."""

    def choice_extras(self, c: Choice) -> dict[str, Any]:
        """vLLM's fields of a non-streamed choice that the request asked for."""
        return {}

    def body_extras(self) -> dict[str, Any]:
        """vLLM's fields of a non-streamed answer that the request asked for."""
        return {}

    def prompt_ids_in_choice(self) -> bool:
        """Whether a stream sends a choice's prompt token ids in its first entry (completions)
        rather than in its first chunk (chat's role chunk)."""
        return False

    # -- shared ------------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        prompts: dict[int, Choice] = {}
        for c in self.choices:
            prompts.setdefault(c.prompt_index, c)
        cached = sum(c.last.num_cached_tokens for c in prompts.values() if c.last is not None)
        return usage(sum(c.handle.num_prompt_tokens for c in prompts.values()),
                     sum(c.num_output_tokens for c in self.choices), cached)

    def chunk(self, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def metrics(self) -> dict[str, Any] | None:
        """vLLM's per-request metrics of a one-choice answer: its timings with
        --enable-per-request-metrics, its drafts' acceptance with --per-request-spec-decode-metrics
        (None: neither, or several choices, whose figures are not the request's)."""
        if len(self.choices) != 1 or self.choices[0].last is None or self.choices[0].last.metrics is None:
            return None
        got = self.choices[0].last.metrics
        if self.answer.timings:
            return got
        if got["speculative_decoding"] is None:
            return None
        return {**dict.fromkeys(("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                                 "tokens_per_second")), "speculative_decoding": got["speculative_decoding"]}

    async def respond(self, request: web.Request, stream: bool) -> web.StreamResponse:
        http_trace.serving(c.handle.request_id for c in self.choices)
        http_trace.mark("receive")          # from the request's arrival to its admission
        header_id = request.headers.get("X-Request-Id") or self.id     # the client's, echoed
        answers = request.app.get(OPEN_ANSWERS)
        names = {self.id, header_id, *self.aliases}
        if answers is not None:
            engine_ids = [c.handle.request_id for c in self.choices]
            for name in names:
                answers[name] = engine_ids
        try:
            if stream:
                for c in self.choices:
                    if c.handle.output_log is not None:
                        c.handle.output_log.streaming = True
                return await send_events(request, self.events(), header_id)
            response = await self.complete()
            response.headers["X-Request-Id"] = header_id
            return response
        finally:
            close_all(self.choices)     # aborts what did not finish (e.g. the client left)
            if answers is not None:
                for name in names:
                    answers.pop(name, None)

    async def whole(self) -> web.Response:
        """The whole answer as one body, away from HTTP (the batch runner's)."""
        try:
            return await self.complete()
        finally:
            close_all(self.choices)

    async def complete(self) -> web.Response:
        body = await self.collect()
        if isinstance(body, web.Response):
            return body
        return web.Response(body=json_encoder.encode(body), content_type="application/json")

    async def collect(self) -> dict[str, Any] | web.Response:
        """The whole answer's body once every choice finished, or the error response that takes
        its place."""
        try:
            async for c, out in merged_outputs(self.choices):
                c.take(out)
                self.observe(c, out)
        except StreamTimeout as exc:
            return error_response(504, str(exc))
        for c in self.choices:
            if c.last is None or c.last.error is not None:
                return error_response(c.last.error_status if c.last is not None and c.last.error_status else 500,
                                      _failure(c.last))
        body = {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [{**self.final(c), **self.choice_extras(c)} for c in self.choices],
                "usage": self.usage(), **self.body_extras()}
        if self.answer.fingerprint is not None:
            body["system_fingerprint"] = self.answer.fingerprint
        metrics = self.metrics()
        if metrics is not None:
            body["metrics"] = metrics
        params = next((c.last.kv_transfer_params for c in self.choices if c.last.kv_transfer_params), None)
        if params is not None:           # vLLM's: what a decode instance needs to read this prompt's KV
            body["kv_transfer_params"] = params
        return body

    async def events(self) -> AsyncIterator[dict]:
        for chunk in self.start_chunks():
            yield chunk
        try:
            async for c, out in merged_outputs(self.choices):
                c.take(out)
                if out.error is not None:
                    yield error_body(_failure(out), code=out.error_status or 500)
                    return
                entry = self.delta(c, out)
                if self.answer.return_token_ids:
                    c.unsent_ids.extend(out.token_ids)
                extra = {"usage": self.usage()} if self.answer.continuous_usage else {}
                closing = self.finish(c, out) if out.finished else None
                last = {}               # vLLM's: a choice's terminal chunk carries the fingerprint
                if out.finished and self.answer.fingerprint is not None and not self.include_usage:
                    last = {"system_fingerprint": self.answer.fingerprint}
                if entry is not None:
                    yield self.chunk([self._with_ids(c, entry)], **extra, **(last if closing is None else {}))
                if closing is not None:
                    yield self.chunk([self._with_ids(c, closing)], **extra, **last)
        except StreamTimeout as exc:
            yield error_body(str(exc), code=504)
            return
        if self.include_usage:      # the last chunk: the usage, the fingerprint, the request's metrics
            extra = {"system_fingerprint": self.answer.fingerprint} if self.answer.fingerprint is not None else {}
            metrics = self.metrics()
            if metrics is not None:
                extra["metrics"] = metrics
            yield self.chunk([], usage=self.usage(), **extra)

    def _with_ids(self, c: Choice, entry: dict) -> dict:
        """A streamed entry with the token ids no earlier chunk of its choice carried (and, the
        first time, the prompt's where the endpoint sends them in the choice), when asked for."""
        if self.answer.return_token_ids:
            if self.prompt_ids_in_choice() and c.index not in self._shown_prompt_ids:
                self._shown_prompt_ids.add(c.index)
                entry["prompt_token_ids"] = c.handle.prompt_token_ids
            entry["token_ids"], c.unsent_ids = c.unsent_ids, []
        return entry
