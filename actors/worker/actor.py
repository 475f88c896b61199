"""Worker actor: owns the model and its KV cache on one device, runs one step per message."""
from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import msgspec

from actors.runtime import Actor, Msg
from transport.messages import InitKVCache, KVCacheInfo, ModelInfo, SchedulerOutput


class WorkerConfig(msgspec.Struct):
    model: str | None = None
    dtype: str = "float32"
    num_threads: int = 0          # 0 = all cores
    seed: int = 0
    quantization: str | None = None   # "int8": int8 weights, dynamic int8 activations
    block_size: int = 16              # the KV cache's, so the attention backend is chosen for it


class LoadModel(Msg):
    reply_type: ClassVar[Any] = ModelInfo
    config: WorkerConfig


WorkerProtocol = LoadModel | InitKVCache | SchedulerOutput


class WorkerActor(Actor):
    protocol = WorkerProtocol

    def __init__(self) -> None:
        self.model = None
        self.config = None
        self.dtype = None
        self.runner = None

    async def receive(self, msg: WorkerProtocol) -> Any:
        match msg:
            case SchedulerOutput():
                if self.runner is None:
                    raise RuntimeError("the KV cache is not initialized (InitKVCache first)")
                return self.runner.execute_model(msg)
            case LoadModel(config=cfg):
                return self._load(cfg)
            case InitKVCache(num_blocks=nb, block_size=bs):
                from actors.worker.model_runner import ModelRunner
                if self.model is None:
                    raise RuntimeError("no model loaded (LoadModel first)")
                self.runner = ModelRunner(self.model, self.config, nb, bs, msg.max_num_seqs,
                                          msg.max_model_len, self.dtype)
                nbytes = sum(t.numel() * t.element_size() for t in self.runner.kv_caches)
                return KVCacheInfo(nb, bs, nbytes)

    def _load(self, cfg: WorkerConfig) -> ModelInfo:
        import torch

        from models.registry import load_model
        from models.resolve import resolve_model
        t0 = time.monotonic()
        torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
        torch.manual_seed(cfg.seed)
        dtype = getattr(torch, cfg.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"unknown dtype {cfg.dtype!r}; accepted: float32, bfloat16")
        source = resolve_model(cfg.model)
        self.model, self.config = load_model(source, dtype, block_size=cfg.block_size)
        from actors.kv_manager.kv_cache_spec import check_kv_cache_specs, model_kv_cache_specs
        check_kv_cache_specs(model_kv_cache_specs(self.config, cfg.block_size, dtype.itemsize))
        if cfg.quantization:
            from models.quant import quantize
            quantize(self.model, cfg.quantization)
        self.dtype = dtype
        c = self.config
        return ModelInfo(source.served_name, c.architecture, c.max_model_len, c.vocab_size,
                         list(c.eos_token_ids), c.kv_bytes_per_token(dtype.itemsize), "cpu",
                         cfg.dtype, time.monotonic() - t0)


async def worker_entry(node: Any, config: bytes) -> ModelInfo:
    """Entry of a worker process: start the Worker actor and load the model."""
    cfg = msgspec.msgpack.decode(config, type=WorkerConfig)
    ref = await node.start("worker0", WorkerActor)
    return await ref.ask(LoadModel(cfg), timeout=600)
