"""The offline API: ``AsyncLLM`` (an async iterator per request) and ``LLM`` (synchronous, with a
progress bar). By default every actor runs in one event loop in this process; pass
``multiprocess=True`` for the same process layout as the server (the default with
``data_parallel_size``, ``tensor_parallel_size`` or ``pipeline_parallel_size`` > 1, and with a Ray
backend: each engine core and rank needs a process, or a Ray actor, of its own). Engine options are
``EngineArgs``'s fields (``actors/engine/args.py``), as keywords."""
from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import dataclasses
import sys
import threading
import time
import weakref
from collections.abc import MutableSequence
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Sequence, Sized, Union

import msgspec
import numpy as np

from actors.engine.args import EngineArgs
from actors.engine.lora import LoRARequest
from actors.engine.messages import Logprobs
from actors.engine.pooling import PoolingParams
from actors.engine.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams
from actors.frontend.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from actors.frontend.fanout import close_all, merged_outputs, submit_choices
from actors.frontend.client import EngineDeadError
from actors.frontend.launch import SHUT_DOWN, Frontend, start_frontend
from actors.frontend.logprobs import TokenText, ranked_positions
from actors import topology
from actors.frontend.metrics_reader import Metric, metrics_snapshot
from actors.frontend.misc import kv_event_sources_of
from actors.frontend.stat_logger import LogStats
from actors.frontend.protocol import MAX_N
from actors.frontend.streams import RequestOutput
from actors.tokenizer.gguf_tokenizer import NO_TOKENIZER
from actors.tokenizer.prompt_embeds import embeds_array

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "RepetitionDetectionParams", "GenerationResult",
           "WeightVersionSpan", "FlatLogprobs",
           "CompletionOutput", "Logprob", "LoRARequest", "PoolingParams", "PoolingOutput", "PoolingRequestOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput"]


@dataclass(slots=True)
class Logprob:
    """vLLM's: one token's log-prob, its rank among the vocabulary (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FlatLogprobs(MutableSequence):
    """vLLM's (``SamplingParams(flat_logprobs=True)``): per-position log-probs as a few flat lists
    (position i's entries are ``start_indices[i]:end_indices[i]`` of ``token_ids``, ``logprobs``,
    ``ranks``, ``decoded_tokens``), read like ``list[dict[int, Logprob]]``: ``flat[i]`` builds
    position i's dict, slices are FlatLogprobs, iteration yields each position's."""

    def __init__(self, start_indices: list[int] | None = None, end_indices: list[int] | None = None,
                 token_ids: list[int] | None = None, logprobs: list[float] | None = None,
                 ranks: list[int | None] | None = None, decoded_tokens: list[str | None] | None = None) -> None:
        self.start_indices, self.end_indices = start_indices or [], end_indices or []
        self.token_ids, self.logprobs = token_ids or [], logprobs or []
        self.ranks, self.decoded_tokens = ranks or [], decoded_tokens or []

    def append(self, position: dict[int, Logprob] | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (position or {}).items():
            self.append_entry(token_id, lp.logprob, lp.rank, lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_entry(self, token_id: int, logprob: float, rank: int | None, decoded: str | None) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.decoded_tokens.append(decoded)

    def extend(self, positions: Iterable[dict[int, Logprob] | None]) -> None:
        if isinstance(positions, FlatLogprobs):
            shift = len(self.logprobs) - (positions.start_indices[0] if positions.start_indices else 0)
            self.start_indices += [i + shift for i in positions.start_indices]
            self.end_indices += [i + shift for i in positions.end_indices]
            lo, hi = (positions.start_indices[0], positions.end_indices[-1]) if positions.start_indices else (0, 0)
            self.token_ids += positions.token_ids[lo:hi]
            self.logprobs += positions.logprobs[lo:hi]
            self.ranks += positions.ranks[lo:hi]
            self.decoded_tokens += positions.decoded_tokens[lo:hi]
            return
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            out = FlatLogprobs()
            out.extend(FlatLogprobs(self.start_indices[index], self.end_indices[index], self.token_ids,
                                    self.logprobs, self.ranks, self.decoded_tokens))
            return out
        if not isinstance(index, int):
            raise TypeError(f"Invalid index type: {type(index)}")
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        for i in range(len(self)):
            yield self[i]

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: Any) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (FlatLogprobs, list)) else NotImplemented

    def __repr__(self) -> str:
        return f"FlatLogprobs({len(self)} positions, {len(self.logprobs)} entries)"


@dataclass(slots=True)
class SamplingMask:
    """vLLM's (--return-sampling-mask): per generated token, the token ids its draw could pick
    (what survived the processors, min-p, top-k and top-p), ascending."""
    token_ids: list[list[int]]


@dataclass(slots=True)
class CompletionOutput:
    """vLLM's: one of a prompt's ``n`` sequences. ``logprobs`` (when the request asked for them):
    per generated token, its alternatives by token id, the sampled one included;
    ``cumulative_logprob`` the sum of the sampled tokens' log-probs."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None                 # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None             # the stop string or token id that ended it
    # vLLM's: the sequence's drafts' acceptance (per_request_spec_decode_metrics), as the
    # server's metrics.speculative_decoding; None: off, or no drafts
    spec_decode_metrics: dict[str, Any] | None = None
    sampling_mask: SamplingMask | None = None        # vLLM's: with return_sampling_mask
    # vLLM's: on the finished output, the weight versions that sampled its tokens, in spans
    # ("default" until a weight transfer round or update_weight_version names another)
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass(slots=True)
class WeightVersionSpan:
    """vLLM's: output tokens [start, end) were sampled by the weights labelled ``version``."""
    version: str
    start: int
    end: int


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's: a pooling request's answer, ``data`` a float32 torch tensor ((dims,), or (prompt
    tokens, dims) for token_embed)."""
    data: Any


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding, as a list of floats."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's: a classifier's scores of its labels (after its activation: probabilities)."""
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: a pair's score (an embedding model's: the cosine similarity of the two)."""
    score: float


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput``: what ``LLM.encode`` returns per prompt (``outputs`` a
    PoolingOutput), and the shape of its task-specific kinds below."""
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: Any = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> PoolingRequestOutput:
        """``out`` (``encode``'s) as this kind: its tensor read by the kind's ``outputs_of``."""
        return cls(out.request_id, cls.outputs_of(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.num_cached_tokens, out.finished, out.prompt)


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's: what ``LLM.embed`` returns per prompt (``outputs`` an EmbeddingOutput)."""
    __slots__ = ()
    outputs_of = EmbeddingOutput


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's: what ``LLM.classify`` returns per prompt (``outputs`` a ClassificationOutput)."""
    __slots__ = ()
    outputs_of = ClassificationOutput


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's: what ``LLM.score`` returns per pair (``outputs`` a ScoringOutput)."""
    __slots__ = ()


@dataclass(slots=True)
class GenerationResult:
    """A request's result, shaped as vLLM's ``RequestOutput`` (finished, or one output of an
    ``AsyncLLM`` stream): ``outputs`` holds the ``n`` sequences (``SamplingParams(n=...)``);
    ``text``, ``token_ids`` and ``finish_reason`` are the first one's. ``prompt_logprobs`` (when
    asked for): per prompt token, None for the first."""
    request_id: str
    prompt: Any
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    index: int = 0                           # the prompt's place in the list it came in
    kv_transfer_params: dict | None = None   # vLLM's: what another instance needs to read its KV
    # vLLM's: the scores of prompt_logprob_token_ids, float32 (prompt_len - 1 - prompt_logprob_start,
    # ids): row i scores the ids as prompt token prompt_logprob_start + i + 1; -inf at padding
    prompt_token_id_logprobs: np.ndarray | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens over all the sequences."""
        return sum(len(o.token_ids) for o in self.outputs)


class Progress:
    """A tqdm bar on standard error: requests done, output tokens per second, time left."""

    def __init__(self, total: int, desc: str, use_tqdm: Any = True) -> None:
        """``use_tqdm``: True, or vLLM's callable that makes the bar (e.g. functools.partial(tqdm,
        leave=False)), called with total, desc and dynamic_ncols."""
        if callable(use_tqdm):
            self.bar = use_tqdm(total=total, desc=desc, dynamic_ncols=True)
        else:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)
        self.started = time.monotonic()
        self.tokens = 0

    def update(self, output_tokens: int) -> None:
        self.tokens += output_tokens
        rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


FOREIGN_LOOP = ("this AsyncLLM serves on the event loop it was created on, which is not the running one "
                "(an asyncio.run that has ended?): create it inside the asyncio.run that uses it")


def _spans(versions: list[tuple[str, int, int]] | None) -> list[WeightVersionSpan] | None:
    return None if versions is None else [WeightVersionSpan(*v) for v in versions]


def _request_field(request: Any, field: str) -> Any:
    """vLLM's weight transfer request (an object with ``field``) or its dict, as its ``field``."""
    if isinstance(request, dict):
        if field not in request:
            raise ValueError(f"the request needs {field!r}: {{{field!r}: {{...}}}}")
        return request[field]
    if not hasattr(request, field):
        raise ValueError(f"the request needs {field!r}: {{{field!r}: {{...}}}}")
    return getattr(request, field)


def _on_its_loop(cls: type) -> type:
    """``cls`` with each public coroutine and async-generator method first checking that it runs
    on the instance's own event loop: from another one (a second ``asyncio.run``) its actors
    would never answer, so the call fails at once saying why."""
    async def check(self: Any) -> None:
        if getattr(self, "_args", None) is not None:     # made by vLLM's from_engine_args: started now
            await self._start()
        loop = getattr(self, "_loop", None)
        if loop is not None and asyncio.get_running_loop() is not loop:
            raise RuntimeError(FOREIGN_LOOP)

    def wrap(fn: Any) -> Any:
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def gen(self: Any, *args: Any, **kwargs: Any) -> Any:
                await check(self)
                inner = fn(self, *args, **kwargs)
                try:
                    async for item in inner:
                        yield item
                finally:                      # a reader that stops early closes it now (aborting)
                    await inner.aclose()
            return gen

        @functools.wraps(fn)
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            await check(self)
            return await fn(self, *args, **kwargs)
        return call
    for name, fn in list(vars(cls).items()):
        if not name.startswith("_") and name != "shutdown" and (
                inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            setattr(cls, name, wrap(fn))
    return cls


@_on_its_loop
class AsyncLLM:
    """vLLM's AsyncLLM. ``await AsyncLLM.create(model, **options)`` (or ``await
    AsyncLLM.from_engine_args(args)``) returns it started; vLLM's ``AsyncLLM.from_engine_args(args)``
    without ``await`` returns it unstarted, and its first awaited call starts it (loads the
    model) on the running event loop, the one it then serves on."""

    def __init__(self, frontend: Frontend | None = None, *, args: EngineArgs | None = None) -> None:
        self._fe: Frontend | None = None
        self.client: Any = None
        self._args = args
        self._starting: asyncio.Future | None = None
        self._token_text: TokenText | None = None
        self._choices: dict[str, list[str]] = {}      # a stream's request id -> its sequences' (n > 1)
        self._loop: asyncio.AbstractEventLoop | None = None
        if frontend is not None:
            self._started(frontend)

    def _started(self, frontend: Frontend) -> None:
        self._fe = frontend
        self.client = frontend.client
        self._loop = asyncio.get_running_loop()        # its actors' loop: the only one it serves on
        # never shut down (dropped, or still running when its asyncio.run ends): its processes
        # stop when it is collected or, at the latest, when the interpreter exits, as vLLM's do
        self._finalizer = weakref.finalize(self, _stop_abandoned, frontend, self._loop)

    async def _start(self) -> AsyncLLM:
        """Started (once, however many callers wait for it)."""
        if self._fe is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(start_frontend(self._args.create_engine_config()))
            frontend = await asyncio.shield(self._starting)
            if self._fe is None:
                self._started(frontend)
        return self

    def __await__(self) -> Any:
        return self._start().__await__()

    @classmethod
    async def create(cls, model: str | None = None, *, multiprocess: bool | None = None,
                     **engine_options: Any) -> AsyncLLM:
        if multiprocess is None:
            multiprocess = (max(engine_options.get("data_parallel_size", 1),
                                engine_options.get("tensor_parallel_size", 1),
                                engine_options.get("pipeline_parallel_size", 1)) > 1
                            or "ray" in (engine_options.get("distributed_executor_backend"),
                                         engine_options.get("data_parallel_backend")))
        return await cls.from_engine_args(
            EngineArgs.from_options(model, {**engine_options, "multiprocess": multiprocess}))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        """vLLM's: an AsyncLLM of ``args``, started by its first awaited call (or ``await``)."""
        return cls(args=args)

    def default_sampling_params(self) -> SamplingParams:
        """What a prompt given no SamplingParams samples with: vLLM's defaults, overridden by
        the model's generation_config.json under ``generation_config="auto"`` (as vLLM's
        ``LLM.get_default_sampling_params``)."""
        defaults = self.client.config.model.sampling_defaults
        return SamplingParams(**defaults.as_dict()) if defaults is not None else SamplingParams()

    async def generate(self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[GenerationResult]:
        """vLLM's: one text (or token-id, or vLLM prompt-dict) prompt's outputs as they are
        produced, each in the shape of vLLM's ``RequestOutput`` (the last has ``finished``):
        everything so far, only what is new, or only the finished request, as
        ``sampling_params.output_kind`` says (``RequestOutputKind.CUMULATIVE``, vLLM's default,
        ``DELTA``, ``FINAL_ONLY``). ``lora_request``: from the base model plus that adapter;
        ``priority``: as ``complete``'s."""
        what = (_prompt_dict(prompt) if isinstance(prompt, dict) else {"prompt": prompt}
                if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)})
        async for out in self._stream(prompt, {**what, "priority": priority}, sampling_params, request_id,
                                      lora_request):
            yield out

    async def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None, *,
                   request_id: str | None = None, lora_request: LoRARequest | None = None, priority: int = 0,
                   **template: Any) -> AsyncIterator[GenerationResult]:
        """``generate``'s outputs for one conversation rendered with the model's chat template."""
        async for out in self._stream(messages, {"messages": messages, "priority": priority, **_chat_options(**template)},
                                      sampling_params, request_id, lora_request):
            yield out

    async def _stream(self, prompt: Any, what: dict[str, Any], params: SamplingParams | None, request_id: str | None,
                      lora_request: LoRARequest | None) -> AsyncIterator[GenerationResult]:
        """The outputs of one prompt's request and its ``n`` sequences (vLLM's: with DELTA, each
        output holds the sequence that moved, under its ``index``; otherwise all ``n``)."""
        params = params or self.default_sampling_params()
        n = _sequences(params)
        if n > 1:
            params = msgspec.structs.replace(params, n=1)            # each choice is one sequence
        if lora_request is not None:
            what["lora_request"] = self.client.register_lora(lora_request)
        if params.stream_interval is not None:
            what["stream_interval"] = params.stream_interval
        request_id = request_id or self.client.new_request_id()
        choices = await submit_choices(self.client.submit, request_id, params, n, **what)
        self._choices[request_id] = [c.handle.request_id for c in choices]
        prompt_ids = list(choices[0].handle.prompt_token_ids)     # shared by the stream's outputs
        kind = params.output_kind
        totals: list[GenerationResult | None] = [None] * n            # each sequence's so far
        running = n
        try:
            async for c, out in merged_outputs(choices):
                i = c.index
                new = self._result(request_id, prompt, prompt_ids, params, [out], first=totals[i] is None)
                new.outputs[0].index = i
                running -= out.finished
                if kind == RequestOutputKind.DELTA:
                    new.finished = not running
                    totals[i] = new
                    yield new
                    continue
                if totals[i] is None:
                    new.outputs[0].token_ids = list(out.token_ids)       # the sequence's own, growing
                    totals[i] = new
                else:
                    _extended(totals[i], new)
                if kind == RequestOutputKind.CUMULATIVE or not running:
                    yield _snapshot(totals, not running)
        finally:
            self._choices.pop(request_id, None)
            close_all(choices)

    async def get_tokenizer(self) -> Any:
        return _text_tokenizer(self.client.tokenizer)

    @property
    def tokenizer(self) -> Any:
        """vLLM's: the tokenizer (None with skip_tokenizer_init)."""
        tok = self.client.tokenizer
        return None if tok is NO_TOKENIZER else _text_tokenizer(tok)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the engine serves: "generate", or a pooling model's tasks."""
        pooling = self.client.config.model.pooling
        return ("generate",) if pooling is None else pooling.tasks

    async def encode(self, prompt: Prompt, pooling_params: PoolingParams | None = None, *,
                     request_id: str | None = None, truncate_prompt_tokens: int | None = None,
                     priority: int = 0, tokenization_kwargs: dict[str, Any] | None = None,
                     lora_request: LoRARequest | None = None, **template: Any) -> PoolingRequestOutput:
        """vLLM's ``encode`` with a pooling model (``runner="pooling"``): one prompt (text, token
        ids, a prompt dict, or a conversation) through the model once, pooled as
        ``pooling_params`` asks (its task "embed" by default). ValueError for what the model
        cannot do; RuntimeError when the engine failed the request. A prompt dict's
        ``token_type_ids`` (vLLM's TokensPrompt's: zeros, then ones from the second text of a
        pair on) reach an encoder with token types (a BERT cross-encoder)."""
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            from actors.frontend.scoring import compress_token_types
            prompt = dict(prompt)
            start = compress_token_types(list(prompt.pop("token_type_ids")))
            pooling_params = msgspec.structs.replace(pooling_params or PoolingParams(), compressed_token_type_ids=start)
        what = _prompt_what(prompt, **template)
        if tokenization_kwargs:
            truncate_prompt_tokens = tokenization_kwargs.get("truncate_prompt_tokens", truncate_prompt_tokens)
        out, prompt_ids = await self.client.encode(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                                                   request_id=request_id, priority=priority,
                                                   lora_request=None if lora_request is None else
                                                   self.client.register_lora(lora_request),
                                                   **{"add_special_tokens": "messages" not in what, **what})
        if out is None or out.error is not None or out.pooling_output is None:
            raise RuntimeError(f"the pooling request failed: {out.error if out is not None else 'no output'}")
        import torch                    # vLLM's outputs hold tensors (the offline API's process has torch)
        data = out.pooling_output       # read-only when it came in a frame from another process: a copy of its own
        return PoolingRequestOutput(out.request_id, PoolingOutput(torch.from_numpy(
                                        data if data.flags.writeable else data.copy())),
                                    prompt_ids, out.num_cached_tokens, True, prompt)

    async def embed(self, prompt: Prompt, pooling_params: PoolingParams | None = None,
                    **kwargs: Any) -> EmbeddingRequestOutput:
        """vLLM's ``embed``: ``encode`` with task "embed", the vector as a list of floats."""
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task="embed")
        return EmbeddingRequestOutput.from_base(await self.encode(prompt, params, **kwargs))

    async def classify(self, prompt: Prompt, pooling_params: PoolingParams | None = None,
                       **kwargs: Any) -> ClassificationRequestOutput:
        """vLLM's ``classify``: ``encode`` with task "classify", the labels' probabilities."""
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task="classify")
        return ClassificationRequestOutput.from_base(await self.encode(prompt, params, **kwargs))

    async def is_tracing_enabled(self) -> bool:
        """vLLM's: whether requests' spans go to an OpenTelemetry endpoint (otlp_traces_endpoint)."""
        return self.client.config.observability.otlp_traces_endpoint is not None

    async def do_log_stats(self) -> None:
        """vLLM's: log the engine's statistics lines now (with log_stats; the periodic ones go on)."""
        if self.client.config.observability.log_stats:
            await self._fe.node.ref(topology.STAT_LOGGER).ask(LogStats(), timeout=60)

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: requests admitted and not finished (each of a request's n choices counts)."""
        return self.client.num_open

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: return once no request is unfinished; TimeoutError after ``drain_timeout`` s."""
        deadline = time.monotonic() + drain_timeout
        while self.client.num_open:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for requests to drain.")
            await asyncio.sleep(0.05)

    def get_kv_event_sources(self) -> dict[int, dict[str, Any]]:
        """vLLM's: per data-parallel rank, where its KV events are published (with kv_events_config)."""
        return kv_event_sources_of(self.client.config)

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """vLLM's: per worker, the SHA-256 of each tensor its model holds (see /weight_checker)."""
        return await self.client.compute_weight_checksums()

    async def reset_mm_cache(self) -> None:
        """vLLM's: the processor cache forgets its images (a model that takes images)."""
        if self.client.images is not None:
            self.client.images.clear()

    async def reset_encoder_cache(self) -> None:
        """vLLM's: every engine forgets its images' embeddings (encoded again when needed; for
        after the encoder's weights changed)."""
        await self.client.reset_encoder_cache()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; True once every engine has."""
        return await self.client.reset_prefix_cache()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (vLLM's, e.g. while a trainer updates the weights): ``abort`` aborts
        every request, ``wait`` lets the running ones finish, ``keep`` freezes every request
        where it is. Returns once nothing runs; requests submitted meanwhile queue until
        ``resume_generation``. ``clear_cache``: the prefix cache is then reset (not with keep)."""
        await self.client.pause_generation(mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.client.resume_generation()

    async def is_paused(self) -> bool:
        return await self.client.is_paused()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode (with ``enable_sleep_mode=True``): pause (``mode`` as
        pause_generation's), then give back the KV cache's memory (level 1) or that and the
        weights' (level 2; read again from the checkpoint at ``wake_up``). Level 0 only pauses."""
        await self.client.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Take back ``tags`` ("weights", "kv_cache"; None: everything); generation resumes once
        nothing is left asleep. Whether fully awake."""
        return await self.client.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self.client.is_sleeping()

    async def release_kv_cache_memory(self) -> None:
        """vLLM's: after ``sleep(level=0)`` (a completed pause, no request held), the KV cache's
        memory given back, the weights staying; ``wake_up(tags=["kv_cache"])`` restores it."""
        await self.client.release_kv_cache_memory()

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: a worker method by name on every worker, their results in rank order. Troupe's
        workers answer ``reload_weights`` (kwargs ``weights_path``: a checkpoint of the same
        architecture; none: the served one again), which reads the weights into the running model,
        the weight transfer methods, and those of ``worker_extension_cls``. A function instead is
        called in each worker with the worker and ``args`` (workers in other processes: with
        VLLM_ALLOW_INSECURE_SERIALIZATION=1, as in vLLM)."""
        return await self.client.collective_rpc(method, timeout, args, kwargs)

    async def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``func(model)`` in every worker, their results in rank order (see collective_rpc)."""
        return await self.client.apply_model(func)

    # -- weight transfer (vLLM's RL API, with weight_transfer_config; actors/worker/weight_transfer.py)
    async def init_weight_transfer_engine(self, request: Any) -> None:
        """Every worker joins the trainer's process group: ``request`` is vLLM's
        WeightTransferInitRequest or ``{"init_info": {...}}`` (master_address, master_port,
        rank_offset, world_size, packed, packed_buffer_size_bytes)."""
        await self.client.init_weight_transfer_engine(_request_field(request, "init_info"))

    async def shutdown_weight_transfer_engine(self) -> None:
        """The workers leave the trainer's group (the engine serves on)."""
        await self.client.shutdown_weight_transfer_engine()

    async def start_weight_update(self) -> None:
        await self.client.start_weight_update()

    async def start_draft_weight_update(self) -> None:
        """A round into speculative decoding's draft model."""
        await self.client.start_weight_update(draft=True)

    async def update_weights(self, request: Any) -> None:
        """One chunk of the round: ``request`` is vLLM's WeightTransferUpdateRequest or
        ``{"update_info": {"names": [...], "dtype_names": [...], "shapes": [...]}}``; the trainer
        broadcasts the tensors meanwhile."""
        await self.client.update_weights(_request_field(request, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The round's weights replace the served ones, all or nothing (ValueError naming what is
        missing); with ``weight_version``, the engine's version becomes it."""
        await self.client.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.client.update_weight_version(new_version)

    async def get_weight_version(self) -> str:
        """The weights' version: "default" until a round or update_weight_version names one."""
        return await self.client.get_weight_version()

    async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        """vLLM's: open a profiling session (needs ``profiler_config``, e.g. {"profiler": "torch",
        "torch_profiler_dir": "./traces"}): the workers record their steps, from ``delay_iterations``
        steps on and for at most ``max_iterations`` (None: the config's); traces named with
        ``profile_prefix``. ValueError without a profiler config or for a bad option; RuntimeError
        while a session is open."""
        await self.client.start_profile(profile_prefix, delay_iterations, max_iterations)

    async def stop_profile(self) -> None:
        """Close the session: each recorder writes its trace into the config's folder."""
        await self.client.stop_profile()

    async def complete(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       lora_request: LoRARequest | None = None, request_id: str | None = None,
                       priority: int = 0, _admitted: asyncio.Future | None = None,
                       **template: Any) -> GenerationResult:
        """One prompt (text, token ids, or a conversation: a list of messages, rendered with
        ``template``'s chat-template options) run to the end, its ``sampling_params.n`` sequences in one
        result (sequence i of a seeded request samples with ``seed + i``, as in vLLM). ``priority``:
        its place in the queue under ``scheduling_policy="priority"`` (lower first; vLLM's)."""
        sampling_params = sampling_params or self.default_sampling_params()
        n = _sequences(sampling_params)
        if n > 1:
            sampling_params = msgspec.structs.replace(sampling_params, n=1)   # each choice is one sequence
        what = _prompt_what(prompt, **template)
        if lora_request is not None:
            what["lora_request"] = self.client.register_lora(lora_request)
        request_id = request_id or self.client.new_request_id()
        try:
            choices = await submit_choices(self.client.submit, request_id, sampling_params, n, priority=priority,
                                           **what)
        except BaseException as exc:
            if _admitted is not None and not _admitted.done():
                if isinstance(exc, asyncio.CancelledError):
                    _admitted.cancel()
                else:
                    _admitted.set_exception(exc)
            raise
        if _admitted is not None:          # (LLM.enqueue waits for this: a refusal is raised there)
            _admitted.set_result(None)
        done: list[RequestOutput | None] = [None] * n
        try:
            async for c, out in merged_outputs(choices):
                acc = done[c.index]
                if acc is None:
                    done[c.index] = dataclasses.replace(out, token_ids=list(out.token_ids))
                else:
                    acc.merge(out)
        finally:
            close_all(choices)
        ids = choices[0].handle.prompt_token_ids
        return self._result(request_id, prompt, list(ids), sampling_params, done)  # type: ignore[arg-type]

    async def beam_search(self, prompt: Prompt, params: BeamSearchParams, *,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """vLLM's beam search (``actors.frontend.beam_search``) from one prompt: text, token ids,
        a prompt dict, or a conversation (a list of messages)."""
        what = _prompt_what(prompt)
        if lora_request is not None:
            what["lora_request"] = self.client.register_lora(lora_request)
        return await beam_search(self.client, params, **what)

    def _result(self, request_id: str, prompt: Any, prompt_token_ids: list[int], params: SamplingParams,
                done: list[RequestOutput], first: bool = True) -> GenerationResult:
        """The result of ``done`` (one whole output per sequence, or a stream's newest output:
        ``first`` False when it is not the stream's first, whose prompt log-probs start with the
        first token's None)."""
        if self._token_text is None:
            self._token_text = TokenText(self.client.tokenizer)
        text_of = self._token_text
        outputs = []
        for i, out in enumerate(done):
            lps = (_vllm_logprobs(out.logprobs, text_of, params.flat_logprobs)
                   if params.logprobs is not None and out.logprobs else None)
            cumulative = sum(position[0] for position in out.logprobs.logprobs) if lps is not None else None
            outputs.append(CompletionOutput(i, out.text, out.token_ids, cumulative, lps, out.finish_reason,
                                            out.stop_reason, (out.metrics or {}).get("speculative_decoding"),
                                            SamplingMask(out.sampling_mask) if out.sampling_mask is not None
                                            else None, _spans(out.weight_versions)))
        first_row = int(first)
        first = done[0]
        prompt_lps = None
        if params.prompt_logprobs is not None and first.prompt_logprobs is not None:
            prompt_lps = _vllm_logprobs(first.prompt_logprobs, text_of, params.flat_logprobs, bool(first_row))
        return GenerationResult(request_id, prompt, prompt_token_ids, outputs,
                                error=next((o.error for o in done if o.error), None),
                                num_cached_tokens=first.num_cached_tokens, prompt_logprobs=prompt_lps,
                                kv_transfer_params=first.kv_transfer_params,
                                prompt_token_id_logprobs=first.prompt_token_id_logprobs)

    async def generate_many(self, prompts: Iterable[Prompt],
                            sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                            max_pending: int = 1024, use_tqdm: bool | Callable[..., Any] = False,
                            **template: Any) -> AsyncIterator[GenerationResult]:
        """Results of many prompts (text, token ids, a vLLM prompt dict, or a conversation: a list
        of messages), in the order they finish; ``result.index`` is the prompt's place. At most ``max_pending``
        requests are in the engine or finished and not yet taken, so a long (even endless)
        input runs in bounded memory. ``sampling_params``: one for all, or one per prompt."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        per_prompt = sampling_params if isinstance(sampling_params, Sequence) else None
        slots = asyncio.Semaphore(max_pending)
        arrived: asyncio.Queue[Any] = asyncio.Queue()     # results, errors, then the count
        tasks: set[asyncio.Future] = set()
        bar = Progress(len(prompts), "Generating", use_tqdm) if use_tqdm and isinstance(prompts, Sized) else None

        async def one(i: int, prompt: Prompt, sp: SamplingParams | None) -> None:
            try:
                result = await self.complete(prompt, sp, **template)
                result.index = i
                arrived.put_nowait(result)
            except Exception as exc:
                arrived.put_nowait(exc)

        async def feed() -> None:
            n, it = 0, iter(prompts)
            try:
                for i in itertools.count():
                    await slots.acquire()           # a slot first: no prompt is read ahead of one
                    try:
                        prompt = next(it)
                    except StopIteration:
                        break
                    sp = per_prompt[i] if per_prompt is not None else sampling_params
                    task = asyncio.ensure_future(one(i, prompt, sp))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    n += 1
            except Exception as exc:          # the prompts' iterator failed: the consumer sees it
                arrived.put_nowait(exc)
            arrived.put_nowait(_Total(n))

        feeder = asyncio.ensure_future(feed())
        total, taken = None, 0
        try:
            while total is None or taken < total:
                item = await arrived.get()
                if isinstance(item, _Total):
                    total = item.n
                    continue
                if isinstance(item, BaseException):
                    raise item
                taken += 1
                slots.release()
                if bar is not None:
                    bar.update(item.num_output_tokens)
                yield item
        finally:
            feeder.cancel()
            for task in list(tasks):
                task.cancel()
            if bar is not None:
                bar.close()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """vLLM's: abort requests by the ``request_id`` they were generated with; each one's
        stream ends with finish reason "abort" (ids of no open request are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.client.abort_open([c for rid in ids for c in self._choices.get(rid, [rid])])

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: make an adapter known before a request uses it (validated now: InvalidAdapter
        says what is wrong); the workers load it when a request first runs with it."""
        self.client.register_lora(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forget the adapter of ``lora_id`` (requests running with it finish); False when
        no adapter has that id."""
        name = next((n for n, r in self.client.lora_requests.items() if r.lora_int_id == lora_id), None)
        return name is not None and self.client.remove_lora(name)

    async def list_loras(self) -> set[int]:
        """vLLM's: the ids of the adapters known."""
        return {r.lora_int_id for r in self.client.lora_requests.values()}

    async def pin_lora(self, lora_id: int) -> bool:
        """vLLM's: keep an added adapter resident: the workers read it now and evict it last
        (from their host cache and their layer slots). ValueError when no adapter has that id."""
        return self.client.pin_lora(lora_id)

    async def check_health(self) -> None:
        """vLLM's: raises EngineDeadError (saying why) when the engine has died or was shut down."""
        if self.errored:
            raise self.dead_error

    @property
    def errored(self) -> bool:
        """vLLM's: the engine died (or was shut down) and serves nothing more."""
        return self.client.dead is not None or self._fe.stopped

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(self.client.dead or SHUT_DOWN, self.client.retry_after)

    def shutdown(self) -> asyncio.Future | None:
        """Stop the engine: vLLM's (called without ``await``) or awaited (returns once all has
        stopped). Requests still running end with the error "the engine was shut down". Off its
        own event loop (that loop has ended), its processes are stopped at once."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._fe is not None and running is self._loop:
            task = running.create_task(self._fe.shutdown())
            _STOPPING.add(task)
            task.add_done_callback(_STOPPING.discard)
            return task
        if self._fe is not None:             # its loop is gone: stopped without it
            self._finalizer()
        elif self._starting is not None:     # never started
            self._starting.cancel()
        if running is None:
            return None
        done = running.create_future()       # nothing left to wait for, to whoever awaits
        done.set_result(None)
        return done


def _extended(total: GenerationResult, new: GenerationResult) -> GenerationResult:
    """``total`` (a stream's result so far) with ``new`` (its next output's) added."""
    acc, add = total.outputs[0], new.outputs[0]
    acc.text += add.text
    acc.token_ids.extend(add.token_ids)
    if add.logprobs is not None:
        if acc.logprobs is None:
            acc.logprobs = FlatLogprobs() if isinstance(add.logprobs, FlatLogprobs) else []
        acc.logprobs.extend(add.logprobs)
        acc.cumulative_logprob = (acc.cumulative_logprob or 0.0) + (add.cumulative_logprob or 0.0)
    if add.sampling_mask is not None:
        if acc.sampling_mask is None:
            acc.sampling_mask = SamplingMask([])
        acc.sampling_mask.token_ids.extend(add.sampling_mask.token_ids)
    acc.finish_reason, acc.stop_reason = add.finish_reason, add.stop_reason
    acc.spec_decode_metrics = add.spec_decode_metrics or acc.spec_decode_metrics
    acc.weight_versions = add.weight_versions or acc.weight_versions
    if new.prompt_logprobs:
        if total.prompt_logprobs is None and isinstance(new.prompt_logprobs, FlatLogprobs):
            total.prompt_logprobs = FlatLogprobs()
        if isinstance(total.prompt_logprobs, FlatLogprobs):
            total.prompt_logprobs.extend(new.prompt_logprobs)
        else:
            total.prompt_logprobs = (total.prompt_logprobs or []) + new.prompt_logprobs
    if new.prompt_token_id_logprobs is not None:
        total.prompt_token_id_logprobs = (new.prompt_token_id_logprobs if total.prompt_token_id_logprobs is None
                                          else np.concatenate([total.prompt_token_id_logprobs,
                                                               new.prompt_token_id_logprobs]))
    total.finished = new.finished
    total.error = new.error or total.error
    total.num_cached_tokens = max(total.num_cached_tokens, new.num_cached_tokens)
    total.kv_transfer_params = new.kv_transfer_params or total.kv_transfer_params
    return total


_STOPPING: set[asyncio.Task] = set()


async def _shut_down(llm: AsyncLLM) -> None:
    task = llm.shutdown()
    if task is not None:
        await task


def _stop_abandoned(fe: Frontend, own_loop: asyncio.AbstractEventLoop) -> None:
    if fe.stopped:
        return
    fe.stop_now()
    node = fe.node

    def close_transport(task: asyncio.Task | None = None) -> None:
        _STOPPING.discard(task)
        if node.transport is not None:       # its sockets (a context left open blocks its collection)
            node.transport.close()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not own_loop:                 # the actors' loop has ended (or is another thread's)
        close_transport()
        return
    # the frontend's own actors stop on the loop still running; the transport closes even when
    # that is cancelled (an asyncio.run ending)
    task = loop.create_task(node.stop())
    _STOPPING.add(task)
    task.add_done_callback(close_transport)


@dataclass(slots=True)
class _Total:
    n: int                               # how many prompts there were


Prompt = Union[str, list[int], list[dict[str, Any]], dict[str, Any]]
# vLLM's Text/Tokens/EmbedsPrompt (multi_modal_data: {"image": PIL image or a list}, a model taking images)
PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "cache_salt", "multi_modal_data", "mm_processor_kwargs")


def _prompt_what(prompt: Prompt, **template: Any) -> dict[str, Any]:
    """What the engine client takes of a prompt: text, token ids, a prompt dict, or a
    conversation (with ``template``'s chat-template options). Text is tokenized with the special
    tokens the tokenizer adds (BOS where it asks), as vLLM's LLM encodes it; a rendered
    conversation without (its template wrote them)."""
    if _is_conversation(prompt):
        return {"messages": prompt, **_chat_options(**template)}
    if isinstance(prompt, dict):
        return _prompt_dict(prompt)
    if isinstance(prompt, str):
        return {"prompt": prompt, "add_special_tokens": True}
    return {"prompt_token_ids": list(prompt)}               # type: ignore[arg-type]


def _chat_options(tools: list[dict[str, Any]] | None = None, **template: Any) -> dict[str, Any]:
    """A conversation's chat-template options, vLLM's ``tools`` among them: handed to the
    template (as a chat request's are), which renders them as the model expects."""
    if tools is not None:
        template["chat_template_kwargs"] = {"tools": tools, **(template.get("chat_template_kwargs") or {})}
    return template


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def _prompt_dict(prompt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's prompt dicts: ``{"prompt": text}``, ``{"prompt_token_ids": ids}`` or
    ``{"prompt_embeds": tensor}`` (with --enable-prompt-embeds: (tokens, hidden) input embeddings),
    with an optional ``cache_salt`` and, for a model that takes images, ``multi_modal_data``
    (``{"image": PIL image or a list of them}``, one per placeholder of the prompt); any other
    key is refused by name."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"prompt keys {unknown} are not supported; a prompt dict takes "
                         f"{', '.join(PROMPT_KEYS)}")
    if sum(key in prompt for key in ("prompt", "prompt_token_ids", "prompt_embeds")) != 1:
        raise ValueError("a prompt dict needs exactly one of 'prompt', 'prompt_token_ids' and 'prompt_embeds'")
    what: dict[str, Any]
    if "prompt_embeds" in prompt:
        what = {"prompt_embeds": embeds_array(prompt["prompt_embeds"])}
    elif "prompt_token_ids" in prompt:
        what = {"prompt_token_ids": list(prompt["prompt_token_ids"])}
    else:
        what = {"prompt": prompt["prompt"], "add_special_tokens": True}
    if prompt.get("cache_salt") is not None:
        what["cache_salt"] = prompt["cache_salt"]
    for key in ("multi_modal_data", "mm_processor_kwargs"):
        if prompt.get(key) is not None:
            what[key] = prompt[key]
    return what


def _prompt_list(prompts: Any) -> list[Any]:
    """``LLM.generate``'s prompts: one prompt (text, a prompt dict, token ids) or a list of them."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _conversation_list(messages: Any) -> list[Any]:
    """``LLM.chat``'s conversations: one (a list of messages) or a list of them."""
    return [messages] if messages and isinstance(messages[0], dict) else list(messages)


def _per_prompt(value: Any, n: int, what: str) -> list[Any]:
    """One value for every prompt, or a sequence of one per prompt."""
    values = list(value) if isinstance(value, Sequence) else [value] * n
    if len(values) != n:
        raise ValueError(f"{len(values)} {what} for {n} prompts")
    return values


def _sequences(params: SamplingParams) -> int:
    n = params.n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    return n


def _snapshot(totals: list[GenerationResult | None], finished: bool) -> GenerationResult:
    """A stream's result so far: each sequence's (one not started yet: empty); its lists are
    the sequences' own, which grow as vLLM's do."""
    head = totals[0] or next(t for t in totals if t is not None)
    outputs = [dataclasses.replace(t.outputs[0]) if t is not None else CompletionOutput(i, "", [])
               for i, t in enumerate(totals)]
    return dataclasses.replace(head, outputs=outputs, finished=finished,
                               error=next((t.error for t in totals if t is not None and t.error), None))


def _vllm_logprobs(lp: Logprobs, text_of: TokenText, flat: bool = False,
                   first: bool = False) -> list[dict[int, Logprob] | None] | FlatLogprobs:
    """Positions of ``lp`` (the chosen token first, then the top alternatives) as vLLM's
    ``{token_id: Logprob}`` per position: the chosen token with its rank, alternative i with rank i;
    ``flat``: as FlatLogprobs. ``first``: a None position first (the prompt's first token)."""
    if not flat:
        return [None] * first + [{tok: Logprob(value, rank, text_of(tok)[0]) for tok, (value, rank) in entry.items()}
                                 for entry in ranked_positions(lp)]
    out = FlatLogprobs()
    if first:
        out.append(None)
    for entry in ranked_positions(lp):
        out.start_indices.append(len(out.logprobs))
        for tok, (value, rank) in entry.items():
            out.append_entry(tok, value, rank, text_of(tok)[0])
        out.end_indices.append(len(out.logprobs))
    return out


CLOSED = "this LLM is closed: create another to generate"


CANCEL_WAIT_S = 10.0      # how long an interrupted call waits for its coroutine to stop


class _LoopThread:
    """What an ``LLM`` runs on: an event loop in a background thread and the engine on it. Nothing
    here refers back to the ``LLM``, so the finalizer that stops them runs when the ``LLM`` is
    collected or, at the latest, when the interpreter exits (vLLM's ``LLM`` is used without
    closing it: its engine must not outlive the script, nor leave its tasks pending)."""

    def __init__(self) -> None:
        import uvloop
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="troupe-llm", daemon=True)
        self.thread.start()
        self.llm: AsyncLLM | None = None

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """``coro``'s result, run on the loop. Interrupted (Ctrl-C) or timed out, it is cancelled
        and waited for (briefly): what it had submitted is aborted, not left running."""
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError(CLOSED)
        started, finished = threading.Event(), threading.Event()

        async def body() -> Any:
            started.set()
            try:
                return await coro
            finally:
                finished.set()
        future = asyncio.run_coroutine_threadsafe(body(), self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            if started.is_set():
                finished.wait(CANCEL_WAIT_S)
            raise

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if threading.current_thread() is self.thread:     # collected on its own loop: cannot wait there
            self.loop.call_soon(self.loop.stop)
            return
        try:
            if llm is not None and self.loop.is_running():
                self.run(_shut_down(llm), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.loop.is_running():
                self.loop.close()


class LLM:
    """Synchronous front of AsyncLLM: its event loop runs in a background thread. ``close()`` (or
    a ``with`` block) stops the engine; otherwise it stops when the object is collected or the
    interpreter exits."""

    def __init__(self, model: str | None = None, *, multiprocess: bool | None = None,
                 **engine_options: Any) -> None:
        engine_options.setdefault("disable_log_stats", True)      # vLLM's LLM logs no statistics
        self._start(lambda: AsyncLLM.create(model, multiprocess=multiprocess, **engine_options))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """vLLM's: an LLM of ``engine_args`` (``EngineArgs.from_options(model, {...})``)."""
        llm = cls.__new__(cls)
        llm._start(lambda: AsyncLLM.from_engine_args(engine_args))
        return llm

    def _start(self, create: Any) -> None:
        self._thread = _LoopThread()
        self._queued: list[asyncio.Future] = []       # enqueue()'s runs, for wait_for_completion()
        self._finalizer = weakref.finalize(self, self._thread.close)
        try:
            self._thread.llm = self._run(create())
        except BaseException:
            self._finalizer()
            raise

    @property
    def _llm(self) -> AsyncLLM | None:
        return self._thread.llm

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._thread.loop

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return self._thread.run(coro, timeout)

    @property
    def client(self) -> Any:
        """The engine client: its ``stats`` are the engine's statistics as /metrics shows them."""
        return self._engine().client

    def generate(self, prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[GenerationResult]:
        """Generate for every prompt concurrently (they share engine steps); results in order.
        ``sampling_params``: one for all prompts, or one per prompt; ``lora_request`` likewise (vLLM's
        argument: the adapter each prompt runs with, None for the base model), and ``priority``
        (vLLM's: the queue order under ``scheduling_policy="priority"``, lower first)."""
        return self._batch(self._jobs(_prompt_list(prompts), sampling_params, lora_request, priority), use_tqdm)

    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None
               = None, *, pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable[..., Any] = True, priority: int | Sequence[int] | None = None,
               tokenization_kwargs: dict[str, Any] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode`` for a pooling model (``runner="pooling"``, or ``convert="embed"``):
        every prompt (text, token ids, a prompt dict) pooled concurrently, results in order.
        ``pooling_task``: "embed" (one vector per prompt) or "token_embed" (one per token); it
        sets the task of ``pooling_params`` (one for all prompts, or one per prompt)."""
        items = _prompt_list(prompts)
        params = _per_prompt(pooling_params, len(items), "pooling params")
        if pooling_task is not None:
            params = [msgspec.structs.replace(p or PoolingParams(), task=pooling_task) for p in params]
        priorities = _per_prompt(priority or 0, len(items), "priorities")
        loras = _per_prompt(lora_request, len(items), "LoRA requests")

        async def run_all() -> list[PoolingRequestOutput]:
            bar = Progress(len(items), "Processed prompts", use_tqdm) if use_tqdm and len(items) > 1 else None

            async def one(prompt: Prompt, p: PoolingParams | None, prio: int, lora: LoRARequest | None
                          ) -> PoolingRequestOutput:
                out = await self._engine().encode(prompt, p, truncate_prompt_tokens=truncate_prompt_tokens,
                                                  priority=prio, tokenization_kwargs=tokenization_kwargs,
                                                  lora_request=lora)
                if bar is not None:
                    bar.update(0)
                return out
            try:
                return list(await asyncio.gather(*(one(x, p, r, a) for x, p, r, a in
                                                   zip(items, params, priorities, loras))))
            finally:
                if bar is not None:
                    bar.close()
        return self._run(run_all())

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams] | None
              = None, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable[..., Any] = True,
              priority: int | Sequence[int] | None = None,
              tokenization_kwargs: dict[str, Any] | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: ``encode`` with task "embed", each result's
        ``outputs.embedding`` a list of floats."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, pooling_task="embed", truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, priority=priority, tokenization_kwargs=tokenization_kwargs, lora_request=lora_request)]

    def classify(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable[..., Any] = True,
                 priority: int | Sequence[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` for a classifier (``convert="classify"``, or a
        ``...ForSequenceClassification`` checkpoint): each result's ``outputs.probs``."""
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, pooling_task="classify", truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, priority=priority, tokenization_kwargs=tokenization_kwargs, lora_request=lora_request)]

    def score(self, data_1: Prompt | Sequence[Prompt], data_2: Prompt | Sequence[Prompt], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable[..., Any] = True,
              pooling_params: PoolingParams | None = None, chat_template: str | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one ``data_1`` against every ``data_2``, or the two paired one
        to one (ValueError otherwise). An embedding model's score is the cosine similarity of
        the pair's embeddings; a cross-encoder's (a classifier of one label) its score of the
        pair read together (``chat_template``: a score template, Jinja, that renders the pair as
        a "query" and a "document" message)."""
        first, second = _prompt_list(data_1), _prompt_list(data_2)
        if not first or not second:
            raise ValueError("At least one text element must be given")
        if len(first) not in (1, len(second)):
            raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
        pooling = self.client.config.model.pooling
        if pooling is not None and pooling.convert == "classify":       # a cross-encoder reads each pair
            if pooling.num_labels != 1:
                raise ValueError(f"scoring pairs needs a cross-encoder (a classifier of one label); this model has "
                                 f"{pooling.num_labels} labels: use LLM.classify")
            if not all(isinstance(p, str) for p in first + second):
                raise ValueError("a cross-encoder scores texts: give data_1 and data_2 as strings")
            from actors.frontend.scoring import pair_prompt
            t = truncate_prompt_tokens
            pairs = [pair_prompt(self.client.tokenizer, pooling.use_sep_token, q, d, template=chat_template,
                                 max_length=self.client.max_model_len if t == -1 else t)
                     for q, d in zip(first * len(second) if len(first) == 1 else first, second)]
            base = pooling_params or PoolingParams()
            per_pair = [base if types is None else msgspec.structs.replace(base, compressed_token_type_ids=types)
                        for _, types in pairs]
            outs = self.classify([{"prompt_token_ids": ids} for ids, _ in pairs], per_pair,
                                 truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                                 lora_request=lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids,
                                         o.num_cached_tokens) for o in outs]
        from actors.frontend.scoring import late_interaction, pair_score
        late = late_interaction(pooling)         # token embeddings, ColBERT's MaxSim (vLLM's late interaction)
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task="token_embed" if late else "embed")
        outs = self.encode(first + second, params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request)
        queries, docs = outs[:len(first)], outs[len(first):]
        if len(queries) == 1:
            queries = queries * len(docs)
        results = []
        for q, d in zip(queries, docs):
            score = pair_score(q.outputs.data.numpy(), d.outputs.data.numpy(), late)
            results.append(ScoringRequestOutput(f"{q.request_id}_{d.request_id}", ScoringOutput(score),
                                                q.prompt_token_ids + d.prompt_token_ids,
                                                q.num_cached_tokens + d.num_cached_tokens))
        return results

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             priority: int | Sequence[int] | None = None, **template: Any) -> list[GenerationResult]:
        """Reply to one conversation (a list of messages) or to each of several (vLLM's
        arguments; ``template``: the chat template's options, e.g. ``add_generation_prompt``)."""
        return self._batch(self._jobs(_conversation_list(messages), sampling_params, lora_request, priority,
                                      **template), use_tqdm)

    def enqueue(self, prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                priority: int | Sequence[int] | None = None, use_tqdm: bool | Callable[..., Any] = True) -> list[str]:
        """vLLM's: submit the prompts (``generate``'s arguments) without waiting; returns their
        request ids. They run at once, beside anything else submitted; ``wait_for_completion()``
        returns the results of everything enqueued."""
        return self._enqueue(self._jobs(_prompt_list(prompts), sampling_params, lora_request, priority))

    def enqueue_chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                     use_tqdm: bool | Callable[..., Any] = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     priority: int | Sequence[int] | None = None, **template: Any) -> list[str]:
        """vLLM's: ``enqueue`` for conversations (``chat``'s arguments)."""
        return self._enqueue(self._jobs(_conversation_list(messages), sampling_params, lora_request, priority,
                                        **template))

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool | Callable[..., Any] = True) -> list[GenerationResult]:
        """vLLM's: the results of every request enqueued since the last call, once all have
        finished, in the order they were enqueued (a request that failed: its result's ``error``).
        ``output_type`` is vLLM's argument (the results are always GenerationResults here)."""
        queued, self._queued = self._queued, []

        async def gather() -> list[GenerationResult]:
            bar = Progress(len(queued), "Generating", use_tqdm) if use_tqdm and len(queued) > 1 else None
            try:
                for task in asyncio.as_completed(queued):
                    result = await task
                    if bar is not None:
                        bar.update(result.num_output_tokens)
            finally:
                if bar is not None:
                    bar.close()
            return [task.result() for task in queued]
        return self._run(gather()) if queued else []

    def _jobs(self, prompts: list[Any], sampling_params: Any, lora_request: Any, priority: Any,
              **template: Any) -> list[Any]:
        """One job (a coroutine function running one prompt) per prompt, its parameters checked."""
        per_prompt = self._checked(_per_prompt(sampling_params, len(prompts), "sampling parameters"))
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        priorities = _per_prompt(priority or 0, len(prompts), "priorities")
        return [functools.partial(self._engine().complete, p, sp, lora_request=lr, priority=pr, **template)
                for p, sp, lr, pr in zip(prompts, per_prompt, loras, priorities)]

    def _enqueue(self, jobs: list[Any]) -> list[str]:
        engine = self._engine()

        async def start() -> list[str]:
            """Every job admitted (a refusal, e.g. a prompt too long, is raised here, and the
            call's other requests are aborted, as vLLM's enqueue does), then left running."""
            ids = [engine.client.new_request_id() for _ in jobs]
            admitted = [asyncio.get_running_loop().create_future() for _ in jobs]
            tasks = [asyncio.ensure_future(job(request_id=rid, _admitted=a)) for job, rid, a in zip(jobs, ids, admitted)]
            try:
                await asyncio.gather(*admitted)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, *admitted, return_exceptions=True)   # every one retrieved
                raise
            self._queued.extend(tasks)
            return ids
        return self._run(start())

    def generate_many(self, prompts: Iterable[Prompt],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                      max_pending: int = 1024, use_tqdm: bool | Callable[..., Any] = True,
                      **template: Any) -> Iterator[GenerationResult]:
        """``AsyncLLM.generate_many`` for a synchronous caller: results as they finish, in
        bounded memory."""
        results = self._engine().generate_many(prompts, sampling_params, max_pending=max_pending, use_tqdm=use_tqdm,
                                               **template)
        try:
            while True:
                try:
                    yield self._run(results.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running():     # not after close(): the engine is gone already
                self._run(results.aclose(), timeout=60)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool | Callable[..., Any] = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: for each prompt (text, token ids, a prompt dict, or a
        conversation) the best ``params.beam_width`` sequences; at most ``concurrency_limit``
        prompts searched at once (None: all)."""
        one_prompt = isinstance(prompts, (str, dict)) or (bool(prompts) and (
            isinstance(prompts[0], int) or (isinstance(prompts[0], dict) and "role" in prompts[0])))
        if one_prompt:                # text, a prompt dict, token ids, or one conversation
            prompts = [prompts]  # type: ignore[list-item]
        params.check()
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        limit = asyncio.Semaphore(concurrency_limit or max(len(prompts), 1))

        async def run_all() -> list[BeamSearchOutput]:
            bar = Progress(len(prompts), "Beam search", use_tqdm) if use_tqdm and len(prompts) > 1 else None

            async def one(prompt: Prompt, lr: LoRARequest | None) -> BeamSearchOutput:
                async with limit:
                    out = await self._engine().beam_search(prompt, params, lora_request=lr)
                if bar is not None:
                    bar.update(sum(len(s.tokens) - len(out.prompt_token_ids) for s in out.sequences))
                return out
            try:
                return list(await asyncio.gather(*(one(p, lr) for p, lr in zip(prompts, loras))))
            finally:
                if bar is not None:
                    bar.close()
        return self._run(run_all())

    def _batch(self, jobs: list[Any], use_tqdm: bool | Callable[..., Any]) -> list[GenerationResult]:
        async def run_all() -> list[GenerationResult]:
            bar = Progress(len(jobs), "Generating", use_tqdm) if use_tqdm and len(jobs) > 1 else None

            async def one(make: Any) -> GenerationResult:
                result = await make()
                if bar is not None:
                    bar.update(result.num_output_tokens)
                return result
            try:
                results = list(await asyncio.gather(*(one(m) for m in jobs)))
                for i, r in enumerate(results):
                    r.index = i
                return results
            finally:
                if bar is not None:
                    bar.close()
        return self._run(run_all())

    def _checked(self, params: list[SamplingParams | None]) -> list[SamplingParams | None]:
        """ValueError before anything runs when one of them asks what the engine cannot do (as
        vLLM checks every request before adding any)."""
        config = self._engine().client.config.model
        for i, sp in enumerate(params):
            if sp is not None:
                try:
                    sp.check(config.arch.vocab_size, config.max_logprobs)
                except ValueError as exc:
                    raise ValueError(f"sampling parameters of prompt {i}: {exc}") from None
        return params

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a Hugging Face ``PreTrainedTokenizerFast``), as vLLM's."""
        return _text_tokenizer(self._engine().client.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no sampling parameters samples with (vLLM's name; see
        ``AsyncLLM.default_sampling_params``)."""
        return self._engine().default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's; the server's POST /reset_prefix_cache); blocks in
        use keep their contents. True once every engine has."""
        return self._run(self._engine().reset_prefix_cache(), timeout=60)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the workers of one engine core (tensor-parallel ranks times pipeline stages),
        times the engine cores with ``include_dp``."""
        p = self._engine().client.config.parallel
        return p.world_size * (p.data_parallel_size if include_dp else 1)

    def reset_mm_cache(self) -> None:
        """vLLM's: the processor cache forgets its images (a model that takes images)."""
        self._run(self._engine().reset_mm_cache())

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's metrics, those the server's /metrics has under ``vllm:``, as
        ``actors.frontend.metrics_reader``'s Counter, Gauge, Histogram and Vector objects."""
        engine = self._engine()

        async def text() -> str:           # read on the loop that updates them
            return engine.client.stats.prometheus(("vllm",))
        return metrics_snapshot(self._run(text(), timeout=60))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``LLM.sleep``: see ``AsyncLLM.sleep`` (needs ``enable_sleep_mode=True``)."""
        self._run(self._engine().sleep(level, mode), timeout=600)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's ``LLM.wake_up``: the weights and the KV cache back; whether fully awake."""
        return self._run(self._engine().wake_up(tags), timeout=600)

    def is_sleeping(self) -> bool:
        return self._run(self._engine().is_sleeping(), timeout=60)

    def release_kv_cache_memory(self) -> None:
        """vLLM's ``LLM.release_kv_cache_memory``: see ``AsyncLLM.release_kv_cache_memory``."""
        self._run(self._engine().release_kv_cache_memory(), timeout=600)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's ``LLM.collective_rpc``: see ``AsyncLLM.collective_rpc``."""
        return self._run(self._engine().collective_rpc(method, timeout, args, kwargs),
                         timeout=(timeout or 600) + 30)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's ``LLM.apply_model``: ``func(model)`` in every worker, their results in rank order."""
        return self._run(self._engine().apply_model(func), timeout=630)

    def init_weight_transfer_engine(self, request: Any) -> None:
        """vLLM's: see ``AsyncLLM.init_weight_transfer_engine``."""
        self._run(self._engine().init_weight_transfer_engine(request), timeout=660)

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self._engine().shutdown_weight_transfer_engine(), timeout=660)

    def start_weight_update(self) -> None:
        self._run(self._engine().start_weight_update(), timeout=660)

    def start_draft_weight_update(self) -> None:
        self._run(self._engine().start_draft_weight_update(), timeout=660)

    def update_weights(self, request: Any) -> None:
        """vLLM's: see ``AsyncLLM.update_weights``."""
        self._run(self._engine().update_weights(request), timeout=660)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self._engine().finish_weight_update(weight_version), timeout=660)

    def update_weight_version(self, new_version: str) -> None:
        self._run(self._engine().update_weight_version(new_version), timeout=60)

    def get_weight_version(self) -> str:
        return self._run(self._engine().get_weight_version(), timeout=60)

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """vLLM's ``LLM.start_profile``: see ``AsyncLLM.start_profile``."""
        self._run(self._engine().start_profile(profile_prefix, delay_iterations=delay_iterations,
                                               max_iterations=max_iterations), timeout=600)

    def stop_profile(self) -> None:
        """vLLM's ``LLM.stop_profile``: the traces written."""
        self._run(self._engine().stop_profile(), timeout=600)

    def _engine(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError(CLOSED)
        return self._llm

    def close(self) -> None:
        """Stop the engine and let go of it: its weights and KV cache are freed even while this
        object is still referred to."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _text_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer``; with --skip-tokenizer-init (none loaded) vLLM's ValueError."""
    if not tokenizer.has_text:
        raise ValueError(NO_TOKENIZER)
    return tokenizer
