"""The engine core: starts the worker, builds the KVManager, Executor and Scheduler actors around
it from the resolved config, and supervises the worker. In a server the worker is a child
process (restarted when it dies, up to a limit); offline it is an actor in this event loop.

With tensor and pipeline parallelism there is one worker process per rank (tensor-parallel ranks
times pipeline stages, rank = stage * tp + tp rank); they form a process group (meeting at a file
in the IPC directory, one per generation) and run every step together, the last stage's first
rank giving its output. The KV cache is sized by the rank with the fewest blocks (a stage's
cache holds its layers only), and every rank allocates that many. One that dies breaks the
group: the others are stopped and all are started again, as one worker would be.

With --distributed-executor-backend ray the ranks are Ray actors on a Ray cluster, in a placement
group of one bundle per rank (actors/runtime/ray_nodes.py); they meet at the first rank's
machine over TCP, reach this node at its cluster IP, and are supervised and restarted as the
processes are. With --nnodes N (mp) this machine runs the first N-th of the ranks and the other
machines' ranks hosts start the rest when asked (actors/engine/multinode.py); they meet here, at
--master-addr, and reach this node at --master-addr:--master-port."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time

import msgspec

from actors import topology
from actors.engine.config import EngineConfig, kv_scales_note
from actors.engine.messages import EngineCoreOutputs
from actors.engine.multinode import RankHosts, RankToStart, RemoteRank, describe_ranks, free_port
from actors.executor.actor import Executor, WorkersDown, WorkersUp
from actors.grammar.actor import GrammarCompilerActor
from actors.grammar.matchers import StructuredOutputs
from actors.kv_manager.actor import KVManager
from actors.kv_manager.kv_cache_spec import describe_groups
from actors.runtime import ActorRef, Node
from actors.runtime.errors import AskTimeout
from actors.runtime.process import ChildProcess, NodeSpec, RestartBudget, decode_info, start_child
from actors.runtime.ray_nodes import RayChild, RayPlacement, start_ray_child
from actors.worker.openmp import load_torch_with_short_spin, openmp_env
from actors.kv_manager.kv_events import ZmqEventPublisher
from actors.scheduler.actor import SchedulerActor, WorkersLost, WorkersReady
from actors.scheduler.scheduler import Scheduler
from actors.worker.actor import LOAD_TIMEOUT_S, InitKVCache, LoadModel, ProfileStepCosts, WorkerActor
from transport.zmq_channel import endpoint

log = logging.getLogger("troupe.engine")

INIT_KV_TIMEOUT_S = 120.0
QUIESCE_S = 2.0                  # how long a stopping engine core waits for the step under way


class EngineCore:
    """Starts the engine's actors on ``node`` and restarts the worker when it dies. ``ipc_dir``:
    where the worker process's socket lives (multiprocess configs only)."""

    def __init__(self, node: Node, config: EngineConfig, ipc_dir: str = "") -> None:
        self.node = node
        if config.parallel.nnodes > 1 and not config.parallel.nodes_digest:    # first start: as the user gave it
            config = config.replace(parallel=msgspec.structs.replace(config.parallel,
                                                                     nodes_digest=config.compute_hash()))
        self.config = config
        self.ipc_dir = ipc_dir
        self.dp_rank = config.parallel.data_parallel_rank
        self.tp_size = config.parallel.tensor_parallel_size
        self.world_size = config.parallel.world_size          # tensor-parallel ranks x pipeline stages
        self.worker_nodes = [topology.worker_node(r, self.dp_rank) for r in range(self.world_size)]
        self.generation = 0
        self.workers: list[ChildProcess | RayChild | RemoteRank] = []    # one process per rank
        self.hosts: RankHosts | None = None             # --nnodes: the other machines' ranks hosts
        self.cluster_address = ""                       # and where they reach this node
        self.ray: RayPlacement | None = None            # --distributed-executor-backend ray
        self.rank_hosts: list[str] = []                 # and where its ranks are (their machines' IPs)
        self._scheduler_core: Scheduler | None = None
        self.engine_address = ""                        # where Ray-placed ranks reach this node
        self._restarting = False
        self._restarts = RestartBudget(config.parallel.max_restarts, config.parallel.restart_window_s)
        self.scheduler: ActorRef | None = None
        self.executor: ActorRef | None = None
        self.kv_manager: ActorRef | None = None
        self.grammar: ActorRef | None = None

    async def start(self) -> EngineConfig:
        """Load the model, allocate the KV cache, start the engine's actors; returns the
        resolved config."""
        if self.config.parallel.nnodes > 1:
            self._listen_for_nodes()
        workers, self.config = await self._start_workers()
        await asyncio.gather(*(w.ask(InitKVCache(self.config), timeout=INIT_KV_TIMEOUT_S) for w in workers))
        cfg = self.config
        log.info("KV cache: %d blocks of %d tokens (%s%s), %s; max model len %d", cfg.cache.num_blocks,
                 cfg.cache.block_size, cfg.cache.cache_dtype, kv_scales_note(cfg.cache),
                 describe_groups(cfg.kv_cache_groups()), cfg.model.max_model_len)
        self.kv_manager = self.node.spawn(topology.KV_MANAGER, lambda: KVManager(cfg))
        self.grammar = self.node.spawn(topology.GRAMMAR, lambda: GrammarCompilerActor(cfg))
        # the scheduler calls the KV manager's core and reads compiled grammars directly
        kv, grammars = self.kv_manager.colocated(), self.grammar.colocated()
        structured = StructuredOutputs(grammars, cfg.model.arch.vocab_size)
        self._scheduler_core = scheduler = Scheduler(cfg, kv, structured)
        self._tell_rank_hosts()
        # the step-cost model fitted before the first request (pipeline stages: on the served steps)
        if cfg.scheduler.stall_free and cfg.parallel.pipeline_parallel_size == 1:
            t0 = time.monotonic()
            try:
                costs = await asyncio.gather(*(w.ask(ProfileStepCosts(), timeout=INIT_KV_TIMEOUT_S)
                                               for w in workers))
            except AskTimeout:
                log.warning("the step-cost profile took over %.0f s: the model is fitted as requests come",
                            INIT_KV_TIMEOUT_S)
            else:
                scheduler.seed_step_costs(costs[0])
                log.info("step-cost model fitted on %d profiled steps in %.1f s: %s", len(costs[0]),
                         time.monotonic() - t0, scheduler.cost.describe() if scheduler.cost.ready
                         else "too few, fitted as requests come")
        output_rank = (cfg.parallel.pipeline_parallel_size - 1) * self.tp_size    # the last stage's first rank
        self.executor = self.node.spawn(topology.EXECUTOR, lambda: Executor(workers, output_rank))
        outputs = self.node.ref(topology.DETOKENIZER, topology.FRONTEND_NODE, EngineCoreOutputs)
        publisher = None
        if cfg.kv_events is not None and cfg.kv_events.active:      # bound now: a taken port fails the start
            publisher = ZmqEventPublisher(cfg.kv_events, self.dp_rank)
            log.info("KV events published on %s%s", publisher.endpoint,
                     f" (replay on {publisher.replay_endpoint})" if publisher.replay_endpoint else "")
        self.scheduler = self.node.spawn(topology.SCHEDULER, lambda: SchedulerActor(
            scheduler, self.executor, outputs, self.grammar, engine_index=self.dp_rank, kv_publisher=publisher))
        return cfg

    async def _start_workers(self) -> tuple[list[ActorRef], EngineConfig]:
        """The workers (one per rank), with the model loaded; and the config they resolved, with
        the fewest KV cache blocks any rank has room for."""
        if not self.config.parallel.multiprocess:
            load_torch_with_short_spin()     # the worker's OpenMP threads, as a worker process's
            ref = await self.node.start(topology.WORKER, WorkerActor)
            return [ref], await ref.ask(LoadModel(self.config), timeout=LOAD_TIMEOUT_S)
        p = self.config.parallel
        local = range(self.world_size)
        if p.distributed_executor_backend == "ray":
            init = await self._place_ranks()
        elif p.nnodes > 1:    # the ranks of every machine meet at rank 0's, this one
            init, local = f"tcp://{p.master_addr}:{free_port(p.master_addr)}", p.node_ranks(0)
        else:     # the ranks' meeting point: a file of this generation (a fresh group after a restart)
            init = (f"file://{self.ipc_dir}/tp-{self.dp_rank}-{self.generation}-{os.getpid()}"
                    if self.world_size > 1 else "")
        started = await asyncio.gather(*(self._start_rank(r, init) for r in local),
                                       *(self._start_node(n, init) for n in range(1, p.nnodes)),
                                       return_exceptions=True)
        failed = [x for x in started if isinstance(x, BaseException)]
        ranks = [y for x in started if not isinstance(x, BaseException) for y in (x if isinstance(x, list) else [x])]
        self.workers = [w for w, _ in ranks]
        if failed:
            await asyncio.gather(*(w.stop() for w in self.workers))
            raise failed[0]
        if p.nnodes > 1:      # rank order; where each runs, for the KV connector's side channel
            ranks.sort(key=lambda x: self.worker_nodes.index(x[0].name))
            self.workers = [w for w, _ in ranks]
            self.rank_hosts = [w.ip if isinstance(w, RemoteRank) else p.master_addr for w in self.workers]
        configs = [decode_info(ready, EngineConfig) for _, ready in ranks]
        return ([self.node.ref(topology.WORKER, node) for node in self.worker_nodes],
                min(configs, key=lambda c: c.cache.num_blocks))

    def _listen_for_nodes(self) -> None:
        """--nnodes: receive at --master-addr:--master-port too, where the other machines' ranks
        hosts join (``RankHosts``)."""
        p = self.config.parallel
        try:
            self.cluster_address = self.node.transport.bind(f"tcp://{p.master_addr}:{p.master_port}")
        except Exception as exc:
            raise ValueError(f"--master-addr {p.master_addr} --master-port {p.master_port}: this engine core "
                             f"cannot listen there ({exc})") from None
        self.hosts = RankHosts(self.config, self._worker_exited)
        self.node.spawn(topology.RANK_HOSTS, lambda: self.hosts)
        log.info("worker ranks %s here, the rest on %d other machine%s joining at %s",
                 describe_ranks(p.node_ranks(0)), p.nnodes - 1, "s" if p.nnodes > 2 else "",
                 self.cluster_address)

    async def _start_node(self, node_rank: int, init_method: str) -> list[tuple[RemoteRank, object]]:
        """Machine ``node_rank``'s ranks (--nnodes), started by its ranks host once it has joined."""
        ranks = [RankToStart(r, self.worker_nodes[r],
                             msgspec.msgpack.encode(LoadModel(self.config, r % self.tp_size, init_method,
                                                              r // self.tp_size)))
                 for r in self.config.parallel.node_ranks(node_rank)]
        obs = self.config.observability
        return await self.hosts.start_ranks(node_rank, self.generation, ranks, self.cluster_address, obs.trace,
                                            obs.flight_recorder_dir)

    async def _place_ranks(self) -> str:
        """A Ray actor per rank in this engine's placement group (reserved at the first start);
        returns the ranks' meeting point (the first rank's machine)."""
        if self.ray is None:
            self.ray = RayPlacement(self.world_size, self.config.device.device, f"{self.node.name}-{os.getpid()}")
            await self.ray.start()
            self.engine_address = self.ray.engine_address(self.node)
        self.ray.new_hosts(self.worker_nodes, self.generation)
        self.rank_hosts = await self.ray.host_ips()        # where each rank's KV side channel is
        return await self.ray.meeting_point() if self.world_size > 1 else ""

    def _tell_rank_hosts(self) -> None:
        """The KV connector's scheduler side learns where the Ray-placed ranks are."""
        connector = self._scheduler_core.connector if self._scheduler_core is not None else None
        if connector is not None and self.rank_hosts:
            connector.set_rank_hosts(self.rank_hosts)

    async def _start_rank(self, rank: int, init_method: str):
        address = self.engine_address or self.node.transport.ipc_address
        spec = NodeSpec(self.worker_nodes[rank], "actors.worker.actor:worker_entry",
                        msgspec.msgpack.encode(LoadModel(self.config, rank % self.tp_size, init_method,
                                                         rank // self.tp_size)), self.ipc_dir,
                        self.node.name, {self.node.name: address},
                        trace=self.config.observability.trace,
                        flight_dir=self.config.observability.flight_recorder_dir)
        if self.ray is not None:
            return await start_ray_child(self.node, spec, self.ray.hosts[rank], ready_timeout=LOAD_TIMEOUT_S,
                                         on_exit=self._worker_exited, env=openmp_env())
        return await start_child(self.node, spec, ready_timeout=LOAD_TIMEOUT_S, on_exit=self._worker_exited,
                                 env=openmp_env())

    # -- worker supervision ------------------------------------------------------------------
    def _worker_exited(self, child: ChildProcess | RayChild | RemoteRank) -> None:
        if self.node.closed.done() or self.scheduler is None or self._restarting:
            return       # dying at start-up (start() reports it), or stopped by a restart under way
        log.error("%s", child.describe_exit())
        self._restarting = True
        # steps wait for the replacement; running requests go back to the queue (their KV is gone)
        self.executor.tell(WorkersDown(self.generation))
        self.scheduler.tell(WorkersLost(self.generation, child.describe_exit()))
        if not self._restarts.spend():
            self.node.fatal(f"the worker died {self._restarts.describe()}; giving up")
            return
        asyncio.get_running_loop().create_task(self._restart_workers())

    async def _restart_workers(self) -> None:
        try:
            # the other ranks' process group died with the one: all start again
            await asyncio.gather(*(w.stop() for w in self.workers))
            self.generation += 1
            workers, _ = await self._start_workers()
            await asyncio.gather(*(w.ask(InitKVCache(self.config), timeout=INIT_KV_TIMEOUT_S) for w in workers))
        except Exception as exc:  # whatever went wrong, the engine cannot go on without a worker
            self.node.fatal(f"could not restart the worker: {exc}")
            return
        finally:
            self._restarting = False
        self._tell_rank_hosts()                 # the ranks may be on other machines now
        log.info("worker%s restarted (generation %d)", "s" if self.world_size > 1 else "", self.generation)
        self.executor.tell(WorkersUp(self.generation, self.worker_nodes, topology.WORKER))
        self.scheduler.tell(WorkersReady(self.generation))

    async def stop(self) -> None:
        self._restarting = True
        # no step goes to workers being stopped: the scheduler ends the step under way, then the
        # executor stops
        await self.node.stop_actors([topology.SCHEDULER], timeout=QUIESCE_S)
        await self.node.stop_actors([topology.EXECUTOR], timeout=QUIESCE_S)
        await asyncio.gather(*(w.stop() for w in self.workers))
        if self.ray is not None:          # the actors, their placement group, this process's Ray driver
            self.ray.close()
        if self.hosts is not None:        # the other machines stop with this engine core
            await self.hosts.shut_down_hosts()


async def engine_entry(node: Node, payload: bytes) -> EngineConfig:
    """Entry of the engine-core process: ``payload`` is (ipc dir, config) in msgpack. No IPC
    directory (an engine core in a Ray actor, on any machine of the cluster): one of its own, for
    its workers' sockets, removed when it stops."""
    ipc_dir, config = msgspec.msgpack.decode(payload, type=tuple[str, EngineConfig])
    own_dir = not ipc_dir
    if own_dir:
        ipc_dir = tempfile.mkdtemp(prefix=f"troupe-{node.name}-")
        node.transport.bind(endpoint(ipc_dir, node.name))      # where its worker processes reach it
    core = EngineCore(node, config, ipc_dir)
    try:
        resolved = await core.start()
    except BaseException:
        if own_dir:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    node.on_stop.append(core.stop)
    if own_dir:
        async def remove_dir() -> None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        node.on_stop.append(remove_dir)
    return resolved
