"""The scheduler's core: which requests advance by how many tokens in the next step.

There is no prefill phase and no decode phase. Each request has ``num_computed_tokens`` and a
token count (prompt + output so far); a step lets requests catch up under the token budget
``max_num_batched_tokens`` and ``max_num_seqs``. RUNNING requests are served first, then
WAITING ones (first come first served, or by priority). A prompt longer than the budget is
prefilled in chunks over several steps; a waiting request starts after its longest cached
prefix. When the KV cache cannot hold a running request's next tokens, a victim is preempted
(FCFS: the tail of the running list; priority: the lowest priority), its blocks freed, its
budget refunded, and it is recomputed later.

Pure: no asyncio, no transport. One step:
    so = schedule()                 # the decisions; blocks taken from the KV manager
    ... the workers run ``so`` ...
    update_from_output(so, runner_output)

Async scheduling (the book's chapter 4) calls schedule() for step N+1 before step N's output came
back: a request that samples in a step counts an output placeholder until that output arrives,
so the next step already computes the token the worker sampled (the worker keeps its own copy of
every request's tokens and reads it from there). A request whose placeholders would take it to
max_tokens or the context length is not scheduled again. A request preempted with outputs in
flight waits, skipped in the queue but keeping its place, until they arrived: the tokens are
kept (they were sampled from the right state) and recomputed with the rest. A constrained
request's matcher must have seen every token before its next bitmask: while one runs with tokens
in flight (``grammar_needs_outputs``), the caller settles the steps in flight before scheduling.

Pipeline parallelism (the book's chapter 8; vLLM's batch queue): the caller keeps up to
``batch_queue_size`` (the number of stages) steps in flight, so each stage works on one while the
next stage works on the one before. A request is in one step in flight at most: while its step is
out, schedule() passes it over (running, or waiting after a preemption), and it is scheduled again
once that step's output came back. The other requests fill the next step, so micro-batches form
as requests arrive and as the token budget splits them. Each step tells the stages the tokens it
computes (``new_token_ids``): the stages before the last never see what the last one sampled.

The KV manager is asked directly, request by request, as vLLM's scheduler does: it is the
only record of the blocks; the scheduler keeps no count of its own.

Speculative decoding (the book's chapter 12): a request's ``spec_token_ids``, the draft tokens
the worker proposed with its last output, are scheduled after its own tokens within the token
budget (``num_tokens_with_spec``; fewer when the budget is short) and get KV slots like them;
``scheduled_spec_decode_tokens`` tells the worker which they are. They count as computed when
scheduled; when the output comes back with 1 .. k + 1 tokens (the accepted drafts and one more),
``num_computed_tokens`` goes back by the drafts rejected, and the tokens are appended one by one
with the usual stop checks, so a stop token, max_tokens or the context length mid-draft ends the
request there. A request with a grammar keeps the drafts its grammar allows, and its bitmask has a
row per verified position (``StructuredOutputs.fill_bitmask``). Drafts are never in ``all_token_ids`` until accepted, so no block hash (and no
cached block) covers them. A preempted request loses its drafts. Speculative decoding runs
without async scheduling (its drafts need the previous step's output). With a draft model, every
allocation reserves k lookahead slots past the step's tokens (capped by the context length): the
draft model writes the KV of its next drafts there in the same step, before the next schedule.

Images (vLLM's encoder scheduling): a prompt chunk that reaches an image's embedding positions
either finds the image in the workers' encoder cache (``encoder_cache.py``; the request then
references it until its positions are computed) or has the workers encode it this step, within
the step's encoder budget (max_num_batched_encoder_embeds) and the cache's room; otherwise the
chunk stops before the image, which waits for a later step. ``scheduled_encoder_inputs`` tells
the workers what to encode, ``free_encoder_mm_hashes`` what to drop.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from actors.engine.config import EngineConfig
from actors.engine.lora import LoRARequest
from actors.scheduler.encoder_cache import EncoderCache
from actors.engine.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest,
                                    ModelRunnerOutput, NewRequestData, SchedulerOutput,
                                    SchedulerStats)
from actors.grammar.compiler import GrammarError
from actors.scheduler.cost_model import StepCostModel, attention_pairs
from actors.scheduler.perf import PerfModel
from actors.grammar.matchers import StructuredOutputs
from actors.kv_manager.block_hash import BlockHasher, block_extra_keys, event_extra_keys
from actors.kv_manager.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent,
                                         external_hash)
from actors.kv_manager.manager import KVCacheManager
from actors.kv_manager.residency import BlockResidency
from actors.kv_transfer.base import KVConnectorBase, KVConnectorOutput, KVConnectorRole
from actors.kv_transfer.factory import KVConnectorFactory
from actors.scheduler.queues import create_queue
from actors.scheduler.request import Request, RequestStatus

MAX_WORKER_FAILURES = 3      # a request running when this many workers died fails (it may be the cause)


class PauseState(enum.IntEnum):
    """vLLM's: what a paused scheduler still schedules."""
    UNPAUSED = 0
    PAUSED_NEW = 1       # the running requests (and those holding loaded KV); no waiting one starts
    PAUSED_ALL = 2       # nothing: every request keeps its place and its blocks


@dataclass(slots=True)
class _Counters:
    step: int = 0
    num_preemptions: int = 0
    last_scheduled_reqs: int = 0
    last_scheduled_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    busy_seconds: float = 0.0
    compute_seconds: float = 0.0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_transfer: dict[str, float] = field(default_factory=dict)
    estimated_flops: int = 0               # --enable-mfu-metrics (perf.py)
    estimated_read_bytes: int = 0
    estimated_write_bytes: int = 0


@dataclass(slots=True)
class _Step:
    """What one schedule() call decided, in batch order."""
    budget: int
    num_tokens: dict[Request, int]          # scheduled requests and their new tokens
    new_block_ids: dict[Request, tuple[list[int], ...]]   # per KV cache group
    admitted: set[Request]                  # the workers get these in full
    preempted: list[Request]
    partial_prefills: int = 0               # prompts still part-way computed after this step
    long_partial_prefills: int = 0          # of those, longer than long_prefill_token_threshold
    latency_left: float | None = None       # seconds prompt chunks may add (None: no latency target)
    reserved: frozenset = frozenset()       # the decoding requests whose share latency_left left out
    chunked: bool = False                   # a prompt chunk was sized by the latency target already
    encoder_budget: int = 0                 # image embeddings the encoder may still make this step
    encoder_inputs: dict[Request, list[int]] = field(default_factory=dict)   # images encoded (mm_features indices)


class Scheduler:
    """``structured``: the matchers of requests with structured outputs (None: refused)."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 structured: StructuredOutputs | None = None, connector: KVConnectorBase | None = None) -> None:
        self.config = config.scheduler
        self.async_scheduling = config.scheduler.async_scheduling
        self.pipeline_parallel_size = pp = config.parallel.pipeline_parallel_size
        # steps the caller keeps in flight: one per pipeline stage, two with async scheduling
        self.batch_queue_size = pp if pp > 1 else 2 if self.async_scheduling else 1
        self._busy: set[str] = set()                   # pipeline parallelism: requests in a step in flight
        self._busy_steps: dict[int, list[str]] = {}     # step -> the requests it holds
        self.structured = structured
        self.awaiting_grammar: dict[str, Request] = {}    # WAITING_FOR_GRAMMAR, out of the queue
        self.block_size = config.cache.block_size
        self.hasher = BlockHasher(config.cache.prefix_caching_hash_algo)     # the prefix cache's block hashes
        self.enable_prefix_caching = config.cache.enable_prefix_caching
        self.max_model_len = config.model.max_model_len      # a request alone always fits
        self.kv = kv
        obs = config.observability
        self.spec_per_request = obs.per_request_spec_decode_metrics != "none"
        self.model_times = obs.collect_model_forward_time or obs.collect_model_execute_time
        if obs.kv_cache_metrics:        # --kv-cache-metrics: a sample of the blocks' residency
            kv.pool.residency = BlockResidency(obs.kv_cache_metrics_sample)
        # --enable-mfu-metrics: each step's FLOPs and bytes, estimated from the model's shape
        self.perf = PerfModel(config) if obs.enable_mfu_metrics and config.model.arch is not None else None
        self.watermark_blocks = int(self.config.watermark * kv.pool.num_usable_blocks)
        self.requests: dict[str, Request] = {}
        self.waiting = create_queue(self.config.policy)
        self.running: list[Request] = []
        self._finished_for_workers: list[str] = []
        self._in_flight: dict[int, list[str]] = {}     # step -> the requests that sample in it
        self.counters = _Counters()
        self.speculative = config.speculative
        if self.speculative is not None:
            if self.async_scheduling:
                raise ValueError("speculative decoding needs async scheduling off")
            self.counters.spec_num_accepted_tokens_per_pos = [0] * self.speculative.num_speculative_tokens
        # --max-step-latency-ms: prompt chunks sized so that steps with decodes stay under it, or
        # ("auto") so that a chunk beside decodes costs at most the cost model's auto_chunk_seconds
        self.latency_auto = self.config.max_step_latency_ms == "auto"
        self.latency_target = 0.0 if self.latency_auto else self.config.max_step_latency_ms / 1000.0
        self.cost = StepCostModel()
        self._step_sizes: dict[int, tuple[int, int]] = {}     # step -> (tokens, attention pairs)
        drafts_with_model = self.speculative is not None and self.speculative.method != "ngram"
        self.num_lookahead_tokens = self.speculative.num_speculative_tokens if drafts_with_model else 0
        self.max_loras = config.lora.max_loras if config.lora is not None else 0   # adapters per step
        # prefill/decode disaggregation (the book's chapter 9): the KV connector's scheduler side;
        # requests whose prompt KV loads from another instance wait out of the queue meanwhile
        if connector is None and config.kv_transfer is not None:
            connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
        self.connector = connector
        self.waiting_for_remote: dict[str, Request] = {}   # WAITING_FOR_REMOTE_KVS
        self._remote_loaded: set[str] = set()      # back in the queue holding loaded blocks
        self._held_for_remote: set[str] = set()    # finished; blocks freed when the worker says so
        self.removed_lora_ids: list[int] = []     # unloaded adapters the workers drop with the next step
        self.pinned_loras: list[LoRARequest] = []  # adapters the workers pin with the next step
        self.pause_state = PauseState.UNPAUSED
        self._kv_events: list[KVCacheEvent] = []    # converted, not yet taken (--kv-events-config)
        # the workers' encoder cache; per request, its images (mm_features indices) it references
        self.encoder_cache = EncoderCache(self.config.encoder_cache_embeds)
        self._encoder_refs: dict[str, set[int]] = {}
        self._reset_encoder = False                 # the workers drop every image with the next step

    # -- admission and abort -----------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; returns an immediate error output if it can never be served."""
        if r.request_id in self.requests:
            return EngineCoreOutput(r.request_id, [], "error", error=f"duplicate request id {r.request_id}")
        room = 0 if r.sampling_params.pooling is not None else 1    # a pooling request generates nothing
        if len(r.prompt_token_ids) + room > self.max_model_len:
            return EngineCoreOutput(r.request_id, [], "error", error=(
                f"prompt of {len(r.prompt_token_ids)} tokens leaves no room to generate "
                f"(limit {self.max_model_len} tokens)"))
        if r.lora_request is not None and not self.max_loras:
            return EngineCoreOutput(r.request_id, [], "error", error="LoRA adapters are not enabled (--enable-lora)")
        # block hashes: the prefix cache's, and a KV connector's (vLLM's rule: either needs them)
        hashed = self.enable_prefix_caching or self.connector is not None
        req = Request.from_engine_request(r, self.block_size if hashed else 0, self.hasher)
        spec = r.sampling_params.structured_outputs
        if spec is not None:
            if self.structured is None:
                return EngineCoreOutput(r.request_id, [], "error", error="structured outputs are not available here")
            try:
                ready = self.structured.start(r.request_id, spec)
            except GrammarError as exc:
                return EngineCoreOutput(r.request_id, [], "error", error=f"invalid structured outputs: {exc}")
            if not ready:              # compiled on the side; the queue goes on without it
                req.status = RequestStatus.WAITING_FOR_GRAMMAR
                self.requests[req.request_id] = self.awaiting_grammar[req.request_id] = req
                return None
        self.requests[req.request_id] = req
        self.waiting.add(req)
        if self.connector is not None:
            self.connector.request_added(req)
        return None

    def grammar_ready(self, request_id: str, error: str | None = None) -> list[EngineCoreOutput]:
        """A waiting request's grammar was compiled (or could not be: ``error``)."""
        req = self.awaiting_grammar.pop(request_id, None)
        if req is None:
            return []                  # aborted meanwhile
        if error is None and self.structured.start(request_id, req.sampling_params.structured_outputs):
            req.status = RequestStatus.WAITING
            self.waiting.readmit(req)          # its place by arrival, ahead of later requests
            return []
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(request_id, [], "error", error=error or "its grammar was not compiled")]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outs.append(EngineCoreOutput(rid, [], "abort"))
        return outs

    def requeue_running(self, reason: str) -> list[EngineCoreOutput]:
        """The workers died, and the running requests' KV with them: each goes back to the
        front of the queue to be recomputed, as after a preemption, unless it already lost
        MAX_WORKER_FAILURES workers (then it fails with ``reason``)."""
        self.forget_in_flight()
        self.reset_encoder_cache()                # the worker's cache went with it
        outs = self._drop_transfers()
        for req in reversed(self.running):        # prepended in reverse: the queue keeps their order
            req.num_worker_failures += 1
            if req.num_worker_failures >= MAX_WORKER_FAILURES:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outs.append(EngineCoreOutput(req.request_id, [], "error", error=(
                    f"the worker died {req.num_worker_failures} times while this request ran: {reason}")))
            else:
                self._recompute_later(req)
        self.running.clear()
        return outs

    def fail_running(self, error: str) -> list[EngineCoreOutput]:
        """The workers failed mid-step: every running request ends with ``error``."""
        self.forget_in_flight()
        self.reset_encoder_cache()                # what the failed steps encoded or dropped is unknown
        outs = []
        for req in list(self.running):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outs.append(EngineCoreOutput(req.request_id, [], "error", error=error))
        return outs

    def forget_in_flight(self) -> None:
        """The outputs of the steps sent to the workers will not come back (the workers died or
        failed): no request waits for them any more."""
        for rids in self._in_flight.values():
            for rid in rids:
                req = self.requests.get(rid)
                if req is not None:
                    req.num_output_placeholders = 0
        self._in_flight.clear()
        self._busy.clear()
        self._busy_steps.clear()

    def reset_blocks(self) -> None:
        """The workers lost their caches: forget every allocation and cached prefix. Only
        requests holding no blocks (waiting ones) may remain."""
        if self.running:
            raise RuntimeError("cannot reset KV blocks while requests are running")
        self.kv.reset()
        self._finished_for_workers.clear()
        self.reset_encoder_cache()

    def reset_encoder_cache(self) -> None:
        """Forget every image's embeddings (vLLM's reset_encoder_cache): the workers drop theirs
        with the next step, and images still needed are encoded again."""
        self.encoder_cache.reset()
        self._encoder_refs.clear()
        self._reset_encoder = True

    def has_work(self) -> bool:
        """Whether a step would schedule something (a pause holds some requests back)."""
        if self.pause_state == PauseState.UNPAUSED:
            return bool(self.waiting or self.running)
        if self.pause_state == PauseState.PAUSED_ALL:
            return False
        return bool(self.running or self._remote_loaded)

    # -- KV events (--kv-events-config) ------------------------------------------------------
    def record_kv_events(self, on_event: Callable[[], None] | None = None) -> None:
        """Note the prefix cache's changes as vLLM's KV events (``take_kv_events``); ``on_event``
        is called when one is noted and none was waiting."""
        self.kv.pool.record_events(on_event)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV events since the last call, in order."""
        self._convert_kv_events()
        events, self._kv_events = self._kv_events, []
        return events

    def _convert_kv_events(self) -> None:
        """The pool's notes as vLLM's events; blocks stored are described by the request that
        filled them (called while it is known: at the end of every schedule())."""
        notes = self.kv.pool.take_events()
        if not notes:
            return
        bs = self.block_size
        for note in notes:
            if note[0] == "stored":
                _, rid, group, first, hashes = note
                req = self.requests.get(rid)
                parent = req.block_hashes[first - 1] if req is not None and first > 0 else None
                lora = req.lora_request if req is not None else None
                tokens = req.all_token_ids[first * bs:(first + len(hashes)) * bs] if req is not None else []
                keys = [block_extra_keys(first + i, lora, req.cache_salt if req is not None else None,
                                         req.prompt_embeds if req is not None else None, bs,
                                         req.mm_features if req is not None else None)
                        for i in range(len(hashes))]
                self._kv_events.append(BlockStored(
                    [external_hash(h) for h in hashes], None if parent is None else external_hash(parent),
                    tokens, bs, lora.lora_int_id if lora else None, MEDIUM_GPU, lora.lora_name if lora else None,
                    extra_keys=[event_extra_keys(k) for k in keys] if any(keys) else None,
                    group_idx=group))
            elif note[0] == "removed":
                self._kv_events.append(BlockRemoved([external_hash(note[1])], MEDIUM_GPU, group_idx=note[2]))
            else:
                self._kv_events.append(AllBlocksCleared())

    def abort_all(self) -> list[EngineCoreOutput]:
        """Abort every request this scheduler holds (waiting, running, or waiting for a grammar
        or for remote KV)."""
        return self.abort_requests(list(self.requests))

    def kv_connector_pending(self) -> bool:
        """Transfers are under way or blocks held for a remote reader: the worker's side must be
        polled (steps without tokens) until they end."""
        return self.connector is not None and self.connector.has_pending()

    def _finish(self, req: Request, status: RequestStatus, written_tokens: int | None = None) -> dict | None:
        """End the request; returns the kv_transfer_params its response carries (a KV connector's).
        ``written_tokens``: see KVCacheManager.free (0: none of its blocks keeps its place in the
        prefix cache, their KV not to be trusted)."""
        req.status = status
        rid = req.request_id
        loading = False
        if req in self.running:
            self.running.remove(req)
            self._finished_for_workers.append(rid)
        elif self.waiting_for_remote.pop(rid, None) is not None:
            loading = True
        elif self.awaiting_grammar.pop(rid, None) is None:
            self.waiting.remove(req)
        self._remote_loaded.discard(rid)
        self._release_images(req)
        params = None
        delay = False
        if self.connector is not None:
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                          RequestStatus.FINISHED_REPETITION):
                delay, params = self.connector.request_finished(req, self.kv.get_block_ids(rid))
            else:
                self.connector.request_dropped(rid)
            # blocks a transfer may still read or write are not freed until it is reported ended
            # (the read-after-write hazard): a remote reader's, or a load under way
            delay = delay or (loading and self.connector.is_loading(rid))
        if delay:
            self._held_for_remote.add(rid)
        else:
            self.kv.free(rid, written_tokens)
        if self.structured is not None:
            self.structured.free(rid)
        del self.requests[rid]
        return params

    def _drop_transfers(self) -> list[EngineCoreOutput]:
        """The worker died: transfers under way are gone with it. Loading requests go back to
        the queue (to load again, or to be computed here), held blocks are forgotten (the
        caller resets the KV cache)."""
        if self.connector is None:
            return []
        self.connector.reset()
        self._held_for_remote.clear()
        for req in self.waiting_for_remote.values():
            self.kv.free(req.request_id)
            req.status, req.num_computed_tokens, req.num_external_tokens = RequestStatus.WAITING, 0, 0
            self.waiting.readmit(req)
        self.waiting_for_remote.clear()
        for rid in self._remote_loaded:
            self.requests[rid].num_computed_tokens = 0
            self.kv.free(rid)
        self._remote_loaded.clear()
        return []

    def _update_from_kv_xfer(self, out: KVConnectorOutput) -> list[EngineCoreOutput]:
        """The worker's side reported transfers that ended: free the blocks remote readers are
        done with; requests whose KV loaded go back to the queue with their prompt computed but
        its last token; those whose load failed are computed here (or fail, by the policy)."""
        self.connector.update_connector_output(out)
        c = self.counters
        for k, v in out.stats.items():
            c.kv_transfer[k] = c.kv_transfer.get(k, 0.0) + v
        for rid in out.finished_sending:
            if rid in self._held_for_remote:
                self._held_for_remote.discard(rid)
                self.kv.free(rid)
        outs: list[EngineCoreOutput] = []
        for rid, error in [*((r, None) for r in out.finished_recving), *out.failed_recving.items()]:
            if rid in self._held_for_remote:             # finished (aborted) while loading
                self._held_for_remote.discard(rid)
                self.kv.free(rid)
                continue
            req = self.waiting_for_remote.pop(rid, None)
            if req is None:
                continue
            req.status = RequestStatus.WAITING
            if error is None:       # the loaded tokens, never the prompt's last (computed here)
                req.num_computed_tokens = min(req.num_prompt_tokens - 1, req.num_computed_tokens + req.num_external_tokens)
                req.num_external_tokens = req.num_computed_tokens - req.num_cached_tokens
                req.num_cached_tokens = req.num_computed_tokens
                c.external_prefix_cache_hits += req.num_external_tokens
                self._remote_loaded.add(rid)
            elif self.config_kv_failure_policy() == "fail":
                self.waiting.add(req)
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outs.append(EngineCoreOutput(rid, [], "error", error=f"loading the prompt's KV failed: {error}"))
                continue
            else:
                self.kv.free(rid)                         # computed here from the start
                req.num_computed_tokens = req.num_cached_tokens = req.num_external_tokens = 0
            self.waiting.readmit(req)
        return outs

    def config_kv_failure_policy(self) -> str:
        return self.connector.kv_config.kv_load_failure_policy

    # -- the step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step and take its blocks; an empty step schedules no tokens."""
        step = _Step(self.config.token_budget, {}, {}, set(), [], encoder_budget=self.config.encoder_budget)
        step.latency_left, step.reserved = self._latency_budget()
        if self.pause_state != PauseState.PAUSED_ALL:
            self._schedule_running(step)
            if not step.preempted:
                self._schedule_waiting(step)
        c = self.counters
        c.step += 1
        c.last_scheduled_reqs = len(step.num_tokens)
        c.last_scheduled_tokens = self.config.token_budget - step.budget
        sampling: list[Request] = []
        spec: dict[str, list[int]] = {}
        pairs = 0
        if self.perf is not None:
            cost = self.perf.step([(n, req.num_computed_tokens + n, req.num_computed_tokens < req.num_prompt_tokens)
                                   for req, n in step.num_tokens.items()])
            c.estimated_flops += cost.flops
            c.estimated_read_bytes += cost.read_bytes
            c.estimated_write_bytes += cost.write_bytes
        for req, n in step.num_tokens.items():
            pairs += attention_pairs(req.num_computed_tokens, n)
            if req.num_computed_tokens < req.num_prompt_tokens:
                c.prompt_tokens_computed += min(n, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += n           # scheduled tokens count as computed
            if req.request_id in self._encoder_refs:
                self._release_passed_images(req)
            if req.num_computed_tokens >= req.num_tokens + req.num_output_placeholders:
                sampling.append(req)               # its prompt complete: it samples a token
            if req.spec_token_ids:                 # the drafts that fit the budget, after its tokens
                num_spec = req.num_computed_tokens - req.num_tokens
                if num_spec > 0:
                    spec[req.request_id] = req.spec_token_ids[:num_spec]
                req.spec_token_ids = []
        so = self._output(step, sampling, spec)
        if self.latency_target > 0 and step.num_tokens:
            self._step_sizes[so.step] = (so.total_num_scheduled_tokens, pairs)
            if len(self._step_sizes) > 64:                 # steps that failed never report a time
                del self._step_sizes[next(iter(self._step_sizes))]
        for req in sampling:
            req.num_output_placeholders += 1
        if sampling:
            self._in_flight[so.step] = [req.request_id for req in sampling]
        if self.pipeline_parallel_size > 1 and step.num_tokens:
            self._busy_steps[so.step] = list(so.num_scheduled_tokens)
            self._busy.update(so.num_scheduled_tokens)
        if self.kv.pool.events:
            self._convert_kv_events()
        return so

    def _latency_budget(self) -> tuple[float | None, frozenset]:
        """With a latency target, once the cost model is fitted and requests are decoding: the
        seconds left for the step's other tokens after the decodes' share ("auto": the cost model's
        auto_chunk_seconds), and those decoding requests. None otherwise (no decodes to stall:
        chunks as large as the token budget allows)."""
        if not (self.latency_auto or self.latency_target > 0) or not self.cost.ready:
            return None, frozenset()
        tokens = pairs = 0
        decoding = []
        for req in self.running:
            computed = req.num_computed_tokens
            n = req.num_tokens_with_spec + req.num_output_placeholders - computed
            if 0 < n <= 1 + len(req.spec_token_ids):          # decoding (with its drafts)
                tokens += n
                pairs += attention_pairs(computed, n)
                decoding.append(req)
        if not tokens:
            return None, frozenset()
        if self.latency_auto:
            return self.cost.auto_chunk_seconds(), frozenset(decoding)
        return self.latency_target - self.cost.predict(tokens, pairs), frozenset(decoding)

    def seed_step_costs(self, costs: list[tuple[int, int, float]]) -> None:
        """Steps the worker profiled at start-up (tokens, attention pairs, seconds): the cost
        model predicts from the first request on rather than after its first steps."""
        for tokens, pairs, seconds in costs:
            self.cost.observe(tokens, pairs, seconds)

    def observe_step_time(self, step: int, seconds: float) -> None:
        """The worker's compute seconds for ``step``: one more observation for the cost model."""
        size = self._step_sizes.pop(step, None)
        if size is not None:
            self.cost.observe(*size, seconds)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, in order; victims preempted when blocks run out."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            n = (0 if self._reaches_limit(req) or req.request_id in self._busy
                 else self._num_new_tokens(req, req.num_computed_tokens, step))
            n, encode = self._plan_images(req, req.num_computed_tokens, n, step)
            if n == 0:
                i += 1
                continue
            blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n, req.block_hashes,
                                            num_computed_tokens=req.num_computed_tokens,
                                            num_lookahead_tokens=self._lookahead(req.num_computed_tokens + n))
            while blocks is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, step)
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n,
                                                req.block_hashes, num_computed_tokens=req.num_computed_tokens,
                                                num_lookahead_tokens=self._lookahead(req.num_computed_tokens + n))
            if blocks is None:
                continue                 # req itself was preempted: the list shifted onto the next
            step.num_tokens[req] = n
            step.new_block_ids[req] = blocks
            step.budget -= n
            self._encode_images(req, encode, step)
            self._count_partial(req, req.num_computed_tokens, n, step)
            i += 1

    def _lookahead(self, num_tokens: int) -> int:
        """Slots past a request's first ``num_tokens`` for the draft model's next drafts."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens))

    def _reaches_limit(self, req: Request) -> bool:
        """Whether the tokens in flight already take ``req`` to max_tokens or the context length
        (then the step that would sample past them is not worth running)."""
        pending = req.num_output_placeholders
        if not pending:
            return False
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and req.num_output_tokens + pending >= max_tokens)
                or req.num_tokens + pending >= self.max_model_len)

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests, while the budget, the batch and the KV cache allow. Requests that
        cannot start yet (outputs of a step before their preemption still in flight) are
        skipped and keep their place (vLLM's ``skipped_waiting``)."""
        skipped: list[Request] = []
        try:
            self._admit_waiting(step, skipped)
        finally:
            for req in reversed(skipped):
                self.waiting.prepend(req)

    def _admit_waiting(self, step: _Step, skipped: list[Request]) -> None:
        bs = self.block_size
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}   # every step's, at most max_loras
        paused = self.pause_state == PauseState.PAUSED_NEW
        while self.waiting and step.budget > 0 and len(self.running) < self.config.active_seqs:
            if paused and not self._remote_loaded:
                break
            req = self.waiting.peek()
            if paused and req.request_id not in self._remote_loaded:
                skipped.append(self.waiting.pop())     # waits for the pause to end
                continue
            if req.num_output_placeholders or req.request_id in self._busy or not self._lora_fits(req, loras):
                skipped.append(self.waiting.pop())
                continue
            loaded = req.request_id in self._remote_loaded
            if loaded:                                # holds its prompt's blocks, loaded remotely
                hits, computed = None, req.num_computed_tokens
            else:
                hits = self.kv.get_computed_blocks(self._lookup_hashes(req))
                computed = len(hits) * bs
                if self.connector is not None and self._start_remote_load(req, hits, computed, step):
                    continue
            n = self._num_new_tokens(req, computed, step)
            n, encode = self._plan_images(req, computed, n, step)
            if n == 0:                                # the step's latency target (or the encoder's) leaves it no room
                break
            if self._partial_prefills_full(req, computed, n, step):
                skipped.append(self.waiting.pop())    # a prompt that fits whole may pass it
                continue
            watermark = self.watermark_blocks if (self.running or step.num_tokens) else 0
            full = min(req.num_tokens, self.max_model_len) if self.config.scheduler_reserve_full_isl else 0
            blocks = self.kv.allocate_slots(req.request_id, computed + n, req.block_hashes, hits, watermark,
                                            num_lookahead_tokens=self._lookahead(computed + n), full_num_tokens=full)
            if blocks is None:
                break
            if loaded:                                # the workers get its whole block table
                blocks = self.kv.get_block_ids(req.request_id)
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            req.first_scheduled_time = req.first_scheduled_time or time.time()
            req.num_computed_tokens = computed
            if loaded:
                self._remote_loaded.discard(req.request_id)
            else:
                req.num_cached_tokens = computed
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += computed
            self.running.append(req)
            if req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)
            step.num_tokens[req] = n
            step.new_block_ids[req] = blocks
            step.admitted.add(req)
            step.budget -= n
            self._encode_images(req, encode, step)
            self._count_partial(req, computed, n, step)

    def _start_remote_load(self, req: Request, hits, computed: int, step: _Step) -> bool:
        """Whether ``req``'s prompt KV past its ``computed`` local hits loads from another
        instance: then it takes blocks for the whole prompt and waits out of the queue
        (WAITING_FOR_REMOTE_KVS) while the worker loads them. Its blocks are offered to the
        prefix cache only once loaded."""
        ext, load_async = self.connector.get_num_new_matched_tokens(req, computed)
        if not (ext and load_async):
            return False
        watermark = self.watermark_blocks if (self.running or step.num_tokens) else 0
        blocks = self.kv.allocate_slots(req.request_id, computed + ext, [], hits, watermark)
        if blocks is None:
            return False                               # no room: computed here as usual (or waits)
        self.waiting.pop()
        self.connector.update_state_after_alloc(req, blocks, ext)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.first_scheduled_time = req.first_scheduled_time or time.time()
        req.num_computed_tokens = req.num_cached_tokens = computed
        req.num_external_tokens = ext                  # to load: counted computed once loaded
        self.counters.prefix_cache_queries += req.num_tokens
        self.counters.prefix_cache_hits += computed
        self.counters.external_prefix_cache_queries += req.num_tokens - computed
        self.waiting_for_remote[req.request_id] = req
        return True

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether ``req`` may join the running requests, whose adapters are ``loras`` (by lora_int_id): a step
        never holds more adapters than the layers have slots (max_loras); a request of another
        adapter waits, keeping its place, until one of them is done (vLLM's rule)."""
        return req.lora_request is None or req.lora_request.lora_int_id in loras or len(loras) < self.max_loras

    def _is_partial(self, req: Request, computed: int, n: int) -> tuple[bool, bool]:
        """Whether ``req``'s prompt is still part-way computed after ``n`` more tokens, and
        whether it is a long one (more than long_prefill_token_threshold tokens left)."""
        left = req.num_tokens + req.num_output_placeholders - computed
        threshold = self.config.long_prefill_token_threshold
        return n < left, 0 < threshold < left

    def _count_partial(self, req: Request, computed: int, n: int, step: _Step) -> None:
        partial, long = self._is_partial(req, computed, n)
        if partial:
            step.partial_prefills += 1
            step.long_partial_prefills += long

    def _partial_prefills_full(self, req: Request, computed: int, n: int, step: _Step) -> bool:
        """Whether admitting ``req`` would leave more prompts part-way computed than
        max_num_partial_prefills (or long ones than max_long_partial_prefills) allow."""
        partial, long = self._is_partial(req, computed, n)
        if not partial:
            return False
        return (step.partial_prefills >= self.config.max_num_partial_prefills
                or (long and step.long_partial_prefills >= self.config.max_long_partial_prefills))

    def _lookup_hashes(self, req: Request) -> list:
        """The block hashes a waiting request may hit: capped so its last token is computed;
        none when it asks for prompt log-probs (every prompt position's logits are needed), pools
        every position (MEAN, CLS, token embeddings) or asks not to read the cache (vLLM's
        skip_reading_prefix_cache)."""
        p = req.sampling_params
        if (not self.enable_prefix_caching or p.prompt_logprobs is not None or p.prompt_logprob_token_ids is not None
                or p.skip_reading_prefix_cache or (p.pooling is not None and p.pooling.needs_all_positions)):
            return []
        return req.block_hashes[:(req.num_tokens - 1) // self.block_size]

    def _num_new_tokens(self, req: Request, computed: int, step: _Step) -> int:
        n = req.num_tokens_with_spec + req.num_output_placeholders - computed
        if not self.config.chunks_prompts and computed < req.num_prompt_tokens:
            return n if n <= step.budget else 0       # without chunked prefill: the prompt whole, or not yet
        threshold = self.config.long_prefill_token_threshold
        eligible = len(self.running) + len(self.waiting)
        if threshold and eligible > 1:
            if self.config.long_prefill_token_threshold_adaptive:   # at least a fair share of the budget
                threshold = max(threshold, self.config.token_budget // eligible)
            n = min(n, threshold)
        n = min(n, step.budget)
        whole = self.config.disable_chunked_mm_input and req.mm_features and computed < req.num_prompt_tokens
        if whole:
            n = whole_items(req.mm_features, computed, n)
        if step.latency_left is not None and n > 0 and req not in step.reserved:
            if n > 1 + len(req.spec_token_ids) or computed < req.num_prompt_tokens:   # a prompt chunk beside decodes
                # the largest chunk that keeps the step within the target; the step's first
                # takes at least a block, so the oldest prompt always progresses (no starvation)
                fits = self.cost.max_chunk(computed, step.latency_left)
                n = min(n, fits if step.chunked else max(fits, self.block_size))
                step.chunked = True
            _, c1, c2 = self.cost.coef
            step.latency_left -= c1 * n + c2 * attention_pairs(computed, n) / 1000.0
        return whole_items(req.mm_features, computed, n) if whole else n

    def _plan_images(self, req: Request, computed: int, n: int, step: _Step) -> tuple[int, list[int]]:
        """vLLM's encoder scheduling for a chunk of ``n`` tokens from ``computed``: each image
        whose embedding positions the chunk reaches is referenced in the encoder cache, or is to
        be encoded this step where the step's encoder budget and the cache have room (an image
        larger than the budget goes alone, as the step's first); the chunk stops before the first
        image with no room (none of it, when the chunk starts inside that image). Returns the
        tokens and the images to encode (``mm_features`` indices; ``_encode_images`` once the
        request is scheduled)."""
        features = req.mm_features
        if not features or n == 0 or computed >= features[-1].end:     # no image left ahead (decoding)
            return n, []
        end, rid, cache = computed + n, req.request_id, self.encoder_cache
        held = self._encoder_refs.setdefault(rid, set())
        held_ids = {features[k].identifier for k in held}
        encode: list[int] = []
        pending = 0                                     # embeddings of ``encode``
        for k, f in enumerate(features):
            if f.offset >= end:
                break
            if k in held or f.end <= computed:
                continue
            lo, hi = f.embed_span
            if hi <= computed or lo >= end:             # only its markers in the chunk
                continue
            if f.identifier in held_ids:                # the prompt holds the image twice
                if not any(features[j].identifier == f.identifier for j in encode):
                    held.add(k)
                else:
                    encode.append(k)
                continue
            if cache.reference(f, rid):
                held.add(k)
                held_ids.add(f.identifier)
                continue
            size = f.num_embeds
            alone = not pending and step.encoder_budget == self.config.encoder_budget
            if (size > step.encoder_budget - pending and not alone) or not cache.can_allocate(size, pending):
                return max(f.offset - computed, 0), encode
            encode.append(k)
            held_ids.add(f.identifier)
            pending += size
        return n, encode

    def _encode_images(self, req: Request, encode: list[int], step: _Step) -> None:
        """The scheduled request's images to encode this step: room in the cache, the budget spent."""
        if not encode:
            return
        held = self._encoder_refs[req.request_id]
        for k in encode:
            feature = req.mm_features[k]
            if feature.identifier not in self.encoder_cache:
                step.encoder_budget -= feature.num_embeds
            self.encoder_cache.allocate(feature, req.request_id)
            held.add(k)
        step.encoder_inputs[req] = encode

    def _release_passed_images(self, req: Request) -> None:
        """The images whose positions ``req`` has now computed are no longer referenced by it
        (unless it holds the same image again further on)."""
        held = self._encoder_refs[req.request_id]
        done = req.num_computed_tokens
        passed = [k for k in held if req.mm_features[k].end <= done]
        if not passed:
            return
        held.difference_update(passed)
        if not held:                       # none left: its decode steps look no more
            del self._encoder_refs[req.request_id]
        live = {req.mm_features[k].identifier for k in held}
        for k in passed:
            if req.mm_features[k].identifier not in live:
                self.encoder_cache.release(req.mm_features[k], req.request_id)

    def _release_images(self, req: Request) -> None:
        """``req`` ended or was preempted: it references no image any more."""
        held = self._encoder_refs.pop(req.request_id, None)
        for k in held or ():
            self.encoder_cache.release(req.mm_features[k], req.request_id)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, step: _Step) -> None:
        """Free the victim's blocks and refund what this step gave it; it is recomputed later."""
        self.running.remove(req)
        n = step.num_tokens.pop(req, 0)
        step.budget += n
        step.new_block_ids.pop(req, None)
        encoded = step.encoder_inputs.pop(req, ())
        self._release_images(req)
        for k in encoded:                  # its images this step was to encode: not encoded after all
            feature = req.mm_features[k]
            if self.encoder_cache.discard(feature):
                step.encoder_budget += feature.num_embeds
        # scheduled earlier in this step: its blocks were offered to the prefix cache as if the
        # step computed its n tokens past num_computed_tokens, which it now will not
        self._recompute_later(req, req.num_computed_tokens if n else None)
        req.num_preemptions += 1
        step.preempted.append(req)
        self.counters.num_preemptions += 1

    def recompute_running(self) -> int:
        """Every running request back to the queue without its blocks, to be computed again
        (sleep mode gives the KV cache back with requests a pause kept); how many."""
        kept = list(self.running)
        for req in reversed(kept):              # prepended: they keep their order
            self.running.remove(req)
            self._recompute_later(req)
            req.num_preemptions += 1
            self.counters.num_preemptions += 1
            self._finished_for_workers.append(req.request_id)
        return len(kept)

    def _recompute_later(self, req: Request, written_tokens: int | None = None) -> None:
        """Back to the front of the queue without blocks: prompt and output so far are
        computed again when it is scheduled. ``written_tokens``: see KVCacheManager.free."""
        self.kv.free(req.request_id, written_tokens)
        self._release_images(req)
        if self.connector is not None:     # no remote reader may read its freed blocks any more
            self.connector.request_dropped(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.waiting.prepend(req)

    def _output(self, step: _Step, sampling: list[Request], spec: dict[str, list[int]]) -> SchedulerOutput:
        """The workers' step message: new requests in full, the others as diffs."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled: dict[str, int] = {}
        for req, n in step.num_tokens.items():
            rid, blocks, start = req.request_id, step.new_block_ids[req], req.num_computed_tokens - n
            num_scheduled[rid] = n
            if req in step.admitted:
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, list(req.output_token_ids),
                                               req.sampling_params, blocks, start, req.lora_request,
                                               req.prompt_embeds, req.mm_features))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(start)
                if self.pipeline_parallel_size > 1:
                    cached.new_token_ids.append(req.all_token_ids[start:start + n])
        finished = self._finished_for_workers + [r.request_id for r in step.preempted]
        meta = None       # sent without tokens too while transfers are under way (the worker reports them)
        if self.connector is not None and (num_scheduled or self.kv_connector_pending()):
            meta = self.connector.build_connector_meta(list(step.num_tokens), self.kv.get_block_ids)
        sent = bool(num_scheduled) or meta is not None
        if sent:                                   # a step nobody runs keeps them for the next
            self._finished_for_workers = []
        else:
            self._finished_for_workers = finished
        freed, reset = (self.encoder_cache.take_freed(), self._reset_encoder) if sent else ([], False)
        if sent:
            self._reset_encoder = False
        grammar_ids = []
        if self.structured is not None:
            for req in sampling:
                if req.request_id in self.structured:
                    if req.num_output_placeholders:
                        raise RuntimeError(f"request {req.request_id}'s matcher has not seen its tokens in "
                                           "flight: settle the steps in flight first (grammar_needs_outputs)")
                    grammar_ids.append(req.request_id)
        return SchedulerOutput(self.counters.step, new_reqs, cached, num_scheduled,
                               sum(num_scheduled.values()), finished, grammar_ids,
                               self.structured.fill_bitmask(grammar_ids, spec) if grammar_ids else None,
                               scheduled_spec_decode_tokens=spec, kv_connector_metadata=meta,
                               removed_lora_ids=self._take_removed_loras(), pinned_loras=self._take_pinned_loras(),
                               scheduled_encoder_inputs={r.request_id: k for r, k in step.encoder_inputs.items()},
                               free_encoder_mm_hashes=freed, reset_encoder_cache=reset)

    def _take_removed_loras(self) -> list[int]:
        removed, self.removed_lora_ids = self.removed_lora_ids, []
        return removed

    def _take_pinned_loras(self) -> list[LoRARequest]:
        pinned, self.pinned_loras = self.pinned_loras, []
        return pinned

    def grammar_needs_outputs(self) -> bool:
        """Whether a running request with a grammar has tokens in flight: its matcher must see
        them before the next step's bitmask, so the steps in flight are settled first."""
        return self.structured is not None and any(
            req.num_output_placeholders and req.request_id in self.structured for req in self.running)

    # -- the step's results ------------------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, and finish requests that are done."""
        for rid in self._in_flight.pop(so.step, ()):
            req = self.requests.get(rid)
            if req is not None and req.num_output_placeholders:
                req.num_output_placeholders -= 1
        for rid in self._busy_steps.pop(so.step, ()):
            self._busy.discard(rid)
        outs = []
        if out.kv_connector_output is not None and self.connector is not None:
            outs.extend(self._update_from_kv_xfer(out.kv_connector_output))
        for rid, error in out.errors.items():        # its LoRA adapter could not be read, its image encoded
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:      # its blocks' KV may be wrong: none is cached
                self._finish(req, RequestStatus.FINISHED_ERROR, written_tokens=0)
                outs.append(EngineCoreOutput(rid, [], "error", error=error, error_status=400))
        if self.model_times:        # --collect-detailed-traces: every request of the step is charged it
            forward, execute = max(out.compute_s - out.sample_s, 0.0), out.worker_s
            for rid in out.req_ids:
                req = self.requests.get(rid)
                if req is not None:
                    req.model_forward_s += forward
                    req.model_execute_s += execute
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids):
            req = self.requests.get(rid)
            prompt_lp = out.prompt_logprobs.get(rid)
            scored = out.prompt_token_id_logprobs.get(rid) if out.prompt_token_id_logprobs else None
            pooled = out.pooler_output.get(rid) if out.pooler_output else None
            if req is None or req.status.finished:
                continue   # aborted meanwhile
            if pooled is not None:      # a pooling request: its prompt is done, and so is it
                outs.append(EngineCoreOutput(rid, [], "stop", num_cached_tokens=req.num_cached_tokens,
                                             first_scheduled_time=req.first_scheduled_time, pooling_output=pooled))
                req.first_output_sent = True
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                continue
            if not (sampled or prompt_lp or scored is not None):
                continue   # a prompt chunk with nothing to report
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            spec_step = None
            if drafts and sampled:
                self._verified(req, drafts, len(sampled) - 1)
                if self.spec_per_request:
                    spec_step = (len(drafts), len(sampled) - 1)
            new_ids: list[int] = []
            status = error = None
            for tok in sampled:
                req.append_output_token_ids([tok])
                new_ids.append(tok)
                status, error = self._check_stop(req, tok), None
                if self.structured is not None and rid in self.structured:
                    status, error = self._advance_grammar(req, tok, status)
                if status is not None:
                    break
            self.counters.generation_tokens += len(new_ids)
            outs.append(EngineCoreOutput(rid, new_ids, logprobs=out.logprobs.get(rid),
                                         prompt_logprobs=prompt_lp,
                                         num_cached_tokens=req.num_cached_tokens))
            if spec_step is not None:
                outs[-1].spec_step = spec_step
            if scored is not None:
                outs[-1].prompt_token_id_logprobs = scored
            if new_ids and out.sampling_masks and rid in out.sampling_masks:
                outs[-1].sampling_mask = [out.sampling_masks[rid]]
            if self.model_times:
                outs[-1].model_times = (req.model_forward_s, req.model_execute_s)
            if not req.first_output_sent:
                outs[-1].num_external_tokens = req.num_external_tokens
            if not req.first_output_sent:
                outs[-1].first_scheduled_time = req.first_scheduled_time
                req.first_output_sent = True
            if status is not None:
                outs[-1].finish_reason = status.finish_reason
                outs[-1].stop_reason = req.stop_reason
                outs[-1].error = error
                outs[-1].kv_transfer_params = self._finish(req, status)
            elif sampled and self.speculative is not None:
                # at most k, and room left for them and the token after them in the context
                room = min(self.speculative.num_speculative_tokens, self.max_model_len - 1 - req.num_tokens)
                proposed = list(out.spec_token_ids.get(rid, ()))[:max(room, 0)]
                if proposed and self.structured is not None and rid in self.structured:
                    proposed = proposed[:self.structured.allowed_drafts(rid, proposed)]   # what its grammar allows
                req.spec_token_ids = proposed
        return outs

    def _verified(self, req: Request, drafts: list[int], num_accepted: int) -> None:
        """The worker accepted the first ``num_accepted`` of the request's scheduled drafts: the
        rejected ones were counted as computed when scheduled, and are not."""
        req.num_computed_tokens -= len(drafts) - num_accepted
        c = self.counters
        c.spec_num_drafts += 1
        c.spec_num_draft_tokens += len(drafts)
        c.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.spec_num_accepted_tokens_per_pos[pos] += 1

    def _advance_grammar(self, req: Request, tok: int,
                         status: RequestStatus | None) -> tuple[RequestStatus | None, str | None]:
        """The request's matcher takes the sampled token: a complete grammar ends the request
        (stop), a token it does not allow is an error."""
        try:
            done = self.structured.accept(req.request_id, tok)
        except ValueError as exc:
            return RequestStatus.FINISHED_ERROR, str(exc)
        return (status or RequestStatus.FINISHED_STOPPED) if done else status, None

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if p.repetition_detection is not None and n_out >= p.min_tokens \
                and p.repetition_detection.repeats(req.output_token_ids):
            req.stop_reason = "repetition_detected"
            return RequestStatus.FINISHED_REPETITION
        return None

    def stats(self) -> SchedulerStats:
        c = self.counters
        return SchedulerStats(c.step, len(self.running), len(self.waiting) + len(self.awaiting_grammar),
                              c.last_scheduled_reqs,
                              c.last_scheduled_tokens, self.kv.usage(), c.num_preemptions,
                              c.prefix_cache_queries, c.prefix_cache_hits, c.prompt_tokens_computed,
                              c.generation_tokens, c.busy_seconds,
                              c.compute_seconds, c.spec_num_drafts, c.spec_num_draft_tokens,
                              c.spec_num_accepted_tokens, list(c.spec_num_accepted_tokens_per_pos),
                              c.external_prefix_cache_queries, c.external_prefix_cache_hits, dict(c.kv_transfer),
                              self.kv.pool.residency.drain() if self.kv.pool.residency is not None else [],
                              estimated_flops=c.estimated_flops, estimated_read_bytes=c.estimated_read_bytes,
                              estimated_write_bytes=c.estimated_write_bytes,
                              encoder_cache_queries=self.encoder_cache.queries,
                              encoder_cache_hits=self.encoder_cache.hits)


def whole_items(features: list, computed: int, n: int) -> int:
    """vLLM's disable_chunked_mm_input: the tokens of a prompt chunk from ``computed`` (``n`` at
    most) that end outside every image: a chunk that would end inside one ends before it, or is
    none (the image waits for a step that holds it whole)."""
    end = computed + n
    for f in features:
        if f.offset < end < f.end:
            return max(f.offset - computed, 0)
    return n
