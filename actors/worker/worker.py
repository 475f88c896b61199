"""The worker's core: one model and its paged KV cache on one device. Loading resolves the
engine's config (the worker knows its platform, actors/worker/platforms.py, and reads the
checkpoint's architecture), then
the model is built, quantized or packed for the CPU, its projections wrapped for LoRA with
--enable-lora (``lora_manager.py``); on CUDA without a KV cache size, a forward
pass measures what --gpu-memory-utilization leaves for the cache (``gpu_memory.py``);
``init_kv_cache`` allocates the cache the resolved config sizes and captures the decode graphs on
CUDA; ``execute_model`` runs one step. Pure: no asyncio, no transport."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
from typing import Any

import msgspec
import torch

from actors.engine import vllm_env
from actors.engine.config import GGUF_FLOAT_WEIGHTS_ENV, EngineConfig, exact_from_gguf_blocks
from actors.engine.profiler import check_prefix
from actors.engine.messages import CALLABLE, CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from actors.engine.pooling import PoolingParams
from actors.engine.sampling_params import SamplingParams
from actors.worker.compilation import apply_compilation, packs_linears
from actors.runtime import heap
from actors.worker.cuda_graphs import graph_sizes
from actors.worker.gpu_memory import GIB, device_memory, kv_cache_bytes_for_gpu
from actors.worker.model_runner import ModelRunner, torch_dtype
from actors.worker.platforms import platform_for
from actors.worker.profiler import StepProfiler, rank_name, worker_profiler
from actors.worker.step_memory import keep_step_heap
from actors.worker.weight_transfer import WeightReceiver, drain, tensor_digests
from kernels.attention.base import AttentionBackend
from kernels.cpu import shm_comm
from models.architectures import TRANSFORMERS_BACKENDS
from models.layers import calculate_kv_scales_on_next_batch, set_attention_bfloat16
from models.native_decode import attach as attach_native_decode
from models.packed import prepack_linears
from models.hf_config import read_quantization_config
from models.resolve import ModelSource, resolve_model
from models.registry import Checkpoint, attention_requirements, build_model, open_checkpoint, pooling_checkpoint
from models.pipeline_parallel import StageLink, split_stage
from models.tensor_parallel import shard_model

log = logging.getLogger("troupe.worker")

PROFILE_BUDGET_S = 10.0          # the most start-up time the step-cost profile takes (one rank)


def serving_checkpoint(source: ModelSource, config: EngineConfig, max_model_len: int) -> Checkpoint:
    """``source`` opened, its architecture config as ``config`` serves it: without sliding
    windows where vLLM's --disable-sliding-window asks, its rotary tables for the context asked
    for (``max_model_len``: --max-model-len as given, before the KV cache caps it; 0: the
    model's default)."""
    ckpt = open_checkpoint(source)
    pooling = config.model.pooling
    if pooling is not None:       # an embedding model or a classifier: no LM head runs
        ckpt = pooling_checkpoint(ckpt, pooling.num_labels if pooling.convert == "classify" else 0, pooling.head_bias,
                                  pooling.score_from_tokens, pooling.score_mlp)
    arch = ckpt.config
    if config.model.disable_sliding_window:     # vLLM's: full attention, the context capped at the window
        arch = arch.without_sliding_window()
    return ckpt._replace(config=arch.serving(max_model_len))


class Worker:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, init_method: str = "", pp_rank: int = 0) -> None:
        """Resolve ``config`` for this platform and checkpoint and load the model (with tensor
        and pipeline parallelism, the part of it of rank ``tp_rank`` in stage ``pp_rank``, after
        joining the ranks' process group at ``init_method``)."""
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        source = config.model.source
        self.requested_len = config.model.max_model_len     # what the rotary tables serve (serving_checkpoint)
        ckpt = serving_checkpoint(source, config, self.requested_len)
        draft = config.model.draft_source
        draft_ckpt = serving_checkpoint(draft, config, self.requested_len) if draft is not None else None
        self.config = config.resolve(cuda_available=platform_for("cuda").is_available(),
                                     cpu_count=os.cpu_count() or 1,
                                     arch=ckpt.config, draft_arch=draft_ckpt.config if draft_ckpt else None)
        self.platform = platform_for(self.config.device.device)       # what the device runs, and how
        self.platform.check_dtypes(self.config.model.dtype, self.config.cache.cache_dtype)
        cores = None
        if self.config.device.device == "cpu":      # vLLM's VLLM_CPU_OMP_THREADS_BIND: this worker's cores
            parallel = self.config.parallel
            cores = vllm_env.bound_cores((parallel.data_parallel_rank - parallel.data_parallel_start_rank)
                                         * parallel.world_size       # this machine's ranks (--nnodes): its own
                                         + (pp_rank * parallel.tensor_parallel_size + tp_rank)
                                         % parallel.local_world_size)
        if cores is not None:
            os.sched_setaffinity(0, cores)
            if not config.device.num_threads:       # no --threads: a thread per core
                self.config = self.config.replace(device=msgspec.structs.replace(self.config.device,
                                                                                 num_threads=len(cores)))
            log.info("bound to cores %s (VLLM_CPU_OMP_THREADS_BIND), %d threads", cores,
                     self.config.device.num_threads)
        torch.set_num_threads(self.config.device.num_threads)
        torch.manual_seed(self.config.model.seed)
        self.device = torch.device(self.config.device.device)
        self.tp_size = self.config.parallel.tensor_parallel_size
        self.pp_size = self.config.parallel.pipeline_parallel_size
        self.tp_group = None                # the default group, unless stages each have theirs
        self.link: StageLink | None = None  # this pipeline stage's neighbours
        if self.tp_size * self.pp_size > 1:
            parallel = self.config.parallel      # the mp backend places rank r on machine r // local world size
            nodes = ([r // parallel.local_world_size for r in range(parallel.world_size)]
                     if parallel.distributed_executor_backend == "mp" else None)
            self.tp_group = join_parallel_groups(self.device, tp_rank, pp_rank, self.tp_size, self.pp_size,
                                                 init_method, nodes)
        self.attn_backend = self._backend(ckpt)
        self._load_models(ckpt, draft_ckpt)
        if self.pp_size > 1:
            rank = pp_rank * self.tp_size + tp_rank           # in the world group
            self.link = StageLink(rank - self.tp_size if pp_rank > 0 else None,
                                  rank + self.tp_size if pp_rank < self.pp_size - 1 else None,
                                  self.model.intermediate_keys, self.config.model.arch.hidden_size,
                                  torch_dtype(self.config.model.dtype), self.device)
            log.info("pipeline stage %d of %d: layers %d to %d", pp_rank, self.pp_size, self.model.start_layer,
                     self.model.end_layer - 1)
        self.runner: ModelRunner | None = None         # until init_kv_cache
        self.asleep = 0                                # sleep mode's level (0: awake)
        self.kv_connector = None                       # --kv-transfer-config: the connector's worker side
        parallel = self.config.parallel                # --weight-transfer-config: the trainer's group
        self.weight_receiver = WeightReceiver(self.config.weight_transfer, self.device,
                                              parallel.data_parallel_rank * parallel.world_size
                                              + pp_rank * self.tp_size + tp_rank)
        self.profiler: StepProfiler | None = None      # --profiler-config: from the first /start_profile
        if not self.config.kv_cache_sized:             # CUDA, sized by --gpu-memory-utilization
            self.config = self.config.with_kv_cache_bytes(self._gpu_kv_cache_bytes())
        self.extension_methods: tuple[str, ...] = ()   # --worker-extension-cls's
        if self.config.parallel.worker_extension_cls:
            self._extend(self.config.parallel.worker_extension_cls)

    def _extend(self, qualified: str) -> None:
        """vLLM's --worker-extension-cls: this worker gains the class's methods (a class of its
        own, the extension after Worker); one that redefines a worker attribute is refused."""
        module_name, _, name = qualified.rpartition(".")
        try:
            extension = getattr(importlib.import_module(module_name), name) if module_name else None
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--worker-extension-cls {qualified}: {exc}") from None
        if not isinstance(extension, type):
            raise ValueError(f"--worker-extension-cls {qualified}: not a class (give module.ClassName)")
        mine = set(dir(self))
        added = tuple(n for n in vars(extension) if not n.startswith("__"))
        clash = sorted(n for n in added if n in mine)
        if clash:
            raise ValueError(f"--worker-extension-cls {qualified}: the worker already has {', '.join(clash)}")
        self.__class__ = type(f"Worker+{extension.__name__}", (type(self), extension), {})
        self.extension_methods = tuple(n for n in added if not n.startswith("_") and callable(getattr(self, n)))
        log.info("worker extended with %s: %s", qualified, ", ".join(self.extension_methods) or "no methods")

    def _load_models(self, ckpt: Checkpoint, draft_ckpt: Checkpoint | None) -> None:
        """The model (with its LoRA slots) and speculative decoding's draft model, from their
        checkpoints (at start-up, and again when sleep level 2 let them go)."""
        t0 = time.monotonic()
        source, draft = self.config.model.source, self.config.model.draft_source
        self.model = self._load(ckpt, self.attn_backend, self.config.model.quantization, source.path)
        if self.config.lora is not None:     # LoRA slots around the (packed, quantized) projections
            from actors.worker.lora_manager import LoRAModelManager
            LoRAModelManager(self.model, self.config.lora, self.config.model.arch, self.device)
        log.info("model %s loaded on %s (%s%s) in %.1f s", source.served_name, self.device.type,
                 self.config.model.dtype, ", linear layers from the GGUF file's blocks" if self.model.exact_from_blocks
                 else "", time.monotonic() - t0)
        self.draft_model: torch.nn.Module | None = None    # speculative decoding's draft model
        if draft_ckpt is not None and self.pp_rank == self.pp_size - 1:    # whole, on the stage that samples
            t0 = time.monotonic()
            q = self.config.speculative.quantization
            self.draft_model = self._load(draft_ckpt, self._backend(draft_ckpt), q, draft.path, staged=False)
            log.info("draft model %s (%s) loaded in %.1f s", draft.served_name, q or self.config.model.dtype,
                     time.monotonic() - t0)

    def _gpu_kv_cache_bytes(self) -> int:
        """What --gpu-memory-utilization leaves for the KV cache once the weights are loaded
        and the largest step's forward pass ran (its activations stay reserved until then)."""
        profile_run(self.model, self.config, self.link)
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
            ckpt.config, torch_dtype(self._compute_dtype(cfg.model.quantization)), cfg.cache.block_size, self.device.type,
            torch_dtype(cfg.cache.cache_dtype)))

    def _compute_dtype(self, quantization: str | None) -> str:
        """What the model computes in (see Platform.compute_dtype); the linear weights keep --dtype."""
        packs = self.platform.packs_linears and packs_linears(self.config.compilation, quantization)
        return self.platform.compute_dtype(self.config.model.dtype, packs)

    def _exact_from_blocks(self, quantized: str | None, compute: str, path: str) -> bool:
        """Whether exact mode runs this checkpoint's GGUF blocks (actors/engine/config.py
        ``exact_from_gguf_blocks``), where the platform packs linears and the native kernels build."""
        cfg = self.config
        if not (self.platform.packs_linears and compute == "float32"
                and exact_from_gguf_blocks(path, quantized, cfg.model.dtype, self.device.type, cfg.compilation.level,
                                           cfg.weight_transfer is not None)):
            return False
        from kernels.cpu.native import available
        return available()[0]

    def _load(self, ckpt: Checkpoint, backend: AttentionBackend, quantization: str | None, path: str,
              staged: bool = True, blocks: bool | None = None) -> torch.nn.Module:
        """A model split over this worker's ranks: its tensor-parallel share and, when ``staged``
        (the target, not a draft model), its pipeline stage's layers. ``blocks``: whether exact
        mode keeps a GGUF file's blocks (None: as ``_exact_from_blocks`` decides)."""
        cfg = self.config
        staged = staged and self.pp_size > 1
        quantized = quantization
        if ckpt.quantization_config is not None:     # a quantized checkpoint (config.json says which)
            quantized = str(ckpt.quantization_config.get("quant_method"))
        compute = self._compute_dtype(quantized)
        storage = quantization
        if (blocks if blocks is not None else self._exact_from_blocks(quantized, compute, path)):
            storage = "gguf"                         # exact mode's results from the file's blocks

        def this_ranks_part(model: torch.nn.Module) -> None:
            """Once loaded, before quantized weights are processed and anything is packed."""
            if staged:                       # this stage's layers (before splitting them over ranks)
                split_stage(model, self.pp_size, self.pp_rank)
            if self.tp_size > 1:             # this rank's heads and columns
                shard_model(model, self.tp_size, self.tp_rank, self.tp_group,
                            expert_parallel=cfg.parallel.enable_expert_parallel)
                log_expert_placement(model, self.tp_rank)
        model = build_model(ckpt, torch_dtype(compute), backend, cfg.cache.block_size,
                            self.device.type, torch_dtype(cfg.cache.cache_dtype), storage,
                            transform=this_ranks_part)
        model.exact_from_blocks = storage != quantization
        comp = cfg.compilation
        if self.platform.packs_linears and packs_linears(comp, quantized):   # packed once for the native kernels
            bf16 = compute != cfg.model.dtype and cfg.model.dtype == "bfloat16"
            prepack_linears(model, bfloat16=bf16)
            set_attention_bfloat16(model, bf16)      # encoders' prompt attention, as their matmuls
            if comp.level == 1 and not staged:     # the native stack runs every layer from the embedding
                attach_native_decode(model)
        if comp.compiles and ckpt.config.architecture in TRANSFORMERS_BACKENDS:
            log.info("compilation level %d: the transformers backend's layers run eagerly (custom ops only)",
                     comp.level)
            comp = msgspec.structs.replace(comp, level=1)
        compiled = apply_compilation(model, comp, repr(ckpt.config))
        if compiled is not None:
            log.info("compilation level %d: decoder layers compiled on first use (artifacts in %s)",
                     comp.level, compiled)
        return model

    def init_kv_cache(self, config: EngineConfig | None = None) -> int:
        """Allocate the KV cache (and on CUDA capture the decode graphs); returns its bytes.
        ``config``: the engine core's resolved config, when its block count (the fewest any rank
        has room for) and context length are to be this worker's."""
        if config is not None:
            self.config = self.config.replace(
                cache=msgspec.structs.replace(self.config.cache, num_blocks=config.cache.num_blocks),
                model=msgspec.structs.replace(self.config.model, max_model_len=config.model.max_model_len))
        cfg = self.config
        sizes = None
        if self._captures_graphs():
            sizes = graph_sizes(cfg.compilation, cfg.scheduler.max_num_seqs)
        self.runner = ModelRunner(self.model, cfg, sizes, self.draft_model, self.link)
        if sizes:
            seconds = self.runner.capture_cudagraphs()
            log.info("captured %d CUDA graphs (decode batches of %s requests) in %.1f s",
                     len(sizes), ", ".join(map(str, sizes)), seconds)
        if cfg.cache.calculate_kv_scales and cfg.cache.cache_dtype.startswith("fp8"):
            # after the graphs' capture: their dummy batches must not set the scales
            calculate_kv_scales_on_next_batch(self.model)
            if self.draft_model is not None:
                calculate_kv_scales_on_next_batch(self.draft_model)
        if cfg.kv_transfer is not None:
            from actors.kv_transfer.base import KVConnectorRole
            from actors.kv_transfer.factory import KVConnectorFactory
            self.kv_connector = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER,
                                                                   self.pp_rank * self.tp_size + self.tp_rank)
            self.kv_connector.register_kv_caches(self.runner.kv_caches)
        if self.device.type == "cpu":        # from now on step tensors reuse the heap (actors/worker/step_memory.py)
            keep_step_heap()
        # layers of different groups share one tensor; a state-space layer holds its states (a
        # tuple), a layer without a token mixer nothing (None)
        tensors = {t.data_ptr(): t for c in self.runner.kv_caches + self.runner.draft_kv_caches
                   for t in (c if isinstance(c, tuple) else (c,)) if t is not None and t.numel()}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # -- sleep mode (vLLM's --enable-sleep-mode) -----------------------------------------------
    def sleep(self, level: int, kv_cache_only: bool = False) -> None:
        """Give back the KV cache's memory (level 1; on a GPU the weights go to the host's
        memory, unless ``kv_cache_only``), or that and the weights' (level 2). The engine paused
        first (nothing runs, the prefix cache forgotten)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.kv_connector is not None:
            raise RuntimeError("sleep mode with a KV connector is not supported (its transfers hold the cache)")
        self.runner = None                  # the KV cache, its views and the graphs over it
        for model in (self.model, self.draft_model):
            stack = getattr(model, "native_decode", None)
            if stack is not None:
                stack.unbind()              # it keeps the caches it wrote last
        if level == 2:
            self.model = self.draft_model = None
        elif self.device.type != "cpu" and not kv_cache_only:
            self.model.to("cpu")
            if self.draft_model is not None:
                self.draft_model.to("cpu")
        heap.collect_all()                  # the model's cycles were frozen with the start-up's objects
        self.platform.empty_cache()
        self.asleep = level
        log.info("asleep (level %d): the KV cache%s given back", level, " and the weights" if level == 2 else
                 " (only)" if kv_cache_only else "")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """The weights back (reloaded from the checkpoint after level 2), then the KV cache
        (``tags``: "weights" and/or "kv_cache"; None: both). Whether fully awake."""
        tags = ["weights", "kv_cache"] if tags is None else tags
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' or 'kv_cache', got {sorted(unknown)}")
        if "weights" in tags and self.weights_asleep:
            t0 = time.monotonic()
            if self.model is None:          # level 2: read again
                draft = self.config.model.draft_source
                self._load_models(serving_checkpoint(self.config.model.source, self.config, self.requested_len),
                                  serving_checkpoint(draft, self.config, self.requested_len)
                                  if draft is not None else None)
            else:
                self.model.to(self.device)
                if self.draft_model is not None:
                    self.draft_model.to(self.device)
            log.info("the weights are back in %.1f s", time.monotonic() - t0)
        if "kv_cache" in tags and self.runner is None and not self.weights_asleep:
            self.init_kv_cache()
        awake = self.runner is not None
        if awake:
            self.asleep = 0
            heap.started()                  # the new long-lived objects frozen again, as at start-up
            self.platform.empty_cache()     # what reading the checkpoint again took for a while
        return awake

    @property
    def weights_asleep(self) -> bool:
        return self.model is None or (self.asleep == 1 and self.device.type != "cpu"
                                      and next(self.model.parameters()).device.type == "cpu")

    def _captures_graphs(self) -> bool:
        """CUDA graphs of decode steps: on CUDA, unless eager is enforced or the attention
        backend cannot run inside a graph."""
        if (not self.platform.supports_cuda_graphs or self.config.model.enforce_eager
                or self.config.compilation.cudagraph_mode == "NONE"):
            return False
        if self.config.model.arch.encoder_only:     # whole prompts only: it never runs a decode step
            return False
        if self.config.model.arch.mamba is not None:
            log.warning("state-space (Mamba) layers run eagerly for now: no CUDA graphs")
            return False
        if self.config.model.arch.architecture in TRANSFORMERS_BACKENDS:
            log.warning("the transformers backend runs eagerly for now: no CUDA graphs")
            return False
        if self.tp_size > 1:
            log.warning("tensor parallelism runs every step eagerly for now (no all-reduce inside CUDA graphs)")
            return False
        if self.pp_size > 1:
            log.warning("pipeline parallelism runs every step eagerly for now (no send/recv inside CUDA graphs)")
            return False
        if self.attn_backend.cudagraph_support == "never":
            log.warning("attention backend %s cannot run in CUDA graphs: every step runs eagerly",
                        self.attn_backend.name)
            return False
        return True

    def profile_step_costs(self, budget_s: float = PROFILE_BUDGET_S) -> list[tuple[int, int, float]]:
        """Steps of known sizes through the real runner and KV cache before any request comes,
        each timed as served steps are (its compute seconds), so that the scheduler's step-cost
        model starts fitted (--max-step-latency-ms): prompt chunks after cached context, a
        prompt beside a decode, decodes at growing contexts. Each (tokens, attention pairs,
        seconds) as actors/scheduler/cost_model.py counts them; none when the KV cache is too
        small for them, and fewer when the steps overrun ``budget_s`` (a busy machine: the model then
        fits on the first served steps too). The requests are dropped afterwards, their blocks
        left free."""
        from actors.scheduler.cost_model import attention_pairs
        if self.runner is None:
            raise RuntimeError("the KV cache is not initialized (InitKVCache first)")
        cfg = self.config
        bs, budget = cfg.cache.block_size, cfg.scheduler.max_num_batched_tokens
        chunk = max(1, min(256, budget // 2, (cfg.model.max_model_len - 16) // 2))
        plan = {"cost-a": 2 * chunk, "cost-b": chunk // 2 or 1, "cost-c": chunk}    # prompt lengths
        blocks, start, tables = {}, 1, {}
        groups = len(cfg.kv_cache_groups())
        for rid, n in plan.items():
            blocks[rid] = -(-(n + 12) // bs)
            tables[rid] = tuple(list(range(start + g * blocks[rid], start + (g + 1) * blocks[rid]))
                                for g in range(groups))
            start += groups * blocks[rid]
        if start > cfg.cache.num_blocks:
            return []
        greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                                pooling=PoolingParams(pooling_type="LAST") if cfg.model.pooling is not None else None)
        vocab = cfg.model.arch.vocab_size
        computed: dict[str, int] = {}
        costs: list[tuple[int, int, float]] = []
        step = 0

        # tensor-parallel ranks run the same steps (their collectives pair up): no deadline there
        deadline = time.monotonic() + budget_s if self.tp_size == 1 else float("inf")

        def run(new: dict[str, int], cont: dict[str, int], record: bool) -> None:
            nonlocal step
            if time.monotonic() > deadline:
                return
            reqs = [NewRequestData(rid, [(7 * i + 3) % (vocab - 1) + 1 for i in range(plan[rid])], [], greedy,
                                   tables[rid], 0) for rid in new]
            cached = CachedRequestData(list(cont), [tuple([] for _ in range(groups)) for _ in cont],
                                       [computed[r] for r in cont])
            sched = {**new, **cont}
            out = self.runner.execute_model(SchedulerOutput(10**9 + step, reqs, cached, sched,
                                                            sum(sched.values()), []))
            step += 1
            if record:
                pairs = sum(attention_pairs(computed.get(r, 0), n) for r, n in sched.items())
                costs.append((sum(sched.values()), pairs, out.compute_s))
            for r, n in sched.items():
                computed[r] = computed.get(r, 0) + n

        run({"cost-a": chunk}, {}, record=False)                         # warm-up
        run({}, {"cost-a": chunk}, record=True)                           # a chunk after cached context
        run({"cost-b": plan["cost-b"]}, {"cost-a": 1}, record=True)       # a prompt beside a decode
        for _ in range(6):
            run({}, {"cost-a": 1, "cost-b": 1}, record=True)              # decodes
        run({"cost-c": chunk}, {"cost-a": 1, "cost-b": 1}, record=True)   # a prompt beside two decodes
        run({}, {"cost-a": 1, "cost-b": 1, "cost-c": 1}, record=True)
        self.runner.execute_model(SchedulerOutput(10**9 + step, [], CachedRequestData(), {}, 0,
                                                  [r for r in plan if r in computed]))
        return costs

    # -- vLLM's collective_rpc: worker methods called by name -------------------------------------
    def rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """``method`` (one of RPC_METHODS, or of --worker-extension-cls) with ``args`` and
        ``kwargs``; ValueError for another. CALLABLE: ``args[0]`` is a pickled function, called
        with this worker and the other arguments; its result comes back pickled."""
        if method == CALLABLE:
            import pickle
            if not (args and isinstance(args[0], bytes)):
                raise ValueError("a function comes pickled (collective_rpc of a callable)")
            fn = pickle.loads(args[0])
            return pickle.dumps(fn(self, *args[1:], **kwargs))
        if method not in RPC_METHODS and method not in self.extension_methods:
            raise ValueError(f"unknown worker method {method!r}: Troupe's workers answer "
                             f"{', '.join(RPC_METHODS + self.extension_methods)}")
        return getattr(self, method)(*args, **kwargs)

    def get_model(self) -> torch.nn.Module:
        """vLLM's: the model this worker runs (its tensor-parallel share, its stage's layers)."""
        return self._weights_model()

    def apply_model(self, fn: Any) -> Any:
        """vLLM's: ``fn`` applied to this worker's model."""
        return fn(self.get_model())

    def reload_weights(self, weights_path: str | None = None, is_checkpoint_format: bool | str = True) -> None:
        """vLLM's: the weights read again from the checkpoint, or from ``weights_path`` (a
        checkpoint of the same architecture, a directory or a .gguf file, which the model then
        comes from), packed or quantized as at start-up and copied into the model's own tensors,
        so the KV cache, the running requests and the CUDA graphs stay. Tokens computed before
        (the prefix cache's among them) keep the old weights' keys and values: an RL loop
        pauses, reloads, resets the prefix cache and resumes."""
        if str(is_checkpoint_format).strip().lower() not in ("true", "1"):
            raise ValueError("reload_weights reads checkpoints only (is_checkpoint_format true)")
        self._check_weights_replaceable("reload_weights", blocks=True)
        old = self.config.model.source
        source = old
        if weights_path is not None:
            try:
                found = resolve_model(str(weights_path))
            except ValueError as exc:
                raise ValueError(f"reload_weights: {exc}") from None
            source = ModelSource(found.kind, found.path, old.served_name, old.hf_overrides, old.model_impl,
                                 old.language_model_only)
        blocks = self.model.exact_from_blocks
        if blocks and not source.path.endswith(".gguf"):
            raise ValueError(f"reload_weights: the served model runs its GGUF file's Q4_1 / Q8_0 blocks, which the "
                             f"float weights of {source.path} cannot be copied into; start the server with "
                             f"{GGUF_FLOAT_WEIGHTS_ENV}=1 to hold float32 copies instead")
        t0 = time.monotonic()
        try:
            fresh = self._load(serving_checkpoint(source, self.config, self.requested_len), self.attn_backend,
                               self.config.model.quantization, source.path,
                               blocks=blocks)
        except OSError as exc:
            raise ValueError(f"reload_weights: {source.path} could not be read ({exc})") from None
        try:
            n = copy_weights(self.model, fresh)
        finally:
            del fresh
            heap.collect_all()
            heap.started()
        self.config = self.config.replace(model=msgspec.structs.replace(self.config.model, source=source))
        log.info("reloaded %d weight tensors from %s in %.1f s", n, source.path, time.monotonic() - t0)

    # -- weight transfer (vLLM's --weight-transfer-config; actors/worker/weight_transfer.py) -------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's process group (blocks until every rank met, or the config's timeout)."""
        self.weight_receiver.init(init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.weight_receiver.shutdown()

    def start_weight_update(self) -> None:
        self._start_weight_update(draft=False)

    def start_draft_weight_update(self) -> None:
        self._start_weight_update(draft=True)

    def _start_weight_update(self, draft: bool) -> None:
        self._check_weights_replaceable("weight transfer")
        if draft and self.draft_model is None:
            raise ValueError("start_draft_weight_update: this engine has no draft model "
                             "(--speculative-config with a draft \"model\")")
        source = self.config.model.draft_source if draft else self.config.model.source
        if source.kind == "hf_dir" and read_quantization_config(source.path) is not None:
            raise ValueError(f"weight transfer: {source.path} is a quantized checkpoint; the trainer's float "
                             f"weights cannot replace its packed integers (serve the float checkpoint, with "
                             f"--quantization fp8 to quantize what is received)")
        self.weight_receiver.start(draft)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> int:
        """Receive one chunk of the round (the trainer broadcasts its tensors meanwhile)."""
        return self.weight_receiver.receive(update_info)

    def finish_weight_update(self) -> int:
        """The round's tensors loaded into a fresh model as start-up loads a checkpoint, then
        copied into the served one; ValueError (no weight changed) for a missing or unknown
        parameter or a shape that differs."""
        received, draft = self.weight_receiver.take()
        t0 = time.monotonic()
        source = self.config.model.draft_source if draft else self.config.model.source
        ckpt = serving_checkpoint(source, self.config, self.requested_len)
        ckpt = ckpt._replace(weights=drain(received), tensor_map="hf_tensor_map", quantization_config=None)
        try:
            if draft:
                fresh = self._load(ckpt, self._backend(ckpt), self.config.speculative.quantization, source.path,
                                   staged=False)
            else:
                fresh = self._load(ckpt, self.attn_backend, self.config.model.quantization, source.path, blocks=False)
        except ValueError as exc:
            raise ValueError(f"finish_weight_update: {exc}; no weight was changed") from None
        finally:
            received.clear()
        try:
            n = copy_weights(self.draft_model if draft else self.model, fresh)
        finally:
            del fresh
            heap.collect_all()
            heap.started()
        log.info("weight transfer: %d %stensors replaced in %.1f s", n, "draft model " if draft else "",
                 time.monotonic() - t0)
        return n

    def compute_weight_checksums(self) -> dict[str, str]:
        """vLLM's /weight_checker checksums: SHA-256 of every tensor the model holds (packed ones
        as packed), named with this rank's place."""
        p = self.config.parallel
        return tensor_digests(self._weights_model(), _module_tensors,
                              f"dp{p.data_parallel_rank}:pp{self.pp_rank}:pcp0:tp{self.tp_rank}:")

    def reset_weights(self) -> None:
        """vLLM's /weight_checker reset: every weight zeroed (a test that an update lands)."""
        with torch.no_grad():
            for module in self._weights_model().modules():
                for t in _module_tensors(module).values():
                    t.zero_()

    def _weights_model(self) -> torch.nn.Module:
        if self.model is None or self.weights_asleep:
            raise ValueError("the weights sleep: wake the engine up first")
        return self.model

    def _check_weights_replaceable(self, what: str, blocks: bool = False) -> None:
        """Refuse to replace the weights where they cannot be; ``blocks``: a GGUF file's blocks
        may be replaced (by the blocks of another file)."""
        if self.config.lora is not None:
            raise ValueError(f"{what} with --enable-lora is not supported (the adapters' slots are built "
                             f"around the loaded projections)")
        if self.model is None or self.weights_asleep:
            raise ValueError(f"{what} while the weights sleep: wake the engine up first")
        if self.model.exact_from_blocks and not blocks:
            raise ValueError(f"{what}: the served model runs its GGUF file's Q4_1 / Q8_0 blocks, which float "
                             f"weights cannot be copied into; start the server with {GGUF_FLOAT_WEIGHTS_ENV}=1 "
                             f"to hold float32 copies instead")

    # -- profiling (vLLM's --profiler-config: /start_profile, /stop_profile) --------------------
    def profile(self, start: bool, prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """Open a profiling session (its traces named ``[prefix_]dp.._pp.._tp.._rank..``), or
        close the open one (its trace written)."""
        config = self.config.profiler
        if not config.enabled:
            raise RuntimeError("Profiling is not enabled. Please set --profiler-config to enable profiling. "
                               "Example: --profiler-config.profiler=torch "
                               "--profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE")
        if not start:
            if self.profiler is not None:
                self.profiler.stop()
            return
        check_prefix(prefix)
        name = rank_name(prefix, self.config.parallel.data_parallel_rank, self.pp_rank, self.tp_rank,
                         self.tp_size, self.pp_size)
        if self.profiler is None:
            first = self.config.parallel.data_parallel_rank == 0 and self.pp_rank == 0 and self.tp_rank == 0
            self.profiler = worker_profiler(config, name, self.device.type, first)
        self.profiler.start(name, delay_iterations, max_iterations)

    def _in_prompt(self, rid: str) -> bool:
        """Whether request ``rid`` has no output token yet (a step label's "context" phase)."""
        b = self.runner.batch
        if rid not in b:
            return True
        i = b.slot(rid)
        return bool(b.num_tokens[i] <= b.num_prompt_tokens[i])

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise RuntimeError("the KV cache is not initialized (InitKVCache first)")
        profiler = self.profiler
        if profiler is None or not profiler.active:
            return self._execute_model(so)
        profiler.step()
        with profiler.annotate(so, self._in_prompt):
            return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.kv_connector
        if connector is None:
            return self.runner.execute_model(so)
        # the step's loads start in the background (into blocks no request of this step reads);
        # the requests it saves are readable once its forward has written their KV
        connector.start_load_kv(so.kv_connector_metadata or b"")
        self.runner.kv_layer_hooks = connector if connector.has_layer_work() else None
        try:
            out = self.runner.execute_model(so)
        finally:
            self.runner.kv_layer_hooks = None
        connector.wait_for_save()
        out.kv_connector_output = connector.get_finished()
        return out


RPC_METHODS = ("reload_weights", "init_weight_transfer_engine", "shutdown_weight_transfer_engine",
               "start_weight_update", "start_draft_weight_update", "update_weights", "finish_weight_update",
               "compute_weight_checksums", "reset_weights")


def copy_weights(model: torch.nn.Module, fresh: torch.nn.Module) -> int:
    """Every tensor ``fresh`` holds (parameters, buffers, packed panels and scales: any tensor
    attribute of its modules, alone or in a list) copied into the same tensor of ``model``, which
    keeps its storage (what points at it stays valid: the native decode stack, CUDA graphs).
    Checked whole before anything is copied: ValueError when the two differ in any module or
    tensor. Returns how many tensors were copied."""
    mine, theirs = dict(model.named_modules()), dict(fresh.named_modules())
    if mine.keys() != theirs.keys():
        extra = sorted(mine.keys() ^ theirs.keys())[:3]
        raise ValueError(f"reload_weights: the checkpoint's model differs from the served one (modules {extra})")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, module in mine.items():
        a, b = _module_tensors(module), _module_tensors(theirs[name])
        if a.keys() != b.keys():
            raise ValueError(f"reload_weights: module {name or 'model'} holds other tensors in the checkpoint's model "
                             f"({sorted(a.keys() ^ b.keys())[:3]})")
        for key, t in a.items():
            u = b[key]
            if t.shape != u.shape or t.dtype != u.dtype:
                raise ValueError(f"reload_weights: {name}.{key} is {tuple(u.shape)} {u.dtype} in the checkpoint, "
                                 f"{tuple(t.shape)} {t.dtype} in the served model: not the same architecture")
            pairs.append((t, u))
    with torch.no_grad():
        for t, u in pairs:
            t.copy_(u)
    return len(pairs)


def _module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a module holds itself (not its submodules'), by attribute: list items as
    attr[i], the fields of a packed weight (a dataclass: PanelWeight, IntWeights, ...) as attr.field."""
    out: dict[str, torch.Tensor] = {}
    for key, value in vars(module).items():
        if key in ("_parameters", "_buffers"):
            out.update((k, v) for k, v in value.items() if v is not None)
        elif isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, (list, tuple)):
            out.update((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, torch.Tensor):
                    out[f"{key}.{f.name}"] = v
    return out


def log_expert_placement(model: torch.nn.Module, rank: int) -> None:
    """One line on where a mixture-of-experts model's experts went on this rank."""
    from models.moe import FusedMoE
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if moe is not None:
        log.info("rank %d: mixture-of-experts layers %s (%s)", rank,
                 "split every expert" if moe.parallel == "tensor" else "hold whole experts", moe.extra_repr())


TP_TIMEOUT_S = 120.0             # a collective waiting longer than this for a rank fails the step


def join_parallel_groups(device: torch.device, tp_rank: int, pp_rank: int, tp: int, pp: int,
                         init_method: str, nodes: list[int] | None = None) -> object | None:
    """This process's place in its engine core's group of ``tp`` x ``pp`` ranks (the default
    process group, rank pp_rank * tp + tp_rank: vLLM's order): gloo on the CPU, NCCL on CUDA;
    the ranks meet at ``init_method``. ``nodes``: the machine of each rank (None: not known).
    On the CPU a tensor-parallel group on one machine all-reduces and all-gathers through shared
    memory, and one over several machines all-reduces through each machine's shared memory and
    gloo between them (kernels/cpu/shm_comm.py). Returns its stage's tensor-parallel group
    (None: the default group is that group, one stage)."""
    import datetime
    import torch.distributed as dist
    if not init_method:
        raise ValueError("tensor and pipeline parallelism need the ranks' meeting point (init_method)")
    rank, world = pp_rank * tp + tp_rank, tp * pp
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))
    groups = [None]
    if pp > 1 and tp > 1:          # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(stage * tp, (stage + 1) * tp))) for stage in range(pp)]
    group = groups[pp_rank if pp > 1 and tp > 1 else 0]
    how = dist.get_backend()
    if device.type == "cpu" and nodes is not None and tp > 1:
        for stage, g in enumerate(groups):        # every stage's group, in the same order on every rank
            ranks = list(range(stage * tp, (stage + 1) * tp))
            machines = [nodes[r] for r in ranks]
            if len(set(machines)) == 1:          # on one machine: its shared memory, set up by its ranks
                if stage == pp_rank and shm_comm.register(f"{init_method}/stage{stage}", tp_rank, tp, g):
                    how += ", shared memory for the tensor-parallel collectives"
            elif shm_comm.register_hierarchical(f"{init_method}/stage{stage}", rank, ranks, machines, g) \
                    and stage == pp_rank:
                how += ", each machine's shared memory and gloo between machines for the all-reduces"
    log.info("rank %d of %d (tensor-parallel rank %d, pipeline stage %d) joined its group (%s)", rank, world,
             tp_rank, pp_rank, how)
    return group


PROFILE_REQUEST = "profile"


def profile_run(model: torch.nn.Module, config: EngineConfig, link: StageLink | None = None) -> None:
    """One forward pass, with sampling, of the largest step the scheduler may send: a prompt of
    max_num_batched_tokens (less than the context length), in a scratch KV cache just large
    enough for it (each KV cache group its own blocks). Its activations are what a step needs
    beside the weights and the cache."""
    bs = config.cache.block_size
    n = max(1, min(config.scheduler.max_num_batched_tokens, config.model.max_model_len - 1))
    blocks = -(-n // bs)
    G = len(config.kv_cache_groups())
    scratch = config.replace(cache=msgspec.structs.replace(config.cache, num_blocks=G * blocks + 1))
    runner = ModelRunner(model, scratch, link=link)    # every stage profiles at once, handing tensors on
    block_ids = tuple(list(range(1 + g * blocks, 1 + (g + 1) * blocks)) for g in range(G))
    pooling = PoolingParams(pooling_type="LAST") if config.model.pooling is not None else None
    request = NewRequestData(PROFILE_REQUEST, [0] * n, [], SamplingParams(temperature=0.0, max_tokens=1,
                                                                         pooling=pooling), block_ids, 0)
    out = runner.execute_model(SchedulerOutput(0, [request], CachedRequestData(), {PROFILE_REQUEST: n}, n, []))
    if pooling is not None:
        if list(out.pooler_output) != [PROFILE_REQUEST]:
            raise RuntimeError("the profiling step pooled nothing")
    elif runner.samples and [len(t) for t in out.sampled_token_ids] != [1]:
        raise RuntimeError(f"the profiling step sampled {out.sampled_token_ids}, not one token")
