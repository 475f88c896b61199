"""Starting Troupe: the frontend's actors around an engine core that runs either in its own
process (with the worker in a third) or in this event loop (offline use and tests), as the
config's ``parallel.multiprocess`` says. An engine process that dies fails what was in flight at
once and is restarted (within the config's restart budget); meanwhile requests get 503 with
``Retry-After``.

With data parallelism (``parallel.data_parallel_size`` N > 1) N engine processes start, each with
its own worker, and the frontend's DataParallelRouter (dp_router.py) stands where the scheduler
would: it sends each request to one engine. One engine that dies fails its own requests only and
is restarted while the others serve; requests get 503 only while none is up.

With --data-parallel-backend ray each engine core runs in a Ray actor instead of a process of this
machine (actors/runtime/ray_nodes.py), in a placement group of one bundle per engine core; it
reaches this node at its cluster IP, starts its workers where it runs (or places them on the
cluster too) and is supervised and restarted as a process is.

With --data-parallel-size-local below --data-parallel-size the ranks past the local ones run on
other machines, started there with --headless (headless.py): the frontend listens for them at
--data-parallel-address:--data-parallel-rpc-port and serves once every rank has joined.

With vLLM's external (--data-parallel-rank R) or hybrid (--data-parallel-hybrid-lb) load balancing
this server starts and serves only its own ranks (``served_ranks``: R, or this machine's
--data-parallel-size-local from --data-parallel-start-rank), under their global rank numbers;
the other ranks have servers of their own."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, NamedTuple

import msgspec

from actors import topology
from actors.detokenizer.actor import DetokenizerActor
from actors.engine.config import EngineConfig
from actors.engine.core import EngineCore
from actors.engine.pooling import embed_lens
from actors.frontend.admission import WaitingRequests
from actors.frontend.client import EngineClient
from actors.frontend.dp_router import DataParallelRouter, EngineDown, EngineUp
from actors.frontend.stat_logger import StatLines, StatLoggerActor, log_interval
from actors.frontend.stats import EngineStats, cache_config_info
from actors.frontend.telemetry import Telemetry, TelemetryActor, TelemetryWindow
from actors.grammar.actor import GrammarCompilerProtocol
from actors.frontend.streams import OutputStreams
from actors.kv_manager.actor import KVManagerProtocol
from actors.runtime import ActorRef, Node, heap
from actors.runtime.process import (ChildProcess, NodeSpec, RestartBudget, decode_info, start_child,
                                    system_actor)
from actors.runtime.faults import InjectFault
from actors.runtime.ray_nodes import RayChild, RayPlacement, start_ray_child
from actors.runtime.system import SYSTEM_ACTOR
from actors.scheduler.actor import SchedulerProtocol
from actors.tokenizer.actor import TokenizerActor
from actors.tokenizer.gguf_tokenizer import TextTokenizer, TokenIdsOnly
from actors.tokenizer.multimodal import ImageProcessor
from actors.runtime.otel import RequestTracer
from actors.frontend.reasoning import resolve_reasoning
from transport.zmq_channel import ZmqTransport, endpoint

if TYPE_CHECKING:
    from actors.frontend.api_servers import ApiServers
    from actors.frontend.headless import RemoteEngineHandle, RemoteEngines

log = logging.getLogger("troupe.launch")

READY_TIMEOUT_S = 600.0
RESTART_RETRY_AFTER_S = 10.0     # what a 503 tells clients while the engine restarts
SHUT_DOWN = "the engine was shut down"


class Frontend:
    """A running Troupe: the frontend node, its EngineClient, and the engine it talks to."""

    def __init__(self, node: Node, ipc_dir: str | None = None) -> None:
        self.node = node
        self.ipc_dir = ipc_dir
        self.client: EngineClient | None = None
        # data-parallel rank -> its process (a headless machine's: a handle on it)
        self.engine_processes: dict[int, ChildProcess | RayChild | RemoteEngineHandle] = {}
        self.ray: RayPlacement | None = None        # --data-parallel-backend ray
        self.cluster_address = ""                   # where engine cores on the cluster reach this node
        self.generations: dict[int, int] = {}       # data-parallel rank -> engine cores started for it
        self.engine_core: EngineCore | None = None
        self.router: ActorRef | None = None       # with data parallelism
        self.stopping = False
        self.stopped = False                       # shut down (or stopped by stop_now)
        self._restarts: RestartBudget | None = None
        self._down: set[int] = set()               # engine cores being restarted
        self.remote: RemoteEngines | None = None      # engine cores of headless machines
        self.telemetry: Telemetry | None = None      # with start(telemetry=True)
        self.request_tracer: RequestTracer | None = None   # --otlp-traces-endpoint: requests' spans
        self.engines: list[_Engine] = []            # the served engine cores' actors, by served rank
        self.api_servers: ApiServers | None = None  # --api-server-count above 1: the other API servers

    def engine_exited(self, child: ChildProcess | RayChild, dp_rank: int = 0) -> None:
        """An engine process is gone: fail what it had in flight at once (with one engine core,
        everything; with several, its own requests), then restart it, or stop with a clear
        message when engines keep dying."""
        if self.stopping or self.node.closed.done():
            return
        reason = f"the engine core died ({child.describe_exit()})"
        if self.router is not None:
            reason = f"engine core {dp_rank} died ({child.describe_exit()})"
        log.error("%s", reason)
        if self.client is None:                # died while starting: start() reports it
            return
        if self.api_servers is not None:
            self.api_servers.engine_down(dp_rank, reason)
        self._down.add(dp_rank)
        self.client.stats.engine_down(dp_rank)
        if self.router is None:
            self.client.mark_dead(reason, RESTART_RETRY_AFTER_S)
        else:
            self.router.tell(EngineDown(dp_rank, reason))
            if len(self._down) == len(self.client.config.parallel.served_ranks):
                self.client.mark_dead(f"every engine core is down ({reason})", RESTART_RETRY_AFTER_S)
        if not self._restarts.spend():
            self.node.fatal(f"{reason}; engine cores died {self._restarts.describe()}, giving up", code=1)
            return
        asyncio.get_running_loop().create_task(self._restart_engine(dp_rank))

    async def _restart_engine(self, dp_rank: int = 0) -> None:
        try:
            await _start_engine(self, self.client.config, READY_TIMEOUT_S, dp_rank)
        except Exception as exc:   # whatever went wrong, nothing can be served without an engine
            self.node.fatal(f"could not restart the engine core: {exc}", code=1)
            return
        which = "engine core" if self.router is None else f"engine core {dp_rank}"
        log.info("%s restarted (pid %d)", which, self.engine_processes[dp_rank].pid)
        self._down.discard(dp_rank)
        if self.router is not None:
            self.router.tell(EngineUp(dp_rank))
        self.client.mark_alive()
        if self.api_servers is not None:
            await self.api_servers.engine_up(dp_rank)

    async def inject_fault(self, fault: InjectFault) -> bool:
        """Arm ``fault`` in the process it names (this one, the engine's or the worker's)."""
        return await self.node.ref(SYSTEM_ACTOR).ask(fault, timeout=fault.seconds + 30.0)

    async def start(self, config: EngineConfig, ready_timeout: float = READY_TIMEOUT_S,
                    telemetry: bool = False) -> EngineClient:
        """Load the model (in the engine's and worker's processes when the config is
        multiprocess), then start the tokenizer and detokenizer actors (and, with ``telemetry``,
        the collector of every process's trace records for the dashboard); sets ``client``."""
        interval = log_interval()            # a bad VLLM_LOG_STATS_INTERVAL fails the start, not later
        self.node.tracer.enabled = config.observability.trace
        if config.observability.flight_recorder_dir:
            system_actor(self.node).flight_dir = config.observability.flight_recorder_dir
        tokenizer = load_tokenizer(config)
        config = with_reasoning_resolved(config, tokenizer)
        served = config.parallel.served_ranks
        self._restarts = RestartBudget(config.parallel.max_restarts * len(served), config.parallel.restart_window_s)
        if config.parallel.data_parallel_backend == "ray":
            await self._place_engines(config)
        if config.parallel.remote_ranks:
            await self._listen_for_remote_engines(config)
        local = config.parallel.local_ranks
        engines = await asyncio.gather(*(_start_engine(self, config, ready_timeout, r) if r in local
                                         else self.remote.engine(r, ready_timeout) for r in served))
        config = engines[0].config                          # resolved by the worker
        endpoint = config.observability.otlp_traces_endpoint
        if endpoint is not None and self.request_tracer is None:
            obs = config.observability
            self.request_tracer = RequestTracer(endpoint, config.model.served_model_name,
                                                obs.collect_model_forward_time, obs.collect_model_execute_time)
            log.info("OpenTelemetry: each request's span goes to %s", endpoint)
        self.engines = list(engines)
        self.client, self.router = client_actors(self.node, config, tokenizer, self.engines, self.request_tracer)
        stats = self.client.stats
        if config.observability.log_stats and topology.STAT_LOGGER not in self.node.cells:
            lines = StatLines(stats, config.device.device)
            self.node.spawn(topology.STAT_LOGGER, lambda: StatLoggerActor(lines, interval))
        if telemetry and topology.TELEMETRY not in self.node.cells:
            self.telemetry = Telemetry(self.node.spawn(topology.TELEMETRY, lambda: TelemetryActor(
                TelemetryWindow(), lambda: engine_sample(self.client.stats))))
        return self.client

    async def _listen_for_remote_engines(self, config: EngineConfig) -> None:
        """Listen at --data-parallel-address:--data-parallel-rpc-port for the engine cores that
        headless machines run (actors/frontend/headless.py), and reach them from there."""
        from actors.frontend.headless import RemoteEngines
        p = config.parallel
        where = f"tcp://{p.data_parallel_address}:{p.data_parallel_rpc_port}"
        try:
            self.cluster_address = self.node.transport.bind(where)
        except Exception as exc:
            raise ValueError(f"cannot listen for the headless machines' engine cores at {where} "
                             f"(--data-parallel-address, --data-parallel-rpc-port): {exc}") from None
        self.remote = RemoteEngines(self, config)
        self.node.spawn(topology.DP_COORDINATOR, lambda: self.remote)
        log.info("waiting for engine core%s %s from headless machines at %s",
                 "s" if len(p.remote_ranks) > 1 else "", ", ".join(map(str, p.remote_ranks)), self.cluster_address)

    def remote_engine_up(self, dp_rank: int, handle: RemoteEngineHandle) -> None:
        """A headless machine's engine core ``dp_rank`` joined (at the start, or again once restarted there)."""
        self.engine_processes[dp_rank] = handle
        system_actor(self.node).children.add(handle.name)
        if self.client is None or dp_rank not in self._down:
            return
        log.info("engine core %d is back (pid %d on %s)", dp_rank, handle.pid, handle.host)
        self._down.discard(dp_rank)
        self.router.tell(EngineUp(dp_rank))
        self.client.mark_alive()
        if self.api_servers is not None:
            asyncio.get_running_loop().create_task(self.api_servers.engine_up(dp_rank))

    def remote_engine_down(self, dp_rank: int, reason: str) -> None:
        """A headless machine's engine core ``dp_rank`` died, or its machine stopped answering:
        its requests fail now; the headless server restarts it (it joins again)."""
        handle = self.engine_processes.get(dp_rank)
        if handle is not None:
            self.node.peer_down(handle.name, reason)
            system_actor(self.node).child_exited(handle.name, handle.pid, reason)
        if self.stopping or self.client is None or dp_rank in self._down:
            return
        log.error("engine core %d is down: %s", dp_rank, reason)
        self._down.add(dp_rank)
        if self.api_servers is not None:
            self.api_servers.engine_down(dp_rank, f"engine core {dp_rank} is down ({reason})")
        self.client.stats.engine_down(dp_rank)
        self.router.tell(EngineDown(dp_rank, f"engine core {dp_rank} is down ({reason})"))
        if len(self._down) == len(self.client.config.parallel.served_ranks):
            self.client.mark_dead(f"every engine core is down ({reason})", RESTART_RETRY_AFTER_S)

    async def _place_engines(self, config: EngineConfig) -> None:
        """The placement group of the engine cores on the Ray cluster: a bundle each, with the
        devices of the workers it starts itself (none when it places them on the cluster too)."""
        p = config.parallel
        own_workers = p.distributed_executor_backend != "ray"
        self.ray = RayPlacement(p.data_parallel_size, config.device.device, f"{self.node.name}-{os.getpid()}",
                                units=p.world_size if own_workers else 0, host_cpu=True, what="engine cores")
        await self.ray.start()
        self.cluster_address = self.ray.engine_address(self.node)

    async def shutdown(self) -> None:
        self.stopping = True
        if self.client is not None and self.client.dead is None:     # what is still open fails now
            self.client.mark_dead(SHUT_DOWN)
        if self.api_servers is not None:
            await self.api_servers.stop()
        if self.remote is not None:
            await self.remote.stop_hosts()
        await asyncio.gather(*(p.stop() for p in self.engine_processes.values()))
        if self.engine_core is not None:
            await self.engine_core.stop()
        self.close_ray()
        await self.node.stop()
        if self.request_tracer is not None:     # the spans still batched go out (a thread: the loop goes on)
            await asyncio.to_thread(self.request_tracer.shutdown)
            self.request_tracer = None
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        else:
            heap.unfreeze()
        self.stopped = True

    def stop_now(self, timeout: float = 30.0) -> None:
        """``shutdown`` without the event loop, for an engine nobody shut down (an AsyncLLM
        collected, or left running when its ``asyncio.run`` ended): each engine process on this
        machine is asked to stop through its death pipe, waited for, and killed after ``timeout``;
        Ray's actors are killed and the IPC directory removed."""
        self.stopping = True
        children = [p for p in self.engine_processes.values() if isinstance(p, ChildProcess)]
        for child in children:
            child.request_stop()
        deadline = time.monotonic() + timeout
        for child in children:
            child.wait_exit(max(0.0, deadline - time.monotonic()))
        self.close_ray()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        else:
            heap.unfreeze()
        self.stopped = True

    def close_ray(self) -> None:
        """Kill the engine cores' actors, remove their placement group, leave the cluster."""
        if self.ray is not None:
            self.ray.close()
            self.ray = None


def engine_sample(stats: EngineStats) -> tuple[float, int, int, int, int]:
    s = stats.last
    return s.kv_cache_usage, s.num_running, s.num_waiting, s.prefix_cache_queries, s.prefix_cache_hits


async def start_frontend(config: EngineConfig, *, ready_timeout: float = READY_TIMEOUT_S) -> Frontend:
    """Start the engine and the frontend actors; returns once the model is loaded."""
    fe = create_frontend(config.parallel.multiprocess)
    try:
        await fe.start(config, ready_timeout=ready_timeout)
    except BaseException:
        if fe.remote is not None:
            await fe.remote.stop_hosts()
        fe.close_ray()
        await fe.node.stop()
        if fe.ipc_dir:
            shutil.rmtree(fe.ipc_dir, ignore_errors=True)
        raise
    if fe.ipc_dir is None:            # the engine lives in this process: its start-up heap frozen
        heap.freeze_started()
    return fe


def create_frontend(multiprocess: bool = True) -> Frontend:
    """The frontend node alone (no engine yet): a server can listen, and answer 503, while
    ``Frontend.start`` loads the model."""
    if multiprocess:
        ipc_dir = tempfile.mkdtemp(prefix="troupe-")
        node = Node(topology.FRONTEND_NODE, ZmqTransport(endpoint(ipc_dir, topology.FRONTEND_NODE)))
        system_actor(node)
        return Frontend(node, ipc_dir)
    node = Node(topology.FRONTEND_NODE)
    system_actor(node)
    return Frontend(node)


class _Engine(NamedTuple):
    config: EngineConfig          # resolved
    scheduler: ActorRef
    kv_manager: ActorRef
    grammar: ActorRef


async def _start_engine(fe: Frontend, config: EngineConfig, ready_timeout: float, dp_rank: int = 0) -> _Engine:
    """Engine core ``dp_rank`` in its own process (multiprocess) or in this event loop."""
    if fe.ipc_dir is None:
        if config.parallel.multiprocess:
            raise ValueError("a multiprocess config needs a frontend made with create_frontend(True)")
        fe.engine_core = EngineCore(fe.node, config)
        resolved = await fe.engine_core.start()
        return _Engine(resolved, fe.engine_core.scheduler, fe.engine_core.kv_manager, fe.engine_core.grammar)
    name = topology.engine_node(dp_rank)
    # an engine core on the Ray cluster has no share in this machine's IPC directory
    frontend_address = {topology.FRONTEND_NODE: (fe.cluster_address if fe.ray is not None
                                                 else endpoint(fe.ipc_dir, topology.FRONTEND_NODE))}
    spec = engine_spec(config, dp_rank, "" if fe.ray is not None else fe.ipc_dir, topology.FRONTEND_NODE,
                       frontend_address, own_ipc_dir=fe.ray is not None)
    generation = fe.generations[dp_rank] = fe.generations.get(dp_rank, -1) + 1

    def exited(child: ChildProcess | RayChild) -> None:
        fe.engine_exited(child, dp_rank)
    if fe.ray is not None:
        fe.engine_processes[dp_rank], ready = await start_ray_child(
            fe.node, spec, fe.ray.new_host(dp_rank, name, generation), ready_timeout=ready_timeout, on_exit=exited)
    else:
        fe.engine_processes[dp_rank], ready = await start_child(
            fe.node, spec, ready_timeout=ready_timeout, on_exit=exited)
    return engine_refs(fe.node, name, decode_info(ready, EngineConfig))


def engine_refs(node: Node, name: str, resolved: EngineConfig) -> _Engine:
    """The frontend's refs to the actors of engine node ``name`` (resolved config ``resolved``)."""
    resolved = resolved.replace(parallel=msgspec.structs.replace(resolved.parallel, data_parallel_rank=0))
    return _Engine(resolved,
                   node.ref(topology.SCHEDULER, name, SchedulerProtocol),
                   node.ref(topology.KV_MANAGER, name, KVManagerProtocol),
                   node.ref(topology.GRAMMAR, name, GrammarCompilerProtocol))


def engine_spec(config: EngineConfig, dp_rank: int, ipc_dir: str, parent: str, peers: dict[str, str],
                own_ipc_dir: bool = False, bind: str = "") -> NodeSpec:
    """The NodeSpec of engine core ``dp_rank``'s process: child of node ``parent``, reaching
    ``peers``; ``own_ipc_dir``: its workers' sockets go in a directory of its own (it runs away
    from the frontend's machine)."""
    config = config.replace(parallel=msgspec.structs.replace(config.parallel, data_parallel_rank=dp_rank))
    payload = msgspec.msgpack.encode(("" if own_ipc_dir else ipc_dir, config))
    return NodeSpec(topology.engine_node(dp_rank), "actors.engine.core:engine_entry", payload, ipc_dir,
                    parent, peers, trace=config.observability.trace,
                    flight_dir=config.observability.flight_recorder_dir, bind=bind)


def load_tokenizer(config: EngineConfig) -> TextTokenizer | None:
    """The model's tokenizer with the config's chat template (None with --skip-tokenizer-init:
    ``client_actors`` makes the token-ids-only stand-in once the model is known)."""
    if config.model.skip_tokenizer_init:
        if config.model.chat_template is not None:
            raise ValueError("--chat-template cannot be used with --skip-tokenizer-init: there is no "
                             "tokenizer to render a chat with")
        return None
    source = config.model.tokenizer
    tokenizer = TextTokenizer.from_source(source.kind, source.path)
    if config.model.chat_template is not None:
        tokenizer.set_chat_template(config.model.chat_template)
    tokenizer.content_format = config.model.chat_template_content_format
    if tokenizer.chat_template:
        found = tokenizer.content_format_of(tokenizer.chat_template)
        log.info("chat template content format: %s%s", found, " (detected; "
                 "--chat-template-content-format sets it)" if tokenizer.content_format == "auto" else "")
    return tokenizer


def client_actors(node: Node, config: EngineConfig, tokenizer: TextTokenizer | TokenIdsOnly | None,
                  engines: list[_Engine], tracer: RequestTracer | None,
                  client_index: int = 0) -> tuple[EngineClient, ActorRef | None]:
    """An API server's side of the engine cores ``engines`` (``config``: resolved): its tokenizer
    and detokenizer actors, with several engine cores the router before them, and the
    EngineClient over them; returns the client and the router (None with one engine core).
    ``client_index``: the API server's (--api-server-count), on its requests."""
    arch = config.model.arch
    if tokenizer is None:
        tokenizer = TokenIdsOnly(arch.vocab_size, arch.eos_token_ids)
        log.info("no tokenizer loaded (--skip-tokenizer-init): prompts and answers are token ids")
    if config.model.tokenizer_source is not None and arch is not None and tokenizer.vocab_size > arch.vocab_size:
        raise ValueError(f"--tokenizer {config.model.tokenizer_source.served_name!r}: its vocabulary "
                         f"({tokenizer.vocab_size} tokens) does not fit the model's ({arch.vocab_size})")
    served = config.parallel.served_ranks
    streams = OutputStreams()
    cache = config.cache
    stats = EngineStats(model=config.model.served_model_name, max_model_len=config.model.max_model_len,
                        cache_info=cache_config_info(cache.block_size, cache.cache_dtype,
                                                     cache.enable_prefix_caching,
                                                     cache.gpu_memory_utilization, cache.num_blocks),
                        kv_cache={"dtype": cache.cache_dtype, "num_blocks": cache.num_blocks,
                                  "block_size": cache.block_size,
                                  "num_tokens": cache.num_blocks * cache.block_size,
                                  "calculate_kv_scales": cache.calculate_kv_scales},
                        custom_buckets=config.observability.custom_histogram_buckets,
                        watermark_requests=(dict.fromkeys(("watermarked", "skipped", "not_watermarked"), 0)
                                            if config.watermark is not None else None),
                        mfu=config.observability.enable_mfu_metrics, engine=served[0], api_server=client_index)
    waiting = WaitingRequests(config.scheduler.max_waiting_requests, config.scheduler.max_waiting_tokens)
    scheduler = engines[0].scheduler            # where requests and aborts go
    router = None
    if len(served) > 1:
        detok_ref = node.ref(topology.DETOKENIZER)
        router = scheduler = node.spawn(topology.DP_ROUTER, lambda: DataParallelRouter(
            [e.scheduler for e in engines], stats, streams, detok_ref, cache.block_size, list(served)))
    spec, level = config.speculative, config.observability.per_request_spec_decode_metrics
    spec_metrics = (spec.num_speculative_tokens, level) if spec is not None and level != "none" else None
    detok = node.spawn(topology.DETOKENIZER, lambda: DetokenizerActor(
        tokenizer, streams, stats, scheduler, waiting, tracer, spec_metrics))

    def count_prompt_tokens(n: int) -> None:
        stats.prompt_tokens += n

    images = image_processor(config, tokenizer, stats)
    tok = node.spawn(topology.TOKENIZER, lambda: TokenizerActor(
        tokenizer, config.model.max_model_len, list(arch.eos_token_ids), detok,
        scheduler, waiting, count_prompt_tokens, config.model.max_logprobs, arch.vocab_size,
        arch.hidden_size if config.model.enable_prompt_embeds else None,
        config.model.reasoning is not None and config.model.reasoning.resolved, client_index,
        *embed_lens(config.model.pooling), lower_case=arch.do_lower_case, images=images))
    client = EngineClient(config, tokenizer, tok, detok, scheduler, [e.kv_manager for e in engines],
                          engines[0].grammar, streams, stats, waiting)
    client.images = images
    return client, router


def image_processor(config: EngineConfig, tokenizer: TextTokenizer | TokenIdsOnly,
                    stats: EngineStats | None = None) -> ImageProcessor | None:
    """For a model that takes images (or audio), its checkpoint's processor (and its video
    processor, for a model that takes videos), the tokenizer's chat templates then rendering image
    (video, audio) parts as the placeholders; None for a text model (or without a tokenizer)."""
    arch = config.model.arch
    if (arch.image_token_id is None and arch.audio_token_id is None) or not isinstance(tokenizer, TextTokenizer):
        return None
    images = ImageProcessor(config.model.source.path, arch.image_token_id, config.model.multimodal,
                            lambda text: tokenizer.encode(text, add_special_tokens=False), stats, arch.hidden_size,
                            config.scheduler.token_budget if config.scheduler.disable_chunked_mm_input else None,
                            needs_grid=bool(arch.mrope_section),
                            video_token_id=arch.video_token_id if config.model.multimodal.limit("video") else None,
                            audio_token_id=arch.audio_token_id)
    tokenizer.image_placeholder = images.placeholders
    if images.takes("image"):
        log.info("images are taken (at most %d a prompt), each as %s makes it", config.model.multimodal.limit("image"),
                 images.name)
    if images.takes("audio"):
        log.info("audio is taken (at most %d clips a prompt), each as %s makes its features at %d Hz",
                 config.model.multimodal.limit("audio"), images.name, images.sampling_rate)
    if images.video is not None:
        log.info("videos are taken (at most %d a prompt), their frames as %s's video processor makes them",
                 config.model.multimodal.limit("video"), images.name)
    return images


def with_reasoning_resolved(config: EngineConfig, tokenizer: TextTokenizer | TokenIdsOnly | None) -> EngineConfig:
    """The config with its reasoning markers' token ids, for the workers' thinking budgets."""
    if config.model.reasoning is None:
        return config
    return msgspec.structs.replace(config, model=msgspec.structs.replace(
        config.model, reasoning=resolve_reasoning(config.model.reasoning, tokenizer or TokenIdsOnly(0))))
