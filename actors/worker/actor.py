"""Worker actor: owns the model and its KV cache on one device, runs one step per message."""
from __future__ import annotations

import logging
import os
import time
from typing import Any, ClassVar

import msgspec

from actors.runtime import Actor, Msg
from transport.messages import InitKVCache, KVCacheInfo, ModelInfo, SchedulerOutput

log = logging.getLogger("troupe.worker")


class WorkerConfig(msgspec.Struct):
    model: str | None = None
    dtype: str = "auto"           # "auto": bfloat16 on CUDA, float32 on the CPU
    num_threads: int = 0          # 0 = all cores
    seed: int = 0
    quantization: str | None = None   # "gguf" | "gguf-i8": the checkpoint's GGUF blocks run natively
    prepack: bool = True              # CPU: linear layers with weights packed once (models/packed.py)
    block_size: int = 16              # the KV cache's, so the attention backend is chosen for it
    kv_cache_dtype: str = "auto"      # "auto" (the model's dtype) | "float32" | "float16" | "bfloat16"
    device: str = "auto"              # "auto" (CUDA when present) | "cpu" | "cuda"
    enforce_eager: bool = False       # CUDA: no graph capture, every step eager


class LoadModel(Msg):
    reply_type: ClassVar[Any] = ModelInfo
    config: WorkerConfig


WorkerProtocol = LoadModel | InitKVCache | SchedulerOutput


class WorkerActor(Actor):
    protocol = WorkerProtocol

    def __init__(self) -> None:
        self.model = None
        self.config = None            # the model's ArchConfig
        self.worker_config = None
        self.placement = None
        self.dtype = None
        self.kv_cache_dtype = None
        self.runner = None

    async def receive(self, msg: WorkerProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                if self.runner is None:
                    raise RuntimeError("the KV cache is not initialized (InitKVCache first)")
                return self.runner.execute_model(msg)
            case LoadModel(config=cfg):
                return self._load(cfg)
            case InitKVCache():
                return self._init_kv_cache(msg)

    def _load(self, cfg: WorkerConfig) -> ModelInfo:
        import torch

        from actors.worker.device import dtype_name, resolve_kv_cache_dtype, resolve_placement
        from models.registry import load_model
        from models.resolve import resolve_model
        t0 = time.monotonic()
        torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
        torch.manual_seed(cfg.seed)
        place = resolve_placement(cfg.device, cfg.dtype)
        if cfg.quantization and place.on_cuda:
            raise ValueError(f"quantization {cfg.quantization!r} runs on the CPU only; use device 'cpu'")
        dtype = place.dtype
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, dtype)
        source = resolve_model(cfg.model)
        self.model, self.config = load_model(source, dtype, block_size=cfg.block_size,
                                             device=place.device.type, kv_cache_dtype=kv_dtype)
        from actors.kv_manager.kv_cache_spec import check_kv_cache_specs, model_kv_cache_specs
        check_kv_cache_specs(model_kv_cache_specs(self.config, cfg.block_size, kv_dtype.itemsize))
        if cfg.quantization:
            from models.quant import quantize
            quantize(self.model, cfg.quantization, source.path)
        if cfg.prepack and not place.on_cuda:
            from models.native_decode import attach
            from models.packed import prepack_linears
            prepack_linears(self.model)
            attach(self.model)
        self.dtype, self.kv_cache_dtype, self.placement, self.worker_config = dtype, kv_dtype, place, cfg
        c = self.config
        return ModelInfo(source.served_name, c.architecture, c.max_model_len, c.vocab_size,
                         list(c.eos_token_ids), c.kv_bytes_per_token(kv_dtype.itemsize), place.device.type,
                         dtype_name(dtype), time.monotonic() - t0, dtype_name(kv_dtype))

    def _init_kv_cache(self, msg: InitKVCache) -> KVCacheInfo:
        """Allocate the KV cache on the model's device; on CUDA, capture the decode graphs."""
        from actors.worker.cuda_graphs import capture_sizes
        from actors.worker.model_runner import ModelRunner
        if self.model is None:
            raise RuntimeError("no model loaded (LoadModel first)")
        place = self.placement
        sizes = (capture_sizes(msg.max_num_seqs)
                 if place.on_cuda and not self.worker_config.enforce_eager else None)
        self.runner = ModelRunner(self.model, self.config, msg.num_blocks, msg.block_size, msg.max_num_seqs,
                                  msg.max_model_len, self.dtype, place.device, sizes, self.kv_cache_dtype)
        if sizes:
            seconds = self.runner.capture_cudagraphs()
            log.info("captured %d CUDA graphs (decode batches of %s requests) in %.1f s",
                     len(sizes), ", ".join(map(str, sizes)), seconds)
        nbytes = sum(t.numel() * t.element_size() for t in self.runner.kv_caches)
        return KVCacheInfo(msg.num_blocks, msg.block_size, nbytes)


async def worker_entry(node: Any, config: bytes) -> ModelInfo:
    """Entry of a worker process: start the Worker actor and load the model."""
    cfg = msgspec.msgpack.decode(config, type=WorkerConfig)
    ref = await node.start("worker0", WorkerActor)
    return await ref.ask(LoadModel(cfg), timeout=600)
