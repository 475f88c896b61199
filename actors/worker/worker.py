"""The worker's core: one model and its paged KV cache on one device. Loading resolves the
engine's config (the worker knows its platform, actors/worker/platforms.py, and reads the
checkpoint's architecture), then
the model is built, quantized or packed for the CPU, its projections wrapped for LoRA with
--enable-lora (``lora_manager.py``); on CUDA without a KV cache size, a forward
pass measures what --gpu-memory-utilization leaves for the cache (``gpu_memory.py``);
``init_kv_cache`` allocates the cache the resolved config sizes and captures the decode graphs on
CUDA; ``execute_model`` runs one step. Pure: no asyncio, no transport."""
from __future__ import annotations

import logging
import os
import time

import msgspec
import torch

from actors.engine.config import EngineConfig
from actors.engine.messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from actors.engine.sampling_params import SamplingParams
from actors.worker.compilation import apply_compilation, packs_linears
from actors.worker.cuda_graphs import capture_sizes
from actors.worker.gpu_memory import GIB, device_memory, kv_cache_bytes_for_gpu
from actors.worker.model_runner import ModelRunner, torch_dtype
from actors.worker.platforms import platform_for
from kernels.attention.base import AttentionBackend
from models.layers import calculate_kv_scales_on_next_batch
from models.native_decode import attach as attach_native_decode
from models.packed import prepack_linears
from models.registry import Checkpoint, attention_requirements, build_model, open_checkpoint
from models.tensor_parallel import shard_model

log = logging.getLogger("troupe.worker")


class Worker:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, init_method: str = "") -> None:
        """Resolve ``config`` for this platform and checkpoint and load the model (with tensor
        parallelism, rank ``tp_rank``'s part of it, after joining the ranks' process group at
        ``init_method``)."""
        t0 = time.monotonic()
        self.tp_rank = tp_rank
        source = config.model.source
        ckpt = open_checkpoint(source)
        draft = config.model.draft_source
        draft_ckpt = open_checkpoint(draft) if draft is not None else None
        self.config = config.resolve(cuda_available=platform_for("cuda").is_available(),
                                     cpu_count=os.cpu_count() or 1,
                                     arch=ckpt.config, draft_arch=draft_ckpt.config if draft_ckpt else None)
        self.platform = platform_for(self.config.device.device)       # what the device runs, and how
        self.platform.check_dtypes(self.config.model.dtype, self.config.cache.cache_dtype)
        torch.set_num_threads(self.config.device.num_threads)
        torch.manual_seed(self.config.model.seed)
        self.device = torch.device(self.config.device.device)
        self.tp_size = self.config.parallel.tensor_parallel_size
        if self.tp_size > 1:
            join_tensor_parallel_group(self.device, tp_rank, self.tp_size, init_method)
        self.attn_backend = self._backend(ckpt)
        self.model = self._load(ckpt, self.attn_backend, self.config.model.quantization, source.path)
        if self.config.lora is not None:     # LoRA slots around the (packed, quantized) projections
            from actors.worker.lora_manager import LoRAModelManager
            LoRAModelManager(self.model, self.config.lora, self.config.model.arch, self.device)
        log.info("model %s loaded on %s (%s) in %.1f s", source.served_name, self.device.type,
                 self.config.model.dtype, time.monotonic() - t0)
        self.draft_model: torch.nn.Module | None = None    # speculative decoding's draft model
        if draft_ckpt is not None:
            t0 = time.monotonic()
            q = self.config.speculative.quantization
            self.draft_model = self._load(draft_ckpt, self._backend(draft_ckpt), q, draft.path)
            log.info("draft model %s (%s) loaded in %.1f s", draft.served_name, q or self.config.model.dtype,
                     time.monotonic() - t0)
        self.runner: ModelRunner | None = None         # until init_kv_cache
        if not self.config.kv_cache_sized:             # CUDA, sized by --gpu-memory-utilization
            self.config = self.config.with_kv_cache_bytes(self._gpu_kv_cache_bytes())

    def _gpu_kv_cache_bytes(self) -> int:
        """What --gpu-memory-utilization leaves for the KV cache once the weights are loaded
        and the largest step's forward pass ran (its activations stay reserved until then)."""
        profile_run(self.model, self.config)
        torch.cuda.synchronize()
        free, total = device_memory(torch.cuda.current_device())
        utilization = self.config.cache.gpu_memory_utilization
        kv_bytes = kv_cache_bytes_for_gpu(total, total - free, utilization)
        torch.cuda.empty_cache()
        log.info("KV cache: %.2f GiB (%g of the GPU's %.2f GiB, %.2f GiB in use after loading and a "
                 "forward pass)", kv_bytes / GIB, utilization, total / GIB, (total - free) / GIB)
        return kv_bytes

    def _backend(self, ckpt: Checkpoint) -> AttentionBackend:
        cfg = self.config
        return self.platform.select_attention_backend(attention_requirements(
            ckpt.config, torch_dtype(cfg.model.dtype), cfg.cache.block_size, self.device.type,
            torch_dtype(cfg.cache.cache_dtype)))

    def _load(self, ckpt: Checkpoint, backend: AttentionBackend, quantization: str | None, path: str) -> torch.nn.Module:
        cfg = self.config
        quantized = quantization
        if ckpt.quantization_config is not None:     # a quantized checkpoint (config.json says which)
            quantized = str(ckpt.quantization_config.get("quant_method"))
            if self.tp_size > 1:
                raise ValueError(f"a checkpoint quantized as {quantized!r} with tensor parallelism is not "
                                 "supported; use --tensor-parallel-size 1")
        model = build_model(ckpt, torch_dtype(cfg.model.dtype), backend, cfg.cache.block_size,
                            self.device.type, torch_dtype(cfg.cache.cache_dtype), quantization)
        if self.tp_size > 1:                 # this rank's heads and columns (before packing)
            shard_model(model, self.tp_size, self.tp_rank)
        comp = cfg.compilation
        if self.platform.packs_linears and packs_linears(comp, quantized):   # packed once for the native kernels
            prepack_linears(model)
            if comp.level == 1:
                attach_native_decode(model)
        compiled = apply_compilation(model, comp, repr(ckpt.config))
        if compiled is not None:
            log.info("compilation level %d: decoder layers compiled on first use (artifacts in %s)",
                     comp.level, compiled)
        return model

    def init_kv_cache(self) -> int:
        """Allocate the KV cache (and on CUDA capture the decode graphs); returns its bytes."""
        cfg = self.config
        sizes = None
        if self._captures_graphs():
            sizes = [s for s in cfg.compilation.cudagraph_capture_sizes or capture_sizes(cfg.scheduler.max_num_seqs)
                     if s <= cfg.scheduler.max_num_seqs]
        self.runner = ModelRunner(self.model, cfg, sizes, self.draft_model)
        if sizes:
            seconds = self.runner.capture_cudagraphs()
            log.info("captured %d CUDA graphs (decode batches of %s requests) in %.1f s",
                     len(sizes), ", ".join(map(str, sizes)), seconds)
        if cfg.cache.calculate_kv_scales and cfg.cache.cache_dtype.startswith("fp8"):
            # after the graphs' capture: their dummy batches must not set the scales
            calculate_kv_scales_on_next_batch(self.model)
            if self.draft_model is not None:
                calculate_kv_scales_on_next_batch(self.draft_model)
        # layers of different groups share one tensor
        tensors = {t.data_ptr(): t for t in self.runner.kv_caches + self.runner.draft_kv_caches}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _captures_graphs(self) -> bool:
        """CUDA graphs of decode steps: on CUDA, unless eager is enforced or the attention
        backend cannot run inside a graph."""
        if (not self.platform.supports_cuda_graphs or self.config.model.enforce_eager
                or self.config.compilation.cudagraph_mode == "NONE"):
            return False
        if self.tp_size > 1:
            log.warning("tensor parallelism runs every step eagerly for now (no all-reduce inside CUDA graphs)")
            return False
        if self.attn_backend.cudagraph_support == "never":
            log.warning("attention backend %s cannot run in CUDA graphs: every step runs eagerly",
                        self.attn_backend.name)
            return False
        return True

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise RuntimeError("the KV cache is not initialized (InitKVCache first)")
        return self.runner.execute_model(so)


TP_TIMEOUT_S = 120.0             # a collective waiting longer than this for a rank fails the step


def join_tensor_parallel_group(device: torch.device, rank: int, world: int, init_method: str) -> None:
    """This process's place in its engine core's tensor-parallel group (the default process
    group): gloo on the CPU, NCCL on CUDA; the ranks meet at ``init_method``."""
    import datetime
    import torch.distributed as dist
    if not init_method:
        raise ValueError("tensor parallelism needs the ranks' meeting point (init_method)")
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))
    log.info("tensor-parallel rank %d of %d joined its group (%s)", rank, world, dist.get_backend())


PROFILE_REQUEST = "profile"


def profile_run(model: torch.nn.Module, config: EngineConfig) -> None:
    """One forward pass, with sampling, of the largest step the scheduler may send: a prompt of
    max_num_batched_tokens (less than the context length), in a scratch KV cache just large
    enough for it (each KV cache group its own blocks). Its activations are what a step needs
    beside the weights and the cache."""
    bs = config.cache.block_size
    n = max(1, min(config.scheduler.max_num_batched_tokens, config.model.max_model_len - 1))
    blocks = -(-n // bs)
    G = len(config.kv_cache_groups())
    scratch = config.replace(cache=msgspec.structs.replace(config.cache, num_blocks=G * blocks + 1))
    runner = ModelRunner(model, scratch)
    block_ids = tuple(list(range(1 + g * blocks, 1 + (g + 1) * blocks)) for g in range(G))
    request = NewRequestData(PROFILE_REQUEST, [0] * n, [], SamplingParams(temperature=0.0, max_tokens=1),
                             block_ids, 0)
    out = runner.execute_model(SchedulerOutput(0, [request], CachedRequestData(), {PROFILE_REQUEST: n}, n, []))
    if [len(t) for t in out.sampled_token_ids] != [1]:
        raise RuntimeError(f"the profiling step sampled {out.sampled_token_ids}, not one token")
