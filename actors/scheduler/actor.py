"""Scheduler actor: runs the engine step loop around the pure Scheduler.

One step: take what arrived (new requests and aborts wait in the mailbox while a step runs),
schedule (the Scheduler takes blocks from the KV manager's core directly), one
SchedulerOutput to the executor, one EngineCoreOutputs batch to the frontend. A step is queued
by telling ourselves ``Step``, so messages that arrived during a step are handled before the
next one.

With async scheduling (``--async-scheduling``) two steps are in flight: step N+1 is planned and
sent while the worker still runs step N, then N's output is handled; the worker starts N+1 as
soon as N is done, so scheduling, messaging and output handling hide behind its compute. A step
with constrained requests whose tokens are still in flight waits for them first (their matchers
must see every token before the next bitmask). A failed step settles every step in flight
before its requests are failed or recomputed.

With pipeline parallelism (--pipeline-parallel-size N) up to N steps are in flight, each with
requests of its own (the scheduler's batch queue), so the stages overlap.

Pausing (vLLM's ``pause_generation``, POST /pause): ``abort`` aborts every request then takes no
new one, ``wait`` lets the running requests finish and starts no waiting one, ``keep`` freezes
every request where it is. A pause is complete (``drained``) once nothing more would run; then,
for ``abort`` and ``wait`` with ``clear_cache``, the prefix cache is reset. ``ResumeScheduler``
ends it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, ClassVar

from actors.topology import DETOKENIZER
from actors.engine.lora import LoRARequest
from actors.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput,
                                    SchedulerOutput)
from actors.engine.sampling_params import StructuredOutputsParams
from actors.grammar.actor import CompileGrammar
from actors.runtime import Actor, ActorDied, ActorRef, AskTimeout, Msg, RemoteError
from actors.runtime.errors import Refused, passed_on
from actors.runtime.tracing import StepRecord, now_ns
from actors.kv_manager.kv_events import KVEventBatch, ZmqEventPublisher
from actors.scheduler.scheduler import PauseState, Scheduler
from actors.worker.actor import ProfileWorker, SleepWorker, WakeWorker, WorkerRPC

log = logging.getLogger("troupe.scheduler")


class AddRequest(Msg):
    request: EngineCoreRequest


class AbortRequests(Msg):
    lane: ClassVar[str] = "system"
    request_ids: list[str]


class RemoveLoRA(Msg):
    """An adapter was unloaded: the workers drop it from their layer slots and host cache
    before their next step."""
    lora_int_id: int


class PinLoRA(Msg):
    """vLLM's pin_lora: the workers read the adapter now and evict it last."""
    lora_request: LoRARequest


class Step(Msg):
    pass


class ConnectClient(Msg):
    """API server ``client_index`` (--api-server-count) is node ``node`` at ``address``: the
    outputs of its requests go to its detokenizer."""
    client_index: int
    node: str
    address: str


class ClientGone(Msg):
    """API server ``client_index`` is gone (``reason``): its requests are aborted, their outputs dropped."""
    lane: ClassVar[str] = "system"
    client_index: int
    reason: str


class GrammarReady(Msg):
    """The grammar of a request waiting for it was compiled (or could not be: ``error``)."""
    request_id: str
    error: str | None = None


class WorkersLost(Msg):
    """The workers of ``generation`` died (``reason``); a replacement is starting."""
    generation: int
    reason: str


class WorkersReady(Msg):
    """The workers of ``generation`` are up; requests they never saw may run on them."""
    generation: int


PAUSE_MODES = ("abort", "wait", "keep")       # vLLM's PauseMode


class PauseStatus(Msg):
    """``paused``: a pause is on; ``drained``: and it is complete (nothing more runs until it ends)."""
    paused: bool
    drained: bool


class PauseScheduler(Msg):
    """Pause generation (``mode``: one of PAUSE_MODES)."""
    reply_type: ClassVar[Any] = PauseStatus
    lane: ClassVar[str] = "system"
    mode: str = "abort"
    clear_cache: bool = True


class ResumeScheduler(Msg):
    """End a pause."""
    reply_type: ClassVar[Any] = PauseStatus
    lane: ClassVar[str] = "system"


class GetPauseStatus(Msg):
    reply_type: ClassVar[Any] = PauseStatus
    lane: ClassVar[str] = "system"


class WeightVersion(Msg):
    """vLLM's weight version (the label of the weights that sample the outputs from now on):
    ``new`` sets it (None: asks). The reply: the version now."""
    reply_type: ClassVar[Any] = str
    lane: ClassVar[str] = "system"
    new: str | None = None


class SleepEngine(Msg):
    """Sleep mode, once paused: the workers give back the KV cache (``level`` 1) or that and the
    weights (2). ``kv_cache_only``: vLLM's release_kv_cache_memory, the KV cache only (the
    weights stay where they are, on a GPU too), with no request held. The reply: the level now."""
    reply_type: ClassVar[Any] = int
    level: int = 1
    kv_cache_only: bool = False


class WakeEngine(Msg):
    """The workers take back ``tags`` ("weights", "kv_cache"; None: both). The reply: whether
    they are fully awake."""
    reply_type: ClassVar[Any] = bool
    tags: list[str] | None = None


class ResetEncoderCache(Msg):
    """vLLM's reset_encoder_cache: every image's embeddings are forgotten (the workers drop
    theirs with the next step); images still needed are encoded again."""
    lane: ClassVar[str] = "system"


class ProfileEngine(Msg):
    """--profiler-config's session in every worker: start it (``prefix``, ``delay_iterations``,
    ``max_iterations``: vLLM's per-session options) or stop it."""
    start: bool = True
    prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


SchedulerProtocol = (AddRequest | AbortRequests | Step | GrammarReady | WorkersLost | WorkersReady | RemoveLoRA
                     | PinLoRA
                     | ConnectClient | ClientGone | PauseScheduler | ResumeScheduler | GetPauseStatus | SleepEngine | WakeEngine | ProfileEngine
                     | WorkerRPC | WeightVersion | ResetEncoderCache)

# worker methods after which the prefix cache holds keys and values of the old weights
NEW_WEIGHTS = ("reload_weights", "finish_weight_update", "reset_weights")
STEP_TIMEOUT_S = 600.0
SLEEP_TIMEOUT_S = 600.0          # a wake-up after level 2 reads the weights again
KV_POLL_EMIT_S = 0.5             # polls that changed nothing still send the stats this often
KV_POLL_S = 0.02                 # with only KV transfers under way, how often the worker is asked about them
GRAMMAR_TIMEOUT_S = 120.0
MAX_EARLY_ABORTS = 4096          # remembered ids of aborts that came before their request


@dataclass(slots=True)
class _InFlight:
    """A step sent to the executor: its reply, and when it was planned (for its StepRecord)."""
    so: SchedulerOutput
    reply: asyncio.Future[ModelRunnerOutput]
    t0: int                      # schedule() began
    t1: int                      # schedule() ended: sent
    kv_ns: int                   # the KV manager's time within schedule()
    t_reply: int = 0             # the reply arrived (with two in flight, it may wait to be handled)

    def note_reply(self, _: asyncio.Future[ModelRunnerOutput]) -> None:
        self.t_reply = now_ns()


class SchedulerActor(Actor):
    protocol = SchedulerProtocol
    on_failure = "escalate"      # an exception here means broken scheduling state

    def __init__(self, core: Scheduler, executor: ActorRef, outputs: ActorRef,
                 grammar: ActorRef | None = None, generation: int = 0, engine_index: int = 0,
                 kv_publisher: ZmqEventPublisher | None = None) -> None:
        """``kv_publisher``: where the KV events go (--kv-events-config; None: off)."""
        self.core = core
        self._kv_publisher = kv_publisher
        self._kv_flush_queued = False
        self.engine_index = engine_index     # this engine core's data-parallel rank, on its outputs
        self.executor = executor
        self.outputs = outputs
        # where outputs go, by API server (--api-server-count; 0: the frontend's), and the API
        # server of each open request of the others
        self.clients: dict[int, ActorRef] = {0: outputs}
        self._client_of: dict[str, int] = {}
        self.grammar = grammar
        self._tasks: set[asyncio.Task[None]] = set()      # grammar compiles under way
        self.generation = generation
        self._pins: dict[int, LoRARequest] = {}     # pinned adapters (pin_lora), re-pinned on a restarted worker
        self.paused = False
        self._step_queued = False
        self._last_step_start = 0.0
        self._last_step_end = 0              # monotonic ns: the gap before the next step
        self._depth = core.batch_queue_size     # steps in flight at most (async scheduling, pipeline stages)
        self._in_flight: deque[_InFlight] = deque()
        self.sleep_level = 0                 # sleep mode: what the workers gave back (0: nothing)
        self.weight_version = "default"      # vLLM's: the weights' version (finish_weight_update, /update_weight_version)
        # Aborts of requests not (yet) known here: an abort sent while the request was being
        # admitted may overtake it, and the request must then not run for nobody.
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._last_emit = 0.0                # time.monotonic() of the last EngineCoreOutputs
        self._clear_cache_when_drained = False   # a pause (abort / wait) resets the prefix cache once complete

    async def started(self) -> None:
        if self._kv_publisher is not None:
            self.core.record_kv_events(self._queue_kv_flush)

    async def stopped(self) -> None:
        if self._kv_publisher is not None:
            self._flush_kv_events()
            self._kv_publisher.shutdown()
            self._kv_publisher = None

    def _queue_kv_flush(self) -> None:
        """KV events were noted: publish them (as one batch) once the current handler is done."""
        if not self._kv_flush_queued:
            self._kv_flush_queued = True
            asyncio.get_running_loop().call_soon(self._flush_kv_events)

    def _flush_kv_events(self) -> None:
        self._kv_flush_queued = False
        events = self.core.take_kv_events()
        if events and self._kv_publisher is not None:
            self._kv_publisher.publish(KVEventBatch(time.time(), events, self.engine_index))

    async def receive(self, msg: SchedulerProtocol) -> Any:
        match msg:
            case AddRequest(request=r):
                self.ctx.link((r.request_id,))
                if r.client_index:
                    if r.client_index not in self.clients:
                        log.warning("request %s dropped: API server %d is not connected", r.request_id,
                                    r.client_index)
                        return None
                    self._client_of[r.request_id] = r.client_index
                if r.request_id in self._early_aborts:     # its abort came first
                    del self._early_aborts[r.request_id]
                    self._emit([EngineCoreOutput(r.request_id, [], "abort")])
                    return None
                err = self.core.add_request(r)
                if err is not None:
                    self._emit([err])
                elif r.request_id in self.core.awaiting_grammar:
                    task = asyncio.ensure_future(self._compile_grammar(r.request_id,
                                                                       r.sampling_params.structured_outputs))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                self._kick()
            case GrammarReady(request_id=rid, error=error):
                self.ctx.link((rid,))
                self._emit(self.core.grammar_ready(rid, error))
                self._kick()
            case AbortRequests(request_ids=ids):
                self.ctx.link(ids)
                outs = self.core.abort_requests(ids)
                aborted = {o.request_id for o in outs}
                for rid in ids:
                    if rid not in aborted and not self.core.has_request(rid):
                        self._early_aborts[rid] = None
                while len(self._early_aborts) > MAX_EARLY_ABORTS:
                    self._early_aborts.popitem(last=False)
                self._emit(outs)
                self._kick()
            case RemoveLoRA(lora_int_id=lora_id):
                self.core.removed_lora_ids.append(lora_id)
                self._pins.pop(lora_id, None)
            case PinLoRA(lora_request=req):
                self._pins[req.lora_int_id] = req
                self.core.pinned_loras.append(req)
                self._kick()
            case ConnectClient(client_index=c, node=name, address=address):
                self.ctx.node.connect(name, address)
                self.clients[c] = self.ctx.node.ref(DETOKENIZER, name, EngineCoreOutputs)
                log.info("API server %d connected (node '%s')", c, name)
            case ClientGone(client_index=c, reason=reason):
                self._client_gone(c, reason)
            case Step():
                self._step_queued = False
                await self._step()
                self._kick()
                if not (self._step_queued and (self.core.has_work() or self._in_flight)):
                    # idle now (or only polling KV transfers): close the cycle, start afresh
                    self._account_cycle()
                    self._last_step_start = 0.0
            case WorkersLost(reason=reason):
                self._workers_lost(reason)
            case WorkersReady(generation=g):
                if g != self.generation:
                    self.generation = g
                    self._workers_lost("the worker process was restarted")
                    self.core.reset_blocks()         # the new worker's cache holds nothing
                    self.core.pinned_loras = list(self._pins.values())   # nor the pinned adapters
                self.paused = False
                self._kick()
            case PauseScheduler(mode=mode, clear_cache=clear_cache):
                return self._pause(mode, clear_cache)
            case ResumeScheduler():
                if self.core.pause_state != PauseState.UNPAUSED:
                    log.info("generation resumed")
                self.core.pause_state = PauseState.UNPAUSED
                self._clear_cache_when_drained = False
                self._kick()
                return self._pause_status()
            case GetPauseStatus():
                return self._pause_status()
            case SleepEngine(level=level, kv_cache_only=kv_cache_only):
                status = self._pause_status()
                if kv_cache_only and (not status.drained or self._in_flight or self.core.running
                                      or self.core.waiting):
                    raise Refused("release_kv_cache_memory() requires a completed pause first (POST "
                                  "/pause?mode=abort or wait: no request held or queued)")
                if not status.drained or self._in_flight:
                    raise RuntimeError("the engine sleeps once generation is paused and nothing runs")
                kept = self.core.recompute_running()     # the KV cache a keep pause held goes: vLLM's
                if kept:                                 # kept requests are computed again after wake-up
                    log.info("sleep: %d kept request(s) will be computed again after wake-up", kept)
                self.core.kv.reset_prefix_cache()        # no cached prefix outlives the cache's contents
                await self.executor.ask(SleepWorker(level, kv_cache_only), timeout=SLEEP_TIMEOUT_S)
                self.sleep_level = level
                return level
            case WeightVersion(new=new):
                if new is not None:
                    self.weight_version = new
                return self.weight_version
            case WorkerRPC(timeout=timeout):
                try:
                    results = await self.executor.ask(msg, timeout=(timeout or SLEEP_TIMEOUT_S) + 5)
                except RemoteError as exc:
                    raise passed_on(exc) from None
                if msg.method in NEW_WEIGHTS:            # no new request reads keys of the old weights
                    self.core.kv.reset_prefix_cache()
                    self.core.reset_encoder_cache()      # nor embeddings of the old encoder
                return results
            case ResetEncoderCache():
                self.core.reset_encoder_cache()
            case ProfileEngine(start=start, prefix=prefix, delay_iterations=delay, max_iterations=limit):
                await self.executor.ask(ProfileWorker(start, prefix, delay, limit), timeout=SLEEP_TIMEOUT_S)
            case WakeEngine(tags=tags):
                awake = await self.executor.ask(WakeWorker(tags), timeout=SLEEP_TIMEOUT_S)
                if awake:
                    self.sleep_level = 0
                return awake

    def _pause(self, mode: str, clear_cache: bool) -> PauseStatus:
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")      # vLLM's words
        if mode == "abort":
            self._emit(self.core.abort_all())
        self.core.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        self._clear_cache_when_drained = clear_cache and mode != "keep"
        log.info("generation paused (mode %s)", mode)
        self._kick()                      # steps in flight are still settled
        return self._pause_status()

    def _pause_status(self) -> PauseStatus:
        """Where a pause stands; once complete, the prefix cache is reset if it asked for that."""
        if self.core.pause_state == PauseState.UNPAUSED:
            return PauseStatus(False, False)
        drained = not (self._in_flight or self.core.has_work() or self._step_queued)
        if drained and self._clear_cache_when_drained:
            self._clear_cache_when_drained = False
            self.core.kv.reset_prefix_cache()
        return PauseStatus(True, drained)

    async def _compile_grammar(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Have the GrammarCompiler compile a waiting request's grammar; GrammarReady to
        ourselves when it is done (the request waits without holding back the queue)."""
        try:
            await self.grammar.ask(CompileGrammar(spec, request_id), timeout=GRAMMAR_TIMEOUT_S)
            error = None
        except (RemoteError, AskTimeout, ActorDied) as exc:
            error = f"the grammar cannot be compiled: {exc.message if isinstance(exc, RemoteError) else exc}"
        self.ctx.self_ref.tell(GrammarReady(request_id, error))

    def _kick(self) -> None:
        """Queue a step when there is work (or a step in flight to finish); while only KV
        transfers are under way, a step without tokens every KV_POLL_S polls the worker for them."""
        if self._step_queued or self.paused:
            return
        if self.core.has_work() or self._in_flight:
            self._step_queued = True
            self.ctx.self_ref.tell(Step())
        elif self.core.kv_connector_pending():
            self._step_queued = True
            asyncio.get_running_loop().call_later(KV_POLL_S, self.ctx.self_ref.tell, Step())

    async def _step(self) -> None:
        """Plan and send the next step; then settle the oldest step in flight when the
        pipeline is full (or nothing new could be planned)."""
        sent = False
        if self.core.has_work() or self.core.kv_connector_pending():
            if self.core.has_work():
                self._account_cycle()
            if self._in_flight and self.core.grammar_needs_outputs():
                await self._settle_all()             # the matchers see the tokens in flight first
            if self.paused or not (self.core.has_work() or self.core.kv_connector_pending()):
                return
            t0, kv0 = now_ns(), self.core.kv.busy_ns
            so = self.core.schedule()
            if so.num_scheduled_tokens or so.kv_connector_metadata is not None:
                self.ctx.link(list(so.num_scheduled_tokens))
                reply = asyncio.ensure_future(self.executor.ask(so, timeout=STEP_TIMEOUT_S))
                f = _InFlight(so, reply, t0, now_ns(), self.core.kv.busy_ns - kv0)
                reply.add_done_callback(f.note_reply)
                self._in_flight.append(f)
                sent = True
        while self._in_flight and (len(self._in_flight) >= self._depth or not sent):
            await self._settle_oldest()
            sent = True                              # one settled is progress enough

    async def _settle_all(self) -> None:
        while self._in_flight:
            await self._settle_oldest()

    async def _settle_oldest(self) -> None:
        """Wait for the oldest step in flight and hand its output to the scheduler; a failure
        settles every step in flight (their outputs are dropped) before it is handled."""
        f = self._in_flight.popleft()
        try:
            runner_out = await f.reply
        except (ActorDied, RemoteError, AskTimeout) as exc:
            reason = exc.message if isinstance(exc, RemoteError) else str(exc)
            log.error("step %d failed on the workers: %s", f.so.step, reason)
            await self._drop_in_flight()
            if isinstance(exc, ActorDied) or (isinstance(exc, RemoteError) and exc.error_type == "ActorDied"):
                self._workers_lost(reason)      # recomputed once the replacement is up
            else:
                self._emit(self.core.fail_running(f"the worker failed: {reason}"))
            return
        self.core.counters.compute_seconds += runner_out.compute_s
        self.core.observe_step_time(f.so.step, runner_out.compute_s)
        t2, kv2 = now_ns(), self.core.kv.busy_ns
        outs = self.core.update_from_output(f.so, runner_out)
        # a poll of KV transfers reports outputs, its last state, and otherwise the stats now and then
        if (outs or f.so.num_scheduled_tokens or not self.core.kv_connector_pending()
                or time.monotonic() - self._last_emit > KV_POLL_EMIT_S):
            self._emit(outs)
        tracer = self.ctx.node.tracer
        if tracer.enabled and f.so.num_scheduled_tokens:      # not the polls of KV transfers
            t3 = now_ns()
            tracer.record_step(self._step_record(f.so, runner_out, (f.t0, f.t1, f.t_reply or t2, t3),
                                                 (f.kv_ns, self.core.kv.busy_ns - kv2)))
        self._last_step_end = now_ns()

    async def _drop_in_flight(self) -> None:
        """Wait for every step in flight to settle, whatever its outcome, and drop its output."""
        pending = [f.reply for f in self._in_flight]
        self._in_flight.clear()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _step_record(self, so: SchedulerOutput, out: ModelRunnerOutput, t: tuple[int, int, int, int],
                     kv: tuple[int, int]) -> StepRecord:
        """Where the step's time went: scheduling (less its KV bookkeeping), KV bookkeeping,
        the worker's input preparation, forward and sampling, messaging (the round trip less the
        worker's time; with async scheduling, also the wait behind the step before it), and
        output handling (from the reply's arrival)."""
        t0, t1, t2, t3 = t
        ms = 1e-6
        worker_ns = out.worker_s * 1e9
        phases = {"schedule": (t1 - t0 - kv[0]) * ms, "kv": (kv[0] + kv[1]) * ms,
                  "prepare": (out.worker_s - out.compute_s) * 1e3, "forward": (out.compute_s - out.sample_s) * 1e3,
                  "sample": out.sample_s * 1e3, "messaging": max(t2 - t1 - worker_ns, 0) * ms,
                  "output": (t3 - t2 - kv[1]) * ms}
        gap = t0 - self._last_step_end if self._last_step_end else 0
        return StepRecord(so.step, t0, t3, gap, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                          {k: round(v, 4) for k, v in phases.items()})

    def _workers_lost(self, reason: str) -> None:
        """Stop stepping until WorkersReady; the running requests' KV is gone with the worker,
        so they go back to the queue to be recomputed (those that lost too many workers fail).
        The outputs of steps still in flight are not waited for."""
        self.paused = True
        for f in self._in_flight:
            f.reply.cancel()
        self._in_flight.clear()
        self._emit(self.core.requeue_running(reason))

    def _account_cycle(self) -> None:
        """Steps that follow each other back to back count their whole cycle as busy time: the
        part not spent in model compute is the engine's overhead (scheduling, messaging, input
        preparation, output processing)."""
        now = time.perf_counter()
        if self._last_step_start:
            self.core.counters.busy_seconds += now - self._last_step_start
        self._last_step_start = now

    def _emit(self, outs: list[EngineCoreOutput]) -> None:
        """The outputs to the API servers of their requests, with the stats (to every API server:
        each one's router and gauges read them)."""
        self._last_emit = time.monotonic()
        if len(self.clients) == 1:
            self.outputs.tell(EngineCoreOutputs(outs, self.core.stats(), self.engine_index, self.weight_version))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {c: [] for c in self.clients}
        for o in outs:
            c = (self._client_of.pop(o.request_id, 0) if o.finish_reason is not None
                 else self._client_of.get(o.request_id, 0))
            if c in by_client:
                by_client[c].append(o)
        stats = self.core.stats()
        for c, ref in list(self.clients.items()):
            try:
                ref.tell(EngineCoreOutputs(by_client[c], stats, self.engine_index, self.weight_version))
            except ActorDied as exc:
                if c == 0:
                    raise
                self._client_gone(c, str(exc))

    def _client_gone(self, c: int, reason: str) -> None:
        """API server ``c`` is gone: nobody reads its requests' outputs; they are aborted."""
        if c == 0 or self.clients.pop(c, None) is None:
            return
        ids = [rid for rid, owner in self._client_of.items() if owner == c]
        for rid in ids:
            del self._client_of[rid]
        log.warning("API server %d is gone (%s): %d of its requests aborted", c, reason, len(ids))
        if ids:
            self.core.abort_requests(ids)
            self._kick()
