"""The engine core: starts the worker, builds the KVManager, Executor and Scheduler actors around
it from the resolved config, and supervises the worker. In a server the worker is a child
process (restarted when it dies, up to a limit); offline it is an actor in this event loop."""
from __future__ import annotations

import asyncio
import logging

import msgspec

from actors import topology
from actors.engine.config import EngineConfig, kv_scales_note
from actors.engine.messages import EngineCoreOutputs
from actors.executor.actor import Executor, WorkersDown, WorkersUp
from actors.grammar.actor import GrammarCompilerActor
from actors.grammar.matchers import StructuredOutputs
from actors.kv_manager.actor import KVManager
from actors.kv_manager.kv_cache_spec import describe_groups
from actors.runtime import ActorRef, Node
from actors.runtime.process import ChildProcess, NodeSpec, RestartBudget, decode_info, start_child
from actors.scheduler.actor import SchedulerActor, WorkersLost, WorkersReady
from actors.scheduler.scheduler import Scheduler
from actors.worker.actor import LOAD_TIMEOUT_S, InitKVCache, LoadModel, WorkerActor
from transport.zmq_channel import endpoint

log = logging.getLogger("troupe.engine")

INIT_KV_TIMEOUT_S = 120.0


class EngineCore:
    """Starts the engine's actors on ``node`` and restarts the worker when it dies. ``ipc_dir``:
    where the worker process's socket lives (multiprocess configs only)."""

    def __init__(self, node: Node, config: EngineConfig, ipc_dir: str = "") -> None:
        self.node = node
        self.config = config
        self.ipc_dir = ipc_dir
        self.dp_rank = config.parallel.data_parallel_rank
        self.worker_node = topology.worker_node(0, self.dp_rank)
        self.generation = 0
        self.worker: ChildProcess | None = None
        self._restarts = RestartBudget(config.parallel.max_restarts, config.parallel.restart_window_s)
        self.scheduler: ActorRef | None = None
        self.executor: ActorRef | None = None
        self.kv_manager: ActorRef | None = None
        self.grammar: ActorRef | None = None

    async def start(self) -> EngineConfig:
        """Load the model, allocate the KV cache, start the engine's actors; returns the
        resolved config."""
        worker, self.config = await self._start_worker()
        await worker.ask(InitKVCache(), timeout=INIT_KV_TIMEOUT_S)
        cfg = self.config
        log.info("KV cache: %d blocks of %d tokens (%s%s), %s; max model len %d", cfg.cache.num_blocks,
                 cfg.cache.block_size, cfg.cache.cache_dtype, kv_scales_note(cfg.cache),
                 describe_groups(cfg.kv_cache_groups()), cfg.model.max_model_len)
        self.kv_manager = self.node.spawn(topology.KV_MANAGER, lambda: KVManager(cfg))
        self.grammar = self.node.spawn(topology.GRAMMAR, lambda: GrammarCompilerActor(cfg))
        # the scheduler calls the KV manager's core and reads compiled grammars directly
        kv, grammars = self.kv_manager.colocated(), self.grammar.colocated()
        structured = StructuredOutputs(grammars, cfg.model.arch.vocab_size)
        self.executor = self.node.spawn(topology.EXECUTOR, lambda: Executor(worker))
        outputs = self.node.ref(topology.DETOKENIZER, topology.FRONTEND_NODE, EngineCoreOutputs)
        self.scheduler = self.node.spawn(topology.SCHEDULER, lambda: SchedulerActor(
            Scheduler(cfg, kv, structured), self.executor, outputs, self.grammar, engine_index=self.dp_rank))
        return cfg

    async def _start_worker(self) -> tuple[ActorRef, EngineConfig]:
        """The worker, with the model loaded; and the config it resolved."""
        if not self.config.parallel.multiprocess:
            ref = await self.node.start(topology.WORKER, WorkerActor)
            return ref, await ref.ask(LoadModel(self.config), timeout=LOAD_TIMEOUT_S)
        spec = NodeSpec(self.worker_node, "actors.worker.actor:worker_entry",
                        msgspec.msgpack.encode(self.config), self.ipc_dir, self.node.name,
                        {self.node.name: endpoint(self.ipc_dir, self.node.name)},
                        trace=self.config.observability.trace,
                        flight_dir=self.config.observability.flight_recorder_dir)
        self.worker, ready = await start_child(self.node, spec, ready_timeout=LOAD_TIMEOUT_S,
                                               on_exit=self._worker_exited)
        return self.node.ref(topology.WORKER, self.worker_node), decode_info(ready, EngineConfig)

    # -- worker supervision ------------------------------------------------------------------
    def _worker_exited(self, child: ChildProcess) -> None:
        if self.node.closed.done() or self.scheduler is None:   # dying at start-up: start() reports it
            return
        log.error("%s", child.describe_exit())
        # steps wait for the replacement; running requests go back to the queue (their KV is gone)
        self.executor.tell(WorkersDown(self.generation))
        self.scheduler.tell(WorkersLost(self.generation, child.describe_exit()))
        if not self._restarts.spend():
            self.node.fatal(f"the worker died {self._restarts.describe()}; giving up")
            return
        asyncio.get_running_loop().create_task(self._restart_worker())

    async def _restart_worker(self) -> None:
        try:
            worker, _ = await self._start_worker()
            await worker.ask(InitKVCache(), timeout=INIT_KV_TIMEOUT_S)
        except Exception as exc:  # whatever went wrong, the engine cannot go on without a worker
            self.node.fatal(f"could not restart the worker: {exc}")
            return
        self.generation += 1
        log.info("worker restarted (generation %d)", self.generation)
        self.executor.tell(WorkersUp(self.generation, self.worker_node, topology.WORKER))
        self.scheduler.tell(WorkersReady(self.generation))

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()


async def engine_entry(node: Node, payload: bytes) -> EngineConfig:
    """Entry of the engine-core process: ``payload`` is (ipc dir, config) in msgpack."""
    ipc_dir, config = msgspec.msgpack.decode(payload, type=tuple[str, EngineConfig])
    core = EngineCore(node, config, ipc_dir)
    resolved = await core.start()
    node.on_stop.append(core.stop)
    return resolved
