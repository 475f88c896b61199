"""EngineClient: what an HTTP handler or an AsyncLLM iterator uses to run one request.

It opens the request's output stream, asks the Tokenizer to admit the request, then yields
outputs until the request finishes. A caller that stops early (a client disconnect, a
cancelled task) aborts the request in the engine, so its KV blocks are freed."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import numpy as np

from actors.detokenizer.actor import EndGroup, EngineLost, Untrack
from actors.engine.config import CHAT_TEMPLATE_CONTENT_FORMATS, EngineConfig
from actors.engine.lora import LoRARequest
from actors.frontend.admission import Overloaded, WaitingRequests
from actors.engine.pooling import PoolingParams
from actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from actors.frontend.stats import EngineStats
from actors.grammar.actor import CompileGrammar, InvalidGrammar
from actors.frontend.streams import OutputStream, OutputStreams, RequestOutput, StreamTimeout
from actors.kv_manager.actor import ResetPrefixCache
from actors.runtime import ActorRef, RemoteError
from actors.engine.profiler import check_bounds, check_prefix
from actors.scheduler.actor import (PAUSE_MODES, SLEEP_TIMEOUT_S, AbortRequests, GetPauseStatus, PauseScheduler,
                                    PauseStatus, PinLoRA, ProfileEngine, RemoveLoRA, ResetEncoderCache, ResumeScheduler,
                                    SleepEngine, WakeEngine, WeightVersion)
from actors.tokenizer.actor import Generate, InvalidPrompt, PromptTooLong
from actors.engine.messages import CALLABLE
from actors.worker.actor import WorkerRPC
from actors.tokenizer.gguf_tokenizer import TextTokenizer
from actors.runtime.otel import request_trace_headers

if TYPE_CHECKING:
    from actors.frontend.request_log import OutputLog
    from actors.tokenizer.multimodal import ImageProcessor

# Longest time a request waits for output while the engine runs nothing at all before it is
# failed (nothing hangs); a request queued behind others waits as long as the engine progresses.
DEFAULT_STALL_TIMEOUT_S = 600.0
GRAMMAR_TIMEOUT_S = 120.0
PAUSE_POLL_S = 0.02             # how often a pause that waits for the running requests looks again


log = logging.getLogger("troupe.client")
_WARNED: set[str] = set()           # warnings given once per process

class EngineDeadError(RuntimeError):
    """The engine is gone (for now: ``retry_after`` seconds is when it may be back; None when it
    will not be); no request can be served."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


class ProfilerAlreadyActive(RuntimeError):
    """/start_profile while a session is open (vLLM's 409)."""


class EngineClient:
    """``config``: the engine's resolved config. ``engine``: the scheduler (or, with data
    parallelism, the router before the engine cores' schedulers), where requests and aborts go;
    ``kv_managers``: each engine core's KV manager."""

    def __init__(self, config: EngineConfig, tokenizer: TextTokenizer, tokenizer_actor: ActorRef,
                 detokenizer: ActorRef, engine: ActorRef, kv_managers: list[ActorRef], grammar: ActorRef,
                 streams: OutputStreams, stats: EngineStats, waiting: WaitingRequests,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.config = config
        self.waiting = waiting
        self.tokenizer = tokenizer
        self.tokenizer_actor = tokenizer_actor
        self.images: ImageProcessor | None = None     # a model that takes images: its processor (and its cache)
        self.detokenizer = detokenizer
        self.engine = engine
        self.kv_managers = kv_managers          # each engine core's (data parallelism: several)
        self.grammar = grammar
        self.streams = streams
        self.stats = stats
        self.stall_timeout_s = stall_timeout_s
        self.dead: str | None = None           # why no request can be served now
        self.retry_after: float | None = None  # while ``dead``: seconds until it may be back
        self.draining: str | None = None       # why no new request is taken (running ones finish)
        self.pause_mode: str | None = None     # while generation is paused (pause_generation): its mode
        self.sleep_level: int | None = None    # while asleep (sleep mode): the level
        self.profiling = False                 # a --profiler-config session is open (/start_profile)
        self._frontend_profiler: Any = None    # this process's recorder (actors/worker/profiler.py)
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"
        self.lora_requests: dict[str, LoRARequest] = {}    # served adapters, by name
        self._lora_ids = itertools.count(1)
        for m in config.lora.lora_modules if config.lora is not None else ():
            self.add_lora(m.name, m.path, m.base_model_name)

    # -- LoRA adapters -------------------------------------------------------------------------
    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the PEFT adapter at ``path`` as model ``name``, once it validates against the
        model (models/lora.py raises InvalidAdapter saying what is wrong; nothing changes then).
        The worker reads it when a request first needs it."""
        from models.lora import InvalidAdapter, check_adapter
        lora = self.config.lora
        if lora is None:
            raise InvalidAdapter("LoRA adapters are not enabled (start with --enable-lora)")
        if name in self.lora_requests or name in self.model_names:
            raise InvalidAdapter(f"The lora adapter '{name}' has already been loaded.")
        check_adapter(path, self.config.model.arch, lora.max_lora_rank)
        taken = {r.lora_int_id for r in self.lora_requests.values()}
        lora_id = next(i for i in self._lora_ids if i not in taken)
        parent = base_model_name if base_model_name in self.model_names else None   # vLLM ignores any other
        req = LoRARequest(name, lora_id, path, parent)
        self.lora_requests[name] = req
        return req

    def register_lora(self, req: LoRARequest) -> LoRARequest:
        """The offline API's ``LoRARequest``, validated the first time it is seen; its id must
        name no other adapter."""
        if self.lora_requests.get(req.lora_name) == req:
            return req
        from models.lora import InvalidAdapter, check_adapter
        if self.config.lora is None:
            raise InvalidAdapter("LoRA adapters are not enabled (pass enable_lora=True)")
        other = next((r for r in self.lora_requests.values() if r.lora_int_id == req.lora_int_id), None)
        if other is not None and other.lora_name != req.lora_name:
            raise InvalidAdapter(f"lora_int_id {req.lora_int_id} already names adapter {other.lora_name!r}")
        check_adapter(req.lora_path, self.config.model.arch, self.config.lora.max_lora_rank)
        self.lora_requests[req.lora_name] = req
        return req

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name`` (requests already running with it finish); False when
        there is no such adapter. The workers drop it from their slots and host cache before
        their next step."""
        req = self.lora_requests.pop(name, None)
        if req is None:
            return False
        if self.dead is None:
            self.engine.tell(RemoveLoRA(req.lora_int_id))
        return True

    def pin_lora(self, lora_id: int) -> bool:
        """vLLM's pin_lora: the workers read adapter ``lora_id`` now and evict it last from their
        host cache and layer slots. ValueError (vLLM's words) when no adapter has that id."""
        req = next((r for r in self.lora_requests.values() if r.lora_int_id == lora_id), None)
        if req is None:
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        if self.dead is None:
            self.engine.tell(PinLoRA(req))
        return True

    @property
    def thinking_budgets(self) -> bool:
        """Whether requests may set thinking_token_budget (the engine knows its reasoning tags)."""
        reasoning = self.config.model.reasoning
        return reasoning is not None and reasoning.resolved

    def lora_request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model field names (None: the base model)."""
        return self.lora_requests.get(model) if model is not None else None

    @property
    def model_name(self) -> str:
        """The name responses report (the first --served-model-name)."""
        return self.config.model.served_model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give as its model."""
        return self.config.model.model_names

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.model.arch.vocab_size

    def new_request_id(self) -> str:
        return f"req-{self._prefix}-{next(self._ids)}"

    def mark_dead(self, reason: str, retry_after: float | None = None) -> None:
        """The engine died: fail every open request now and refuse new ones (until
        ``mark_alive``, when it is being restarted)."""
        self.dead, self.retry_after = reason, retry_after
        self.detokenizer.tell(EngineLost(reason))

    def mark_alive(self) -> None:
        self.dead = self.retry_after = None
        if self.pause_mode is not None:        # a restarted engine core starts unpaused: pause it too
            self.engine.tell(PauseScheduler("keep" if self.pause_mode == "keep" else "wait", False))

    def drain(self, reason: str) -> None:
        """Take no new request (``reason``); those admitted go on to the end."""
        self.draining = reason

    @property
    def num_open(self) -> int:
        """Requests admitted or being admitted, not yet closed."""
        return len(self.streams)

    def _warn_unwatermarked(self, params: SamplingParams) -> None:
        """vLLM's warnings (once each) for a request that asks for the watermark and cannot have it."""
        if self.config.watermark is None:
            why = ("Watermarking is enabled for this request, but the engine has no watermark configuration. "
                   "This and subsequent requests will run without watermarking.")
        elif params.greedy:
            why = ("Watermarking is enabled, but greedy decoding (temperature=0) cannot be watermarked. This "
                   "request will use ordinary greedy sampling.")
        else:
            return
        if why not in _WARNED:
            _WARNED.add(why)
            log.warning(why)

    async def submit(self, params: SamplingParams, *, request_id: str | None = None,
                     prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     priority: int = 0, arrival_time: float = 0.0,
                     add_special_tokens: bool = False, cache_salt: str | None = None,
                     timeout_s: float | None = None, parent_id: str = "", n: int = 1,
                     lora_request: LoRARequest | None = None, truncation_side: str | None = None,
                     chat_template: str | None = None, stream_interval: int = 1,
                     render_only: bool = False, return_token_offsets: bool = False,
                     chat_template_content_format: str | None = None,
                     prompt_embeds: np.ndarray | None = None,
                     multi_modal_data: dict[str, Any] | None = None,
                     mm_processor_kwargs: dict[str, Any] | None = None,
                     media_io_kwargs: dict[str, Any] | None = None) -> RequestHandle | RenderedPrompt:
        """Admit one request; ``timeout_s``: it is aborted (its KV freed) if it has not finished
        that long after now. ``parent_id`` and ``n``: it is one of the n choices of request
        ``parent_id`` (for the metrics of requests with n > 1; see ``end_group``).
        ``render_only``: check and tokenize it as it would be admitted, and return that (a
        RenderedPrompt) without admitting it (vLLM's /render endpoints; ``return_token_offsets``:
        with each token's characters in the prompt text). ``chat_template_content_format``: how
        ``messages``' content reaches the chat template (None: the server's setting).
        ``prompt_embeds``: the prompt as input embeddings, (tokens, hidden) float32 (vLLM's).
        ``multi_modal_data``: ``{"image": image or [images]}`` for a text or token-ids prompt
        holding as many image placeholders (vLLM's; a chat's images are its messages' parts);
        ``mm_processor_kwargs``: the checkpoint processor's keywords for them (vLLM's);
        ``media_io_kwargs``: how its videos are read (vLLM's, ``{"video": {"num_frames": 8}}``).
        ``stream_interval``: new tokens per output after the first (vLLM's). Raises
        InvalidPrompt (or PromptTooLong) when it is refused, Overloaded when too many wait
        already, and EngineDeadError when the engine is gone or the server is shutting down."""
        if (params.pooling is None) != (self.config.model.pooling is None):
            raise InvalidPrompt("this model embeds or classifies (--runner pooling): it answers pooling requests "
                                "(encode, embed, classify, score), not generation" if params.pooling is None else
                                "this model generates text: pooling requests need --runner pooling")
        if params.watermarking:
            self._warn_unwatermarked(params)
        if self.config.model.return_sampling_mask:         # vLLM's rules, in its words
            if params.temperature <= 0:
                raise InvalidPrompt("sampling distribution replay requires temperature > 0")
            if params.top_k <= 0:
                raise InvalidPrompt("sampling distribution replay requires top_k > 0 to bound sampling mask size, "
                                    "reduce transfer overhead, and avoid potential OOMs")
        if chat_template_content_format not in (None, *CHAT_TEMPLATE_CONTENT_FORMATS):
            raise InvalidPrompt(f"chat_template_content_format must be one of {', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}, "
                                f"got {chat_template_content_format!r}")
        if self.dead is not None:
            raise EngineDeadError(self.dead, self.retry_after)
        if self.draining is not None:
            raise EngineDeadError(self.draining)
        rid = request_id or self.new_request_id()
        generate = Generate(
            rid, params, prompt, prompt_token_ids, messages,
            add_generation_prompt, continue_final_message, chat_template_kwargs or {},
            priority, arrival_time, add_special_tokens, cache_salt, parent_id, n, lora_request, truncation_side,
            chat_template, render_only, return_token_offsets, chat_template_content_format, prompt_embeds,
            request_trace_headers.get(), multi_modal_data, mm_processor_kwargs, media_io_kwargs)
        if render_only:
            try:
                rendered = await self.tokenizer_actor.ask(generate, timeout=60)
            except RemoteError as exc:
                raise _refusal(exc) from None
            return RenderedPrompt(self, rid, params, rendered.prompt_token_ids, rendered.token_offsets)
        deadline = time.monotonic() + timeout_s if timeout_s else None
        self.waiting.check_room()
        in_flight, bound = len(self.streams), self.config.scheduler.max_num_queued_reqs
        if bound is not None and in_flight >= bound:
            raise Overloaded(f"the server is overloaded: {in_flight} requests are in flight "
                             f"(--max-num-queued-reqs {bound}); retry shortly")
        stream = self.streams.open(rid, stream_interval)
        admit = asyncio.ensure_future(self.tokenizer_actor.ask(generate, timeout=60))
        try:
            accepted = await asyncio.shield(admit)
        except RemoteError as exc:
            self.streams.close(rid)
            raise _refusal(exc) from None
        except BaseException:
            # the caller went away (a disconnect) while the Tokenizer was admitting: if the
            # request got in after all, abort it, or it would run with nobody reading it
            self.streams.close(rid)
            admit.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                    or self.abort([rid]))
            raise
        return RequestHandle(self, rid, stream, accepted.num_prompt_tokens, accepted.prompt_token_ids,
                             deadline, timeout_s)

    async def generate(self, params: SamplingParams, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Submit, then yield outputs until the request finishes (the last has ``finished``)."""
        handle = await self.submit(params, **kwargs)
        try:
            async for out in handle:
                yield out
        finally:
            handle.close()

    def pooling_request(self, params: PoolingParams | None = None,
                        truncate_prompt_tokens: int | None = None) -> SamplingParams:
        """What a pooling request (``params``, checked and completed with the model's pooler
        settings) is submitted with: ``submit`` and ``generate`` take it as a generating
        request's SamplingParams. InvalidPrompt (a 400) for what the model cannot do, and
        for a model that does not pool."""
        pooling = self.config.model.pooling
        if pooling is None:
            raise InvalidPrompt("this model generates text (--runner generate): serve it with --runner pooling "
                                "(or --convert embed) for embeddings")
        try:
            params = pooling.params(params, self.config.model.arch.hidden_size)
        except ValueError as exc:
            raise InvalidPrompt(str(exc)) from None
        return SamplingParams(max_tokens=1, temperature=0.0, pooling=params, detokenize=False,
                              truncate_prompt_tokens=truncate_prompt_tokens)

    async def encode(self, params: PoolingParams | None = None, *, truncate_prompt_tokens: int | None = None,
                     **kwargs: Any) -> tuple[RequestOutput, list[int]]:
        """A pooling request (vLLM's ``encode``): its prompt (``submit``'s keywords) through the
        model once. Returns its finished output, whose ``pooling_output`` is the answer (None,
        with ``error`` set, when the engine failed it), and the prompt's token ids.
        ``submit``'s refusals."""
        kwargs.setdefault("add_generation_prompt", False)
        handle = await self.submit(self.pooling_request(params, truncate_prompt_tokens), **kwargs)
        final: RequestOutput | None = None
        try:
            async for out in handle:
                if final is None:
                    final = out
                else:
                    final.merge(out)
        finally:
            handle.close()
        return final, list(handle.prompt_token_ids)

    async def check_grammar(self, spec: StructuredOutputsParams) -> float:
        """Have the engine compile ``spec`` (cached for the request that follows); raises
        InvalidGrammar with xgrammar's reason when it cannot. Returns the compile seconds."""
        try:
            compiled = await self.grammar.ask(CompileGrammar(spec), timeout=GRAMMAR_TIMEOUT_S)
        except RemoteError as exc:
            if exc.error_type == "InvalidGrammar":
                raise InvalidGrammar(exc.message) from None
            raise
        return compiled.seconds

    async def reset_prefix_cache(self) -> bool:
        done = await asyncio.gather(*(kv.ask(ResetPrefixCache(), timeout=30) for kv in self.kv_managers))
        return all(done)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests whose outputs nobody reads any more (their caller went away)."""
        if self.dead is None:
            self.engine.tell(AbortRequests(request_ids))
            self.detokenizer.tell(Untrack(request_ids))

    def abort_open(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort requests that are being answered (vLLM's POST /abort_requests): each ends with
        finish reason "abort". ``request_ids`` None: every open request. Returns the ids of the
        open requests aborted."""
        ids = self.streams.ids() if request_ids is None else [r for r in request_ids if self.streams.get(r)]
        if ids and self.dead is None:
            self.engine.tell(AbortRequests(ids))
        return ids

    # -- pausing (vLLM's pause_generation, for weight updates between rounds of generation) ---
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation: ``abort`` aborts every request, ``wait`` lets the running ones
        finish, ``keep`` freezes every request where it is; new requests queue until
        ``resume_generation``. Returns once nothing more runs (``clear_cache``: then the prefix
        cache was reset, except with ``keep``). Raises ValueError for an unknown mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self._check_alive()
        self.pause_mode = mode
        status: PauseStatus = await self.engine.ask(PauseScheduler(mode, clear_cache), timeout=30)
        while not status.drained:
            await asyncio.sleep(PAUSE_POLL_S)
            self._check_alive()
            status = await self.engine.ask(GetPauseStatus(), timeout=30)

    async def reset_encoder_cache(self) -> None:
        """vLLM's: every engine forgets its images' embeddings (they are encoded again when needed)."""
        self._check_alive()
        await self.engine.ask(ResetEncoderCache(), timeout=30)

    async def resume_generation(self) -> None:
        """End a pause: the queued and frozen requests go on."""
        self._check_alive()
        self.pause_mode = None
        await self.engine.ask(ResumeScheduler(), timeout=30)

    async def is_paused(self) -> bool:
        self._check_alive()
        status: PauseStatus = await self.engine.ask(GetPauseStatus(), timeout=30)
        return status.paused

    # -- sleep mode (vLLM's sleep / wake_up, to lend the memory to a trainer between rounds) ----
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause generation (``mode`` as pause_generation's) and, from level 1, have the workers
        give back the KV cache's memory (level 1) or that and the weights' (level 2; they are
        read again from the checkpoint at wake-up). Needs --enable-sleep-mode from level 1."""
        with self.stats.operation("sleep_mode", "sleep"):
            if level not in (0, 1, 2) or isinstance(level, bool):
                raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
            if level >= 1 and not self.config.model.enable_sleep_mode:
                raise ValueError("sleep level 1 and 2 need the engine started with --enable-sleep-mode "
                                 "(enable_sleep_mode=True)")
            await self.pause_generation(mode, clear_cache=level >= 1)
            if level >= 1:
                try:
                    await self.engine.ask(SleepEngine(level), timeout=SLEEP_TIMEOUT_S)
                except RemoteError as exc:
                    raise ValueError(exc.message) from None
            self.sleep_level = max(level, self.sleep_level or 0)
            self.stats.sleep_level = self.sleep_level
            log.info("sleeping (level %d)", level)

    async def release_kv_cache_memory(self) -> None:
        """vLLM's: once a pause completed with no request held (sleep level 0, or a pause in
        mode abort or wait), the KV cache's memory given back, the weights staying where they
        are; wake_up(["kv_cache"]) takes it again. Needs --enable-sleep-mode."""
        with self.stats.operation("sleep_mode", "release_kv_cache_memory"):
            if not self.config.model.enable_sleep_mode:
                raise ValueError("release_kv_cache_memory needs the engine started with --enable-sleep-mode "
                                 "(enable_sleep_mode=True)")
            self._check_alive()
            try:
                await self.engine.ask(SleepEngine(1, kv_cache_only=True), timeout=SLEEP_TIMEOUT_S)
            except RemoteError as exc:
                raise ValueError(exc.message) from None
            if self.sleep_level is None:
                self.sleep_level = self.stats.sleep_level = 0
            log.info("the KV cache's memory was given back")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """The workers take back ``tags`` ("weights", "kv_cache"; "scheduling" for level 0;
        None: everything); once nothing is left asleep generation resumes. Whether fully awake."""
        rest = None if tags is None else [t for t in tags if t != "scheduling"]
        unknown = set(rest or ()) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be weights, kv_cache or scheduling, got {sorted(unknown)}")
        self._check_alive()
        awake = True
        with self.stats.operation("sleep_mode", "wake"):
            # the engine knows what still sleeps (released at level 0, or through another API
            # server): generation resumes only once nothing does
            if self.sleep_level is not None:
                awake = await self.engine.ask(WakeEngine(rest), timeout=SLEEP_TIMEOUT_S)
            if awake and self.sleep_level is not None:
                await self.resume_generation()
                self.sleep_level = self.stats.sleep_level = None
                log.info("awake")
        return awake

    async def is_sleeping(self) -> bool:
        return self.sleep_level is not None or await self.is_paused()

    # -- vLLM's collective_rpc ---------------------------------------------------------------
    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                             args: tuple | list = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Worker ``method`` (by name: reload_weights, --worker-extension-cls's methods) on every
        worker; their results in rank order. A function instead (vLLM's): called in each worker
        with the worker and ``args``, pickled there and its result back (workers in other
        processes: with VLLM_ALLOW_INSECURE_SERIALIZATION=1, as vLLM asks). ValueError for an
        unknown method or what it refuses; TimeoutError past ``timeout``."""
        if callable(method):
            return await self._call_function(method, timeout, args, kwargs)
        if not isinstance(method, str):
            raise ValueError("collective_rpc takes a worker method's name (Troupe's workers answer reload_weights)")
        if method == CALLABLE:
            raise ValueError(f"{CALLABLE} is not a worker method")
        return await self._ask_workers(WorkerRPC(method, list(args), dict(kwargs or {}), timeout))

    async def _ask_workers(self, rpc: WorkerRPC) -> list[Any]:
        """Every worker's answer to ``rpc``: a refusal as ValueError, a timeout as TimeoutError,
        the method's own failure as RuntimeError."""
        self._check_alive()
        try:
            return await self.engine.ask(rpc, timeout=(rpc.timeout or SLEEP_TIMEOUT_S) + 15)
        except RemoteError as exc:
            if exc.error_type == "Refused":
                raise ValueError(exc.message) from None
            if exc.error_type == "TimedOut":
                raise TimeoutError(exc.message) from None
            if exc.error_type == "CallFailed":
                raise RuntimeError(exc.message) from None
            raise

    async def _call_function(self, fn: Callable[..., Any], timeout: float | None, args: tuple | list,
                             kwargs: dict[str, Any] | None) -> list[Any]:
        import pickle

        import cloudpickle
        p = self.config.parallel
        in_process = not p.multiprocess and p.world_size == 1 and p.data_parallel_size == 1
        if not in_process and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "") not in ("1", "true", "True"):
            raise ValueError("collective_rpc of a function pickles it to the worker processes: set "
                             "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow pickle-based serialization (vLLM's)")
        results = await self._ask_workers(WorkerRPC(CALLABLE, [cloudpickle.dumps(fn), *args], dict(kwargs or {}),
                                                     timeout))
        return [pickle.loads(r) for r in results]

    async def apply_model(self, fn: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``fn(model)`` in every worker, their results in rank order."""
        return await self._call_function(_ApplyModel(fn), None, (), None)

    # -- weight transfer (vLLM's RL routes; actors/worker/weight_transfer.py) -------------------
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the trainer's process group (the trainer opens it meanwhile)."""
        with self.stats.operation("rl_weight_update", "init"):
            await self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    async def shutdown_weight_transfer_engine(self) -> None:
        with self.stats.operation("rl_weight_update", "shutdown"):
            await self.collective_rpc("shutdown_weight_transfer_engine")

    async def start_weight_update(self, draft: bool = False) -> None:
        with self.stats.operation("rl_weight_update", "start_draft" if draft else "start"):
            await self.collective_rpc("start_draft_weight_update" if draft else "start_weight_update")

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive one chunk of the round (the trainer broadcasts its tensors meanwhile)."""
        with self.stats.operation("rl_weight_update", "update"):
            await self.collective_rpc("update_weights", kwargs={"update_info": update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """The round's weights replace the served ones (the prefix cache is emptied); with
        ``weight_version``, the engine's version becomes it."""
        with self.stats.operation("rl_weight_update", "finish"):
            await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        if not isinstance(new_version, str):
            raise ValueError(f"a weight version is a string, got {type(new_version).__name__}")
        self._check_alive()
        await self.engine.ask(WeightVersion(new_version), timeout=30)

    async def get_weight_version(self) -> str:
        self._check_alive()
        return await self.engine.ask(WeightVersion(), timeout=30)

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """Every worker's SHA-256 of each tensor of its model (vLLM's /weight_checker)."""
        return await self.collective_rpc("compute_weight_checksums")

    # -- profiling (vLLM's --profiler-config: /start_profile, /stop_profile) -------------------
    async def start_profile(self, prefix: str | None = None, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        """Open a profiling session: every worker records its steps (from ``delay_iterations``
        steps on, for at most ``max_iterations``: the config's when None) and, in a server, this
        frontend process records too; traces named with ``prefix``. ValueError for a bad option
        or without --profiler-config; ProfilerAlreadyActive while one is open."""
        config = self.config.profiler
        if not config.enabled:
            raise ValueError("Profiling is not enabled. Please set --profiler-config to enable profiling. "
                             "Example: --profiler-config.profiler=torch "
                             "--profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE")
        check_prefix(prefix)
        check_bounds(delay_iterations, max_iterations)
        if self.profiling:
            raise ProfilerAlreadyActive("A profiling session is already active. Call /stop_profile before "
                                        "starting another session.")
        self._check_alive()
        self.profiling = True
        try:
            await self.engine.ask(ProfileEngine(True, prefix, delay_iterations, max_iterations),
                                  timeout=SLEEP_TIMEOUT_S)
            # in one process (offline, not multiprocess) the worker's recorder sees it all already
            if config.profiles_frontend and self.config.parallel.multiprocess:
                from actors.worker.profiler import frontend_name, frontend_profiler, warm_up
                if self._frontend_profiler is None:
                    warm_up()                      # on the event loop's thread, which loads torch here
                    self._frontend_profiler = frontend_profiler(config)
                await asyncio.to_thread(self._frontend_profiler.start, frontend_name(prefix))
        except BaseException:
            self.profiling = False
            raise
        log.info("profiling started%s", f" ({prefix})" if prefix else "")

    async def stop_profile(self) -> None:
        """Close the session: every recorder writes its trace (nothing open: nothing happens)."""
        if not self.config.profiler.enabled:
            raise ValueError("Profiling is not enabled. Please set --profiler-config to enable profiling.")
        self._check_alive()
        stops = [self.engine.ask(ProfileEngine(False), timeout=SLEEP_TIMEOUT_S)]
        if self._frontend_profiler is not None:
            stops.append(asyncio.to_thread(self._frontend_profiler.stop))
        try:
            await asyncio.gather(*stops)
        finally:
            self.profiling = False
        log.info("profiling stopped: traces in %s", self.config.profiler.torch_profiler_dir or "the profiler")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead, self.retry_after)

    def end_group(self, parent_id: str, num_admitted: int) -> None:
        """Only ``num_admitted`` of the choices of ``parent_id`` were admitted (the others were
        refused): the group is complete once those finished."""
        self.detokenizer.tell(EndGroup(parent_id, num_admitted))


def _refusal(exc: RemoteError) -> Exception:
    kinds = {"PromptTooLong": PromptTooLong, "InvalidPrompt": InvalidPrompt, "Overloaded": Overloaded}
    cls = kinds.get(exc.error_type)
    return cls(exc.message) if cls is not None else exc


@dataclass(slots=True)
class RenderedPrompt:
    """A request checked and tokenized as it would be admitted, and not admitted (vLLM's /render):
    it stands where a RequestHandle would, with nothing to close."""
    client: EngineClient
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    token_offsets: list[tuple[int, int]] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def close(self) -> None:
        pass


class RequestTimedOut(StreamTimeout):
    """The request did not finish within its timeout (it is aborted)."""


class RequestHandle:
    """An admitted request: iterate it for outputs; ``close`` it when done. Closing before it
    finished aborts it in the engine (its KV blocks are freed). Past ``deadline`` (monotonic
    seconds) iterating raises RequestTimedOut."""

    def __init__(self, client: EngineClient, request_id: str, stream: OutputStream,
                 num_prompt_tokens: int, prompt_token_ids: list[int] | None = None,
                 deadline: float | None = None, timeout_s: float | None = None) -> None:
        self.client = client
        self.request_id = request_id
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_token_ids = prompt_token_ids or []
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.finished = False
        self._closed = False
        self.output_log: OutputLog | None = None      # --enable-log-outputs: sees every output

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        stall = self.client.stall_timeout_s
        while True:
            wait = stall
            if self.deadline is not None:
                wait = min(wait, max(self.deadline - time.monotonic(), 0.0))
            try:
                out = await self.stream.get(wait)
                break
            except StreamTimeout:
                if self.deadline is not None and time.monotonic() >= self.deadline - 1e-3:
                    raise RequestTimedOut(f"the request did not finish within its timeout of "
                                          f"{self.timeout_s:g} s") from None
                # A request queued behind many others waits as long as the engine makes
                # progress (or generation is paused); a stall is an engine that ran nothing
                # for that long.
                if (self.client.pause_mode is None
                        and time.monotonic() - self.client.stats.last_progress >= stall):
                    raise
        self.finished = out.finished
        if self.output_log is not None:
            self.output_log.take(out)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.client.streams.close(self.request_id)
        if not self.finished:
            self.client.abort([self.request_id])
            if self.output_log is not None:
                self.output_log.write("abort")


class _ApplyModel:
    """apply_model's function, pickled to the workers: ``fn`` on the worker's model."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, worker: Any) -> Any:
        return worker.apply_model(self.fn)
