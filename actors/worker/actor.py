"""Worker actor: the shell around the worker's core (``actors/worker/worker.py``): load the model,
allocate the KV cache, then run one step per message.

The core runs on a thread of its own (every call on the same one: CUDA's current device and
stream are per thread), so the event loop it shares stays free while a step computes: offline,
where the engine core and the frontend are actors on that same loop, the scheduler plans the next
step, and outputs are detokenized and streamed, while the model runs (async scheduling's overlap);
in a worker process, the next step's message is received and decoded meanwhile. Steps still run
one at a time, in order: the actor handles one message at a time."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

import msgspec

from actors import topology
from actors.engine.config import EngineConfig
from actors.engine.messages import ModelRunnerOutput, SchedulerOutput
from actors.runtime import Actor, Msg, Node
from actors.runtime.errors import CallFailed, Refused
from actors.runtime.tracing import SpanRecord, Tracer

if TYPE_CHECKING:
    from actors.worker.worker import Worker

log = logging.getLogger("troupe.worker")


class LoadModel(Msg):
    """Load the checkpoint ``config`` names; the reply is the config resolved by this worker.
    With tensor and pipeline parallelism: this worker's ``tp_rank`` and ``pp_rank`` (its stage),
    and where the ranks meet to form their process group (``init_method``, torch.distributed's)."""
    reply_type: ClassVar[Any] = EngineConfig
    config: EngineConfig
    tp_rank: int = 0
    init_method: str = ""
    pp_rank: int = 0


class InitKVCache(Msg):
    """Allocate the KV cache the resolved config sizes (on CUDA, capture the decode graphs);
    the reply is its size in bytes. ``config``: the engine core's resolved config, whose block
    count every rank allocates (None: this worker's own)."""
    reply_type: ClassVar[Any] = int
    config: EngineConfig | None = None


class ProfileStepCosts(Msg):
    """Time steps of known sizes (Worker.profile_step_costs) for the scheduler's step-cost
    model; the reply is each step's (tokens, attention pairs, compute seconds)."""
    reply_type: ClassVar[Any] = list[tuple[int, int, float]]


class SleepWorker(Msg):
    """Sleep mode: give back the KV cache's memory (``level`` 1) or that and the weights' (2);
    ``kv_cache_only``: the KV cache's only, the weights staying on the device."""
    level: int = 1
    kv_cache_only: bool = False


class WakeWorker(Msg):
    """Sleep mode's end: the weights and/or the KV cache back (``tags``; None: both). The reply:
    whether the worker is fully awake."""
    reply_type: ClassVar[Any] = bool
    tags: list[str] | None = None


class ProfileWorker(Msg):
    """--profiler-config's session: ``start`` it (traces named with ``prefix``; vLLM's per-session
    ``delay_iterations`` and ``max_iterations``, None: the config's), or stop it (the trace written)."""
    start: bool = True
    prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


class WorkerRPC(Msg):
    """vLLM's collective_rpc: a worker method by name (Worker.rpc; ``reload_weights``) with
    JSON-like arguments. A worker's reply: the method's result; the executor's and the engine's:
    every rank's, in rank order (with data parallelism, engine after engine)."""
    reply_type: ClassVar[Any] = Any
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


class StepResult(msgspec.Struct):
    ran: bool                                   # the worker ran the step asked about
    output: ModelRunnerOutput | None = None     # and this was its output


class StepStatus(Msg):
    """Did step ``step`` run, and with what output? Sent when its reply is late: queued behind
    the step (same lane), it is answered once the step ran, so it tells a lost reply (ran: the
    output again) from a lost step (not ran: send it again)."""
    reply_type: ClassVar[Any] = StepResult
    step: int


class StepOutOfOrder(RuntimeError):
    """A step came before the step it follows (that one was lost on the way and is being sent
    again): it is refused without running, and sent again after its predecessor."""


WorkerProtocol = (LoadModel | InitKVCache | ProfileStepCosts | SchedulerOutput | StepStatus | SleepWorker | WakeWorker
                  | ProfileWorker | WorkerRPC)

T = TypeVar("T")

LOAD_TIMEOUT_S = 600.0
PROFILE_STOP_S = 60.0            # writing an open profiling session's trace when the worker stops
CONNECTOR_STOP_S = 5.0          # a KV connector's threads and agents, when the worker stops
RECENT_STEPS = 8                 # outputs kept for StepStatus (async scheduling keeps two in flight)


class WorkerActor(Actor):
    protocol = WorkerProtocol

    def __init__(self) -> None:
        self.core: Worker | None = None            # until LoadModel
        self.recent: OrderedDict[int, ModelRunnerOutput] = OrderedDict()   # for StepStatus
        self.last_step_number = -1                 # the last step taken (run, or failed)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="troupe-worker-core")   # the core's calls

    async def stopped(self) -> None:
        if self.core is not None and self.core.profiler is not None and self.core.profiler.active:
            try:                                   # a profiling session's trace is written first
                await asyncio.wait_for(self._on_core_thread(self.core.profiler.stop), PROFILE_STOP_S)
            except Exception as exc:               # noqa: BLE001 -- stopping goes on regardless
                log.warning("the profiling session's trace was not written: %s", exc)
        if self.core is not None and self.core.kv_connector is not None:
            try:                                   # after the step under way: its threads end
                await asyncio.wait_for(self._on_core_thread(self.core.kv_connector.shutdown), CONNECTOR_STOP_S)
            except Exception as exc:               # noqa: BLE001 -- stopping goes on regardless
                log.warning("the KV connector did not shut down: %s", exc)
        self._thread.shutdown(wait=False)          # a step under way finishes; nothing new starts

    async def _on_core_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def receive(self, msg: WorkerProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                self.ctx.link(list(msg.num_scheduled_tokens))
                if msg.prev_step >= 0 and msg.prev_step != self.last_step_number:
                    raise StepOutOfOrder(f"step {msg.step} follows step {msg.prev_step}, but the last "
                                         f"step here was {self.last_step_number}")
                self.last_step_number = msg.step
                t0 = time.perf_counter()
                out = await self._on_core_thread(self._loaded().execute_model, msg)
                out.worker_s = time.perf_counter() - t0
                if out.kv_connector_output is not None and out.kv_connector_output.transfers:
                    record_transfers(self.ctx.node.tracer, out.kv_connector_output.transfers)
                self.recent[msg.step] = out
                while len(self.recent) > RECENT_STEPS:
                    self.recent.popitem(last=False)
                return out
            case StepStatus(step=step):
                out = self.recent.get(step)
                return StepResult(out is not None, out)
            case LoadModel(config=config, tp_rank=tp_rank, init_method=init_method, pp_rank=pp_rank):
                # The core imports torch and the models: imported here, at the first load, and
                # not with this protocol, which the engine-core process imports without torch.
                from actors.worker.worker import Worker
                self.core = await self._on_core_thread(Worker, config, tp_rank, init_method, pp_rank)
                return self.core.config
            case InitKVCache(config=config):
                return await self._on_core_thread(self._loaded().init_kv_cache, config)
            case ProfileStepCosts():
                return await self._on_core_thread(self._loaded().profile_step_costs)
            case SleepWorker(level=level, kv_cache_only=kv_cache_only):
                return await self._on_core_thread(self._loaded().sleep, level, kv_cache_only)
            case WakeWorker(tags=tags):
                return await self._on_core_thread(self._loaded().wake_up, tags)
            case WorkerRPC(method=method, args=args, kwargs=kwargs):
                try:
                    return await self._on_core_thread(self._loaded().rpc, method, args, kwargs)
                except (ValueError, TypeError) as exc:      # an unknown method or argument: the caller's
                    raise Refused(str(exc)) from None
                except Exception as exc:    # noqa: BLE001 -- the method's failure goes back to its caller
                    log.warning("collective_rpc %s failed", method, exc_info=True)
                    raise CallFailed(f"{type(exc).__name__}: {exc}") from None
            case ProfileWorker(start=start, prefix=prefix, delay_iterations=delay, max_iterations=limit):
                if start and self._loaded().config.profiler.profiler == "torch":
                    from actors.worker.profiler import warm_up
                    warm_up()                      # here, on the thread that loaded torch
                return await self._on_core_thread(self._loaded().profile, start, prefix, delay, limit)

    def _loaded(self) -> Worker:
        if self.core is None:
            raise RuntimeError("no model loaded (LoadModel first)")
        return self.core


def record_transfers(tracer: Tracer, transfers: list[tuple[str, str, int, int, int]]) -> None:
    """KV transfers (a KV connector's, run beside the steps) as spans of their requests, so they
    show as hops of the request's waterfall."""
    if not tracer.enabled:
        return
    for rid, kind, start, end, nbytes in transfers:
        tracer.record(SpanRecord(0, tracer.new_span_id(), 0, 0, tracer.node, "kv_connector", kind, start, start,
                                 end, 0, "error" if kind.endswith("Failed") else "ok", nbytes, (rid,)))


async def worker_entry(node: Node, payload: bytes) -> EngineConfig:
    """Entry of a worker process: start the Worker actor and load the model; the process's
    ready message carries the resolved config. ``payload``: a LoadModel message in msgpack."""
    load = msgspec.msgpack.decode(payload, type=LoadModel)
    ref = await node.start(topology.WORKER, WorkerActor)
    return await ref.ask(load, timeout=LOAD_TIMEOUT_S)
