"""The engine core: builds KVManager, Executor and Scheduler around a worker, and supervises
the worker. In a server the worker is a child process (restarted when it dies, up to a limit);
offline and in tests it can be an actor in the same event loop."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec

from actors.executor.actor import Executor, WorkersUp
from actors.kv_manager.actor import KVManager
from actors.runtime import ActorRef, Node
from actors.runtime.process import ChildProcess, NodeSpec, decode_info, start_child
from actors.scheduler.actor import SchedulerActor, WorkersReady
from actors.scheduler.scheduler import Scheduler, SchedulerConfig
from actors.worker.actor import LoadModel, WorkerActor, WorkerConfig
from transport.messages import EngineCoreOutputs, EngineInfo, InitKVCache, ModelInfo
from transport.zmq_channel import endpoint

log = logging.getLogger("troupe.engine")

WORKER_NODE = "worker0"
WORKER_ACTOR = "worker0"


class EngineConfig(msgspec.Struct):
    model: str | None = None
    dtype: str = "auto"                    # "auto": float32 on the CPU, bfloat16 on a GPU
    quantization: str | None = None        # None (exact) | "gguf" | "gguf-i8" (models/quant.py)
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"           # "auto" (the model's dtype) | "float32" | "float16" | "bfloat16"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0                 # 0 = the model's own
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"          # "fcfs" | "priority"
    num_threads: int = 0
    seed: int = 0
    worker_process: bool = True            # False: the worker runs in the engine's event loop
    output_node: str = "frontend"
    output_actor: str = "detokenizer"
    ipc_dir: str = ""
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 120.0
    device: str = "auto"                   # "auto" (CUDA when present) | "cpu" | "cuda"
    enforce_eager: bool = False            # CUDA: no graph capture


class EngineCore:
    """Starts the engine's actors on ``node`` and restarts the worker when it dies."""

    def __init__(self, node: Node, cfg: EngineConfig) -> None:
        self.node = node
        self.cfg = cfg
        self.generation = 0
        self.worker: ChildProcess | None = None
        self.num_blocks = 0
        self.max_model_len = 0
        self._restarts: deque[float] = deque()
        self.scheduler: ActorRef | None = None
        self.executor: ActorRef | None = None

    def _worker_config(self) -> WorkerConfig:
        c = self.cfg
        return WorkerConfig(model=c.model, dtype=c.dtype, num_threads=c.num_threads, seed=c.seed,
                            quantization=c.quantization, block_size=c.block_size,
                            kv_cache_dtype=c.kv_cache_dtype,
                            device=c.device, enforce_eager=c.enforce_eager)

    async def _start_worker(self) -> tuple[ActorRef, ModelInfo]:
        if not self.cfg.worker_process:
            ref = await self.node.start(WORKER_ACTOR, WorkerActor)
            return ref, await ref.ask(LoadModel(self._worker_config()), timeout=600)
        spec = NodeSpec(WORKER_NODE, "actors.worker.actor:worker_entry",
                        msgspec.msgpack.encode(self._worker_config()), self.cfg.ipc_dir,
                        self.node.name, {self.node.name: endpoint(self.cfg.ipc_dir, self.node.name)})
        self.worker, ready = await start_child(self.node, spec, on_exit=self._worker_exited)
        return self.node.ref(WORKER_ACTOR, WORKER_NODE), decode_info(ready, ModelInfo)

    async def start(self) -> EngineInfo:
        cfg = self.cfg
        worker, info = await self._start_worker()
        per_block = info.kv_bytes_per_token * cfg.block_size
        self.num_blocks = max(cfg.kv_cache_bytes // per_block, 2)
        max_len = min(cfg.max_model_len or info.max_model_len,
                      (self.num_blocks - 1) * cfg.block_size)
        self.max_model_len = max_len
        kv_info = await worker.ask(self._init_kv(), timeout=120)
        log.info("model %s loaded on %s (%s) in %.1f s; KV cache: %d blocks of %d tokens (%.0f MiB, %s); "
                 "max model len %d", info.served_name, info.device, info.dtype, info.load_seconds,
                 self.num_blocks, cfg.block_size, kv_info.bytes / 2**20, info.kv_cache_dtype or info.dtype, max_len)
        sched_cfg = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_len, block_size=cfg.block_size,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.scheduling_policy, enable_prefix_caching=cfg.enable_prefix_caching)
        kv = self.node.spawn("kv_manager", lambda: KVManager(self.num_blocks, cfg.block_size,
                                                             cfg.enable_prefix_caching))
        self.executor = self.node.spawn("executor", lambda: Executor([worker]))
        outputs = self.node.ref(cfg.output_actor, cfg.output_node, EngineCoreOutputs)
        self.scheduler = self.node.spawn("scheduler", lambda: SchedulerActor(
            Scheduler(sched_cfg, self.num_blocks), kv, self.executor, outputs))
        info.max_model_len = max_len
        return EngineInfo(info, self.num_blocks, cfg.block_size, cfg.max_num_seqs,
                          cfg.max_num_batched_tokens)

    def _init_kv(self) -> InitKVCache:
        return InitKVCache(self.num_blocks, self.cfg.block_size, self.cfg.max_num_seqs,
                           self.max_model_len)

    # -- worker supervision ------------------------------------------------------------------
    def _worker_exited(self, child: ChildProcess) -> None:
        if self.node.closed.done():
            return
        log.error("%s", child.describe_exit())
        now = time.monotonic()
        self._restarts.append(now)
        while self._restarts and now - self._restarts[0] > self.cfg.worker_restart_window_s:
            self._restarts.popleft()
        if len(self._restarts) > self.cfg.max_worker_restarts:
            self.node.fatal(f"the worker died {len(self._restarts)} times within "
                            f"{self.cfg.worker_restart_window_s:g} s; giving up")
            return
        asyncio.get_running_loop().create_task(self._restart_worker())

    async def _restart_worker(self) -> None:
        try:
            worker, _ = await self._start_worker()
            await worker.ask(self._init_kv(), timeout=120)
        except Exception as exc:  # whatever went wrong, the engine cannot go on without a worker
            self.node.fatal(f"could not restart the worker: {exc}")
            return
        self.generation += 1
        log.info("worker restarted (generation %d)", self.generation)
        self.executor.tell(WorkersUp(self.generation, WORKER_NODE, [WORKER_ACTOR]))
        self.scheduler.tell(WorkersReady(self.generation))

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()


async def engine_entry(node: Node, config: bytes) -> EngineInfo:
    """Entry of the engine-core process."""
    cfg = msgspec.msgpack.decode(config, type=EngineConfig)
    core = EngineCore(node, cfg)
    info = await core.start()
    node.on_stop.append(core.stop)
    return info
