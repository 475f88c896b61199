"""EngineConfig: the engine's whole configuration, composed of model, cache, scheduler, parallel
and device parts (vLLM's ``VllmConfig`` shape), built once by ``EngineArgs`` from the command
line or the offline API and passed whole to every component.

Values that say "auto" (device, dtype, KV cache dtype) or 0 (``max_model_len``, the number of
KV blocks) are resolved once, by ``EngineConfig.resolve``, when the worker knows its platform and
has read the checkpoint's architecture; the resolved config travels back to the engine core
(scheduler, KV manager) and to the frontend (tokenizer, API). Resolving a resolved config
changes nothing, so a restarted worker is given the resolved one. On CUDA without a KV cache
size, the number of blocks is left to the worker, which measures what gpu_memory_utilization
leaves once the weights are loaded (``with_kv_cache_bytes``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any, Literal

import msgspec

from actors.engine import vllm_env
from actors.engine.compilation import CompilationConfig
from actors.engine.lora import LoRAConfig
from actors.engine.pooling import ModelPooling
from actors.grammar.config import StructuredOutputsConfig
from actors.engine.profiler import ProfilerConfig
from actors.engine.sampling_params import LOGPROBS_MODES, SamplingDefaults
from actors.kv_manager.kv_cache_spec import (KVCacheGroupSpec, KVCacheSpec, bytes_per_block, group_size, kv_cache_groups,
                                             max_tokens_per_request, model_kv_cache_specs, num_blocks_for,
                                             stage_groups, with_draft_layers)
from actors.kv_manager.block_hash import HASH_ALGOS
from actors.kv_manager.kv_events import KVEventsConfig
from actors.kv_transfer.config import KVTransferConfig
from actors.spec_decode.config import SpeculativeConfig
from models.architectures import ENCODER_ONLY_ARCHITECTURES, TRANSFORMERS_BACKENDS
from models.config import ArchConfig
from models.resolve import ModelSource
from actors.engine.watermark import WatermarkConfig
from actors.engine.weight_transfer import WeightTransferConfig

log = logging.getLogger("troupe.engine")

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")   # fp8: e4m3
# None: exact. models/quantization's registry, spelled out (importing it loads torch)
QUANTIZATIONS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4", "gguf", "gguf-i8")
CPU_ONLY_QUANTIZATIONS = ("gguf", "gguf-i8")
SCHEDULING_POLICIES = ("fcfs", "priority")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uni")   # vLLM's names
DATA_PARALLEL_BACKENDS = ("mp", "ray")                 # vLLM's --data-parallel-backend
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DEFAULT_MAX_LOGPROBS = 20                     # vLLM's --max-logprobs default (OpenAI's top_logprobs limit)
GENERATION_CONFIGS = ("auto", "vllm")         # or a folder holding a generation_config.json
CHAT_TEMPLATE_CONTENT_FORMATS = ("auto", "string", "openai")   # vLLM's --chat-template-content-format
CPU_KV_CACHE_BYTES = 1 << 30                  # the CPU's KV cache when no size is given


class ReasoningConfig(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's reasoning config: how a thinking model's reasoning starts and how it is ended when a
    request's thinking_token_budget runs out (``reasoning_end_str`` may hold a transition phrase
    before the end tag). The strings come from --reasoning-parser (its tags) or --reasoning-config;
    the token ids are the tokenizer's, filled in by the frontend before the engine starts."""
    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""
    start_token_ids: tuple[int, ...] = ()          # what opens the reasoning
    end_token_ids: tuple[int, ...] = ()            # what is forced when the budget is spent
    natural_end_token_ids: tuple[int, ...] = ()    # what closes the reasoning when the model ends it

    @property
    def resolved(self) -> bool:
        return bool(self.start_token_ids and self.end_token_ids)


MODALITIES = ("image", "video", "audio")     # vLLM's input modalities (each taken by some of Troupe's models)
DEFAULT_MM_LIMIT = 999                       # vLLM's limit of items of a modality a prompt may hold, unset


class MultiModalConfig(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's multimodal settings: how many items of each modality a prompt may hold, the
    checkpoint processor's keywords, and where media may be read from."""
    limit_per_prompt: dict[str, int] = {}     # vLLM's --limit-mm-per-prompt; unset: DEFAULT_MM_LIMIT
    mm_processor_kwargs: dict[str, Any] = {}  # vLLM's --mm-processor-kwargs: the processor's keywords
    allowed_local_media_path: str = ""        # vLLM's: file:// URLs are read from under it only ("": never)
    allowed_media_domains: tuple[str, ...] = ()   # vLLM's: the hosts http(s) URLs may name (): any
    processor_cache_gb: float = 4.0           # vLLM's --mm-processor-cache-gb: processed images kept (0: none)
    enable_mm_embeds: bool = False            # vLLM's: images may come as their embeddings (image_embeds)
    # vLLM's --media-io-kwargs: how media are read, per modality ({"video": {"num_frames": 16, "fps": 2}})
    media_io_kwargs: dict[str, dict[str, Any]] = {}

    def limit(self, modality: str) -> int:
        return self.limit_per_prompt.get(modality, DEFAULT_MM_LIMIT)


MEDIA_IO_KEYS = {"video": ("num_frames", "fps")}     # what Troupe's media readers take (vLLM's names)


def media_io_problem(value: Any) -> str | None:
    """Why media_io_kwargs (a request's or --media-io-kwargs) cannot be taken; None where it can:
    an object of modality -> object of keywords each reader takes, numbers."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        return "media_io_kwargs must be an object of modality -> object of keywords"
    for modality, kwargs in value.items():
        if modality not in MEDIA_IO_KEYS:
            if kwargs:
                return (f"media_io_kwargs for {modality!r} are not supported: Troupe reads images as they are and "
                        f"takes {MEDIA_IO_KEYS} for videos")
            continue
        unknown = sorted(set(kwargs) - set(MEDIA_IO_KEYS[modality]))
        if unknown:
            return f"media_io_kwargs' {modality} keywords {unknown} are not supported (Troupe's take {MEDIA_IO_KEYS[modality]})"
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in kwargs.values()):
            return f"media_io_kwargs' {modality} keywords must be numbers, got {kwargs}"
        if kwargs.get("num_frames") == 0:
            return "num_frames must be greater than 0 or -1"
    return None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    source: ModelSource                    # the checkpoint, resolved from the user's model name
    dtype: str = "auto"                    # "auto": bfloat16 on CUDA, float32 on the CPU
    quantization: str | None = None        # None (exact, or as the checkpoint's config.json says) | QUANTIZATIONS
    max_model_len: int = 0                 # 0: the model's own, capped by the KV cache
    seed: int = 0
    enforce_eager: bool = False            # CUDA: no graph capture, every step eager
    disable_cascade_attn: bool = False     # never attend a batch's shared prefix once for all (cascade)
    logprobs_mode: str = "raw_logprobs"    # what returned log-probs are (LOGPROBS_MODES)
    # vLLM's --return-sampling-mask: each sampled token's support (the ids the draw could pick,
    # after every processor and truncation) goes back with it; requests then sample with
    # temperature > 0 and top_k > 0 (vLLM's rule: the support stays bounded)
    return_sampling_mask: bool = False
    chat_template: str | None = None       # used instead of the checkpoint's
    chat_template_content_format: str = "auto"   # message content as a string or OpenAI's parts ("auto": as the template reads it)
    enable_sleep_mode: bool = False        # the engine may sleep (give back its memory) at levels 1 and 2
    enable_prompt_embeds: bool = False     # prompts may come as input embeddings (vLLM's prompt_embeds)
    skip_tokenizer_init: bool = False      # vLLM's: no tokenizer; prompts and answers as token ids only
    disable_sliding_window: bool = False   # vLLM's: every layer attends to all, the context capped at the window
    reasoning: ReasoningConfig | None = None   # a thinking model's reasoning tags (thinking_token_budget); None: none
    served_model_names: tuple[str, ...] = ()   # the names the API answers to; (): the source's name
    max_logprobs: int = DEFAULT_MAX_LOGPROBS   # most log-probs a request may ask for; -1: no bound
    generation_config: str = "auto"        # where request defaults come from (GENERATION_CONFIGS or a folder)
    sampling_defaults: SamplingDefaults = SamplingDefaults()   # what generation_config gave
    arch: ArchConfig | None = None         # the checkpoint's architecture, once resolved
    # speculative decoding with a draft model (draft_model, self_draft): its checkpoint, and its
    # architecture once resolved (its KV cache shares the target's blocks)
    draft_source: ModelSource | None = None
    draft_arch: ArchConfig | None = None
    # vLLM's --logits-processors: batch-level processors' classes ("module.Class" or "module:Class"),
    # applied by the worker beside those of troupe.logits_processors entry points
    logits_processors: tuple[str, ...] = ()
    # vLLM's --tokenizer: where the tokenizer is read from instead of the model's own checkpoint
    tokenizer_source: ModelSource | None = None
    # vLLM's --runner pooling: the model embeds prompts (actors/engine/pooling.py); None: it generates
    pooling: ModelPooling | None = None
    multimodal: MultiModalConfig = MultiModalConfig()   # image input (a model whose arch has image_token_id)

    @property
    def runner(self) -> str:
        """vLLM's runner type: "generate" or "pooling"."""
        return "generate" if self.pooling is None else "pooling"

    @property
    def tokenizer(self) -> ModelSource:
        """Where the tokenizer comes from: --tokenizer's, else the model's checkpoint."""
        return self.tokenizer_source or self.source

    @property
    def served_model_name(self) -> str:
        """The name responses and metrics report: the first served name."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give (vLLM's --served-model-name)."""
        return self.served_model_names or (self.source.served_name,)


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = 16
    # 0: CPU_KV_CACHE_BYTES on the CPU; on CUDA, what gpu_memory_utilization leaves once the
    # model is loaded (the worker measures it: ``EngineConfig.with_kv_cache_bytes``)
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.92   # CUDA: the share of the GPU's memory for weights, activations, KV
    cache_dtype: str = "auto"              # "auto": the model's dtype; "fp8" resolves to "fp8_e4m3"
    calculate_kv_scales: bool = False      # fp8: per-layer K/V scales from the first batch (else 1.0)
    enable_prefix_caching: bool = True
    num_blocks: int = 0                    # 0: as many as the KV cache's memory holds
    prefix_caching_hash_algo: str = "sha256"   # vLLM's block hashes (actors/kv_manager/block_hash.py)


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    budget_given: bool = True              # False: the default, raised to the context where prompts go whole
    # vLLM's: prompts longer than the step's budget are computed in chunks; False: each prompt is
    # scheduled whole (None: on, except for encoder-only models, resolved by ``EngineConfig.resolve``)
    enable_chunked_prefill: bool | None = None
    # vLLM's: the tokens the scheduler gives a step (None: max_num_batched_tokens, what the worker is
    # sized for) and the requests it lets run at once (None: max_num_seqs, what the runner is sized for)
    max_num_scheduled_tokens: int | None = None
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold: int = 0  # 0 = off (with max_num_partial_prefills > 1: 4% of max_model_len)
    # vLLM's: the threshold floored at a fair share of the token budget (the budget over the
    # requests waiting and running), so few requests are not cut into needlessly small chunks
    long_prefill_token_threshold_adaptive: bool = False
    max_num_partial_prefills: int = 1      # prompts that may be part-way computed at once
    max_long_partial_prefills: int = 1     # of those, prompts longer than long_prefill_token_threshold
    # a step with decodes in it takes prompt chunks only as large as keep its predicted time under
    # this (a cost model fitted on the steps run; stall-free batching); 0: off; "auto": the prompt
    # chunk beside decodes may cost AUTO_CHUNK_COST times the fitted fixed cost of a step, or
    # AUTO_MIN_CHUNK_TOKENS tokens' cost where that is more (actors/scheduler/cost_model.py)
    max_step_latency_ms: float | Literal["auto"] = 0.0
    policy: str = "fcfs"                   # "fcfs" | "priority"
    watermark: float = 0.01                # fraction of blocks kept free when admitting
    # vLLM's: a waiting request is admitted only when its whole sequence fits in the free blocks
    # (beside the watermark), though its first chunk alone gets blocks: chunked prefill admits
    # no more prompts than the cache can finish, instead of preempting them later
    scheduler_reserve_full_isl: bool = True
    # None: on where the worker runs in a process of its own (the engine plans step N+1 while it
    # computes step N), off in one event loop with it (nothing to overlap)
    async_scheduling: bool | None = None
    max_waiting_requests: int = 0          # requests queued before new ones get 503; 0: no bound
    max_waiting_tokens: int = 0            # the same for their prompt tokens
    max_num_queued_reqs: int | None = None  # vLLM's: requests in flight (waiting or running) before 503; None: no bound
    # every layer holds every block (one KV cache group), as without vLLM's hybrid KV cache
    # manager; else sliding-window layers hold a window's worth of blocks in groups of their own
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's: a step never ends inside an image's positions (computed in one step, or not yet);
    # on for a prefix LM, whose image positions attend to each other
    disable_chunked_mm_input: bool = False
    # vLLM's: the image embeddings the encoder makes in one step, and those the workers' encoder
    # cache keeps (None: max_num_batched_tokens, and the encoder budget); an image larger than
    # either still goes, alone
    max_num_batched_encoder_embeds: int | None = None
    encoder_cache_size: int | None = None

    @property
    def encoder_budget(self) -> int:
        """The embeddings the encoder may make in one step."""
        return self.max_num_batched_encoder_embeds or self.max_num_batched_tokens

    @property
    def encoder_cache_embeds(self) -> int:
        """The embeddings the workers' encoder cache keeps."""
        return self.encoder_cache_size or self.encoder_budget

    def check_encoder_cache(self) -> None:
        if self.encoder_cache_embeds < self.encoder_budget:
            raise ValueError(f"encoder_cache_size ({self.encoder_cache_embeds}) must be no smaller than "
                             f"max_num_batched_encoder_embeds ({self.encoder_budget})")

    @property
    def token_budget(self) -> int:
        """The tokens one step may schedule."""
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens

    @property
    def active_seqs(self) -> int:
        """The requests that may run (hold KV and be scheduled) at once."""
        return self.max_num_active_seqs or self.max_num_seqs

    @property
    def chunks_prompts(self) -> bool:
        """Whether a prompt may be computed over several steps."""
        return self.enable_chunked_prefill is not False

    @property
    def stall_free(self) -> bool:
        """Whether prompt chunks beside decodes are sized by the step-cost model."""
        return self.max_step_latency_ms == "auto" or self.max_step_latency_ms > 0


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    multiprocess: bool = True              # engine core and worker in processes of their own
    # --data-parallel-size: engine cores (each its scheduler, KV cache and worker) behind one
    # frontend; data_parallel_rank: which one this config is of (set by the frontend per engine)
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # --data-parallel-size-local: the engine cores this machine runs (None: all of them; 0: none,
    # the server only); the others (ranks past them) run on other machines, started there with
    # --headless, and join the frontend at --data-parallel-address:--data-parallel-rpc-port
    # (actors/frontend/headless.py)
    data_parallel_size_local: int | None = None
    # --data-parallel-start-rank: the first rank this machine runs (a headless one: past 0)
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # vLLM's external and hybrid load balancing: this server serves only its own ranks (the rank
    # --data-parallel-rank; --data-parallel-size-local from --data-parallel-start-rank), the others
    # served by servers of their own behind a balancer of the user's (the ranks share no collectives)
    data_parallel_external_lb: bool = False
    data_parallel_hybrid_lb: bool = False
    # --tensor-parallel-size: each engine core's model split over this many worker processes
    # (attention heads and MLP columns; gloo on the CPU, NCCL on GPUs)
    tensor_parallel_size: int = 1
    # --enable-expert-parallel: MoE layers' experts partitioned over the tensor-parallel ranks
    # (expert parallelism of size tensor_parallel_size) instead of each expert split
    enable_expert_parallel: bool = False
    # --pipeline-parallel-size: each engine core's decoder layers split into this many stages, a
    # worker process per stage (and per tensor-parallel rank), several steps in flight at once
    pipeline_parallel_size: int = 1
    # --distributed-executor-backend: "mp", the worker processes started by the engine core on its
    # machine; "ray", one Ray actor per rank on a Ray cluster (actors/runtime/ray_nodes.py); "uni"
    # asks for one worker, which is what mp runs then
    distributed_executor_backend: str = "mp"
    # --data-parallel-backend: "mp", the engine-core processes started by the frontend on its
    # machine; "ray", one Ray actor per engine core on a Ray cluster (each starts its workers
    # where it runs, or places them on the cluster with distributed_executor_backend "ray")
    data_parallel_backend: str = "mp"
    max_restarts: int = 3                  # a worker or engine process dying more often than this ...
    restart_window_s: float = 120.0        # ... within this window stops the server
    # --worker-extension-cls: a class (module.Name) whose methods every worker gains, called by
    # name through collective_rpc (vLLM's, for RL frameworks' weight-sync methods)
    worker_extension_cls: str = ""
    # --nnodes, --node-rank, --master-addr, --master-port: an engine core's ranks split evenly over
    # machines (mp backend, rank order); node rank 0 runs the server and engine core, which listens
    # at master_addr:master_port for the others, started there with --headless
    # (actors/engine/multinode.py)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # the digest of the configuration node rank 0 was started with (compute_hash, which the other
    # machines' must equal), taken by its engine core at its first start and kept by its restarts,
    # whose configuration is the resolved one
    nodes_digest: str = ""


    @property
    def world_size(self) -> int:
        """Worker processes per engine core: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Worker processes of an engine core on each machine (--nnodes)."""
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        """The worker ranks machine ``node_rank`` runs (--nnodes): a contiguous share, in rank order."""
        return range(node_rank * self.local_world_size, (node_rank + 1) * self.local_world_size)

    @property
    def local_ranks(self) -> range:
        """The data-parallel ranks whose engine cores run on this machine."""
        local = self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + local)

    @property
    def remote_ranks(self) -> list[int]:
        """The data-parallel ranks whose engine cores run on other machines for this server
        (headless servers); none with external or hybrid load balancing."""
        if self.data_parallel_external_lb or self.data_parallel_hybrid_lb:
            return []
        return [r for r in range(self.data_parallel_size) if r not in self.local_ranks]

    @property
    def served_ranks(self) -> range:
        """The data-parallel ranks this server sends requests to: every rank, or with external
        or hybrid load balancing its own."""
        if self.data_parallel_external_lb or self.data_parallel_hybrid_lb:
            return self.local_ranks
        return range(self.data_parallel_size)


class DeviceConfig(msgspec.Struct, frozen=True, kw_only=True):
    device: str = "auto"                   # "auto": CUDA when torch sees a device, else the CPU
    num_threads: int = 0                   # worker compute threads; 0: all the worker's cores


class ObservabilityConfig(msgspec.Struct, frozen=True, kw_only=True):
    trace: bool = True                     # every process records a span per handled message
    flight_recorder_dir: str = ""          # where a dead process's last seconds go ("": a temp dir)
    log_stats: bool = True                 # the periodic statistics lines (actors/frontend/stat_logger.py)
    kv_cache_metrics: bool = False         # KV blocks' residency sampled for /metrics (--kv-cache-metrics)
    kv_cache_metrics_sample: float = 0.01  # the fraction of blocks sampled
    # vLLM's --enable-mfu-metrics: each step's estimated FLOPs and bytes per device on /metrics and
    # in the stats line (actors/scheduler/perf.py)
    enable_mfu_metrics: bool = False
    otlp_traces_endpoint: str | None = None  # vLLM's: each request's span exported over OTLP here (None: off)
    # vLLM's --collect-detailed-traces: "model" (each request's time in the model's forward passes)
    # and/or "worker" (in the worker's whole steps) added to its span; (): neither
    collect_detailed_traces: tuple[str, ...] = ()
    # vLLM's --per-request-spec-decode-metrics: each request's draft acceptance in its answer's
    # metrics ("summary": counts and histogram; "detailed": also each verify step's); "none": off
    per_request_spec_decode_metrics: str = "none"
    # vLLM's --custom-histogram-buckets: (bucket family, bounds) pairs replacing the defaults
    custom_histogram_buckets: tuple[tuple[str, tuple[float, ...]], ...] = ()

    @property
    def collect_model_forward_time(self) -> bool:
        return bool({"model", "all"} & set(self.collect_detailed_traces))

    @property
    def collect_model_execute_time(self) -> bool:
        return bool({"worker", "all"} & set(self.collect_detailed_traces))


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: DeviceConfig = DeviceConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    # --speculative-config: draft tokens verified by the target each step (None: off)
    speculative: SpeculativeConfig | None = None
    # --compilation-config / -O: eager, custom ops, torch.compile (actors/engine/compilation.py)
    compilation: CompilationConfig = CompilationConfig()
    lora: LoRAConfig | None = None         # --enable-lora: adapters served beside the base model (None: off)
    # --kv-transfer-config: a KV connector moving prompts' KV between instances (None: off)
    kv_transfer: KVTransferConfig | None = None
    # --kv-events-config: the prefix cache's changes published for KV-aware routers (None: off)
    kv_events: KVEventsConfig | None = None
    # --structured-outputs-config: xgrammar's options (actors/grammar/config.py)
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # --profiler-config: what /start_profile records (actors/engine/profiler.py)
    profiler: ProfilerConfig = ProfilerConfig()
    # --watermark-config: sampled tokens carry a keyed watermark (models/watermark.py; None: off)
    watermark: WatermarkConfig | None = None
    # --weight-transfer-config: a trainer's process group pushes new weights (None: off)
    weight_transfer: WeightTransferConfig | None = None

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def resolved(self) -> bool:
        return self.model.arch is not None

    def replace(self, **parts: msgspec.Struct) -> EngineConfig:
        return msgspec.structs.replace(self, **parts)

    def resolve(self, *, cuda_available: bool, cpu_count: int, arch: ArchConfig,
                draft_arch: ArchConfig | None = None) -> EngineConfig:
        """Every "auto" decided, given the worker's platform (whether its torch sees a CUDA
        device, how many cores it has) and the checkpoint's architecture (and the draft
        model's, for speculative decoding with one)."""
        device = _resolve_device(self.device.device, cuda_available)
        dtype = self.model.dtype if self.model.dtype != "auto" else (
            "bfloat16" if device == "cuda" else "float32")
        spec = self.speculative
        for q in (self.model.quantization, spec.quantization if spec is not None else None):
            if q in CPU_ONLY_QUANTIZATIONS and device == "cuda":
                raise ValueError(f"quantization {q!r} runs on the CPU only; use device 'cpu'")
        if arch.num_experts and self.lora is not None:
            raise ValueError(f"LoRA adapters on a mixture-of-experts model ({arch.architecture}) are not supported "
                             "yet: its experts would run without them")
        if self.model.draft_source is not None:
            draft_arch = draft_arch or self.model.draft_arch or (arch if spec.method == "self_draft" else None)
            if draft_arch is None:
                raise ValueError("resolving a config with a draft model needs the draft's architecture")
            if draft_arch.vocab_size != arch.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_arch.vocab_size} tokens) differs from the "
                                 f"target's ({arch.vocab_size}): a draft model must share the target's tokenizer")
        cache_dtype = {"auto": dtype, "fp8": "fp8_e4m3"}.get(self.cache.cache_dtype, self.cache.cache_dtype)
        specs = model_kv_cache_specs(rank_arch(arch, self.parallel.tensor_parallel_size), self.cache.block_size,
                                     DTYPE_BYTES[cache_dtype])
        groups = kv_cache_groups(specs, hybrid=not self.scheduler.disable_hybrid_kv_cache_manager)
        if self.model.draft_source is not None:
            tp = self.parallel.tensor_parallel_size
            if tp > 1 and draft_arch.num_kv_heads != arch.num_kv_heads:
                raise ValueError(f"with tensor parallelism the draft model is split over the ranks as the target is, "
                                 f"and its KV heads share the target's blocks: it needs the target's "
                                 f"{arch.num_kv_heads} KV heads, not {draft_arch.num_kv_heads}")
            groups = with_draft_layers(groups, specs, model_kv_cache_specs(
                rank_arch(draft_arch, tp), self.cache.block_size, DTYPE_BYTES[cache_dtype]))
        kv_bytes = self.cache.kv_cache_memory_bytes
        if device == "cpu" and vllm_env.cpu_kv_cache_bytes():      # vLLM's legacy setting wins, as there
            kv_bytes = vllm_env.cpu_kv_cache_bytes()
        if self.model.max_model_len > arch.max_model_len and not vllm_env.allow_long_max_model_len():
            raise ValueError(f"User-specified max_model_len ({self.model.max_model_len}) is greater than the derived "
                             f"max_model_len ({arch.max_model_len}, the model's context length). To allow overriding "
                             "this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (with caution: positions "
                             "past the model's training give it inputs it never saw)")
        max_model_len = self.model.max_model_len or arch.default_max_model_len
        if arch.architecture in TRANSFORMERS_BACKENDS:
            self._check_transformers_backend(arch)
        if arch.mamba is not None:
            self._check_state_space(arch)
            fitting = self._fitting_seqs(kv_bytes or (CPU_KV_CACHE_BYTES if device != "cuda" else 0), arch, dtype)
            if fitting < self.scheduler.max_num_seqs:
                log.warning("%s's recurrent states take %.1f MiB a request: max_num_seqs lowered from %d to %d, "
                            "the requests whose states the KV cache's memory holds", arch.architecture,
                            arch.mamba_state_bytes(DTYPE_BYTES[dtype]) / 2**20, self.scheduler.max_num_seqs, fitting)
                lowered = self.replace(scheduler=msgspec.structs.replace(self.scheduler, max_num_seqs=fitting))
                return lowered.resolve(cuda_available=cuda_available, cpu_count=cpu_count, arch=arch,
                                       draft_arch=draft_arch)
        if self.cache.num_blocks:
            num_blocks = self.cache.num_blocks
        elif kv_bytes or device != "cuda":
            num_blocks = self._blocks_in(kv_bytes or CPU_KV_CACHE_BYTES, specs, groups, arch, max_model_len, dtype)
        else:       # sized by the worker once the weights are on the GPU (with_kv_cache_bytes)
            num_blocks = 0
        if arch.encoder_only and device == "cpu" and not self.cache.num_blocks:
            # its layers never read or write the cache (whose pages are then never taken from the
            # system): blocks only count the tokens in flight, so there are enough for a step's
            # budget beside the longest prompt, whatever the cache's memory would hold
            budget = max(self.scheduler.max_num_batched_tokens, max_model_len)
            num_blocks = max(num_blocks, len(groups) * -(-(budget + max_model_len) // self.cache.block_size) + 1)
        elif num_blocks:
            max_model_len = self._fitting_len(groups, num_blocks, max_model_len)
        sched = self.scheduler
        if sched.async_scheduling is None:     # a step's drafts come from the previous step's output
            # (pipeline parallelism keeps steps in flight its own way: a batch queue)
            sched = msgspec.structs.replace(sched, async_scheduling=self.parallel.multiprocess
                                            and self.speculative is None and self.model.pooling is None
                                            and self.parallel.pipeline_parallel_size == 1)
        sched, cache = self._whole_prompts(sched, arch, max_model_len)
        sched.check_encoder_cache()
        if arch.mm_prefix_lm and not sched.disable_chunked_mm_input:    # an image computed in one step
            sched = msgspec.structs.replace(sched, disable_chunked_mm_input=True)
        if sched.max_num_partial_prefills > 1 and not sched.long_prefill_token_threshold and sched.chunks_prompts:
            sched = msgspec.structs.replace(sched, long_prefill_token_threshold=max(max_model_len * 4 // 100, 1))
        return self.replace(
            scheduler=sched,
            model=msgspec.structs.replace(self.model, dtype=dtype, max_model_len=max_model_len, arch=arch,
                                          draft_arch=draft_arch if self.model.draft_source is not None else None),
            cache=msgspec.structs.replace(cache, cache_dtype=cache_dtype, num_blocks=num_blocks),
            device=msgspec.structs.replace(self.device, device=device, num_threads=self.device.num_threads or max(
                1, (cpu_count - vllm_env.reserved_cpus()) // (self.parallel.local_world_size
                                                             * max(len(self.parallel.local_ranks), 1)))))


    def _whole_prompts(self, sched: SchedulerConfig, arch: ArchConfig, max_model_len: int
                       ) -> tuple[SchedulerConfig, CacheConfig]:
        """Chunked prefill and prefix caching decided (vLLM's rules): an encoder-only model
        attends over each prompt whole, so its prompts are never chunked nor read from the prefix
        cache; without chunking, a step's budget holds the longest prompt (the default raised to
        the context length; one given smaller is refused, in vLLM's words)."""
        cache = self.cache
        if arch.encoder_only:
            if sched.enable_chunked_prefill:
                raise ValueError(encoder_chunking_refused(arch.architecture))
            if self.parallel.pipeline_parallel_size > 1 and arch.architecture in ENCODER_ONLY_ARCHITECTURES:
                raise ValueError(f"{arch.architecture} is an encoder-only model: its layers run in one pipeline "
                                 "stage; drop --pipeline-parallel-size (--tensor-parallel-size splits it)")
            sched = msgspec.structs.replace(sched, enable_chunked_prefill=False)
            if cache.enable_prefix_caching:
                log.info("%s attends over whole prompts: chunked prefill and prefix caching are off",
                         arch.architecture)
                cache = msgspec.structs.replace(cache, enable_prefix_caching=False)
        elif sched.enable_chunked_prefill is None:
            sched = msgspec.structs.replace(sched, enable_chunked_prefill=True)
        if arch.mamba is not None and cache.enable_prefix_caching:
            # a prefix's KV blocks would not give back the state its tokens left (vLLM's default too)
            log.info("%s has state-space layers: prefix caching is off", arch.architecture)
            cache = msgspec.structs.replace(cache, enable_prefix_caching=False)
        if sched.chunks_prompts:
            return sched, cache
        if sched.stall_free:
            raise ValueError("--max-step-latency-ms sizes prompt chunks beside decodes: it needs chunked prefill "
                             "(drop --no-enable-chunked-prefill)")
        if sched.max_num_batched_tokens < max_model_len:
            if sched.budget_given:
                raise ValueError(f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than "
                                 f"max_model_len ({max_model_len}). This effectively limits the maximum sequence "
                                 "length to max_num_batched_tokens and makes vLLM reject longer sequences. Please "
                                 "increase max_num_batched_tokens or decrease max_model_len.")
            sched = msgspec.structs.replace(sched, max_num_batched_tokens=max_model_len)
        if sched.max_num_scheduled_tokens is not None and sched.max_num_scheduled_tokens < max_model_len:
            raise ValueError(f"max_num_scheduled_tokens ({sched.max_num_scheduled_tokens}) is smaller than "
                             f"max_model_len ({max_model_len}): without chunked prefill a step must hold a whole "
                             "prompt")
        return sched, cache

    def compute_hash(self) -> str:
        """A digest of what decides the model's computation (vLLM's ``compute_hash``): the
        checkpoint (as the model was named: vLLM hashes the model it is given, not where an
        installation keeps it), its dtype and quantization, the context length, the KV cache's
        dtype and block size, speculative decoding, compilation, LoRA and the parallel layout;
        not the names it is served under, nor observability, nor where it listens. The same
        configuration on another start, or another machine, gives the same digest."""
        m, p = self.model, self.parallel
        factors = {"source": [m.source.kind, m.source.served_name, m.source.hf_overrides, m.source.model_impl,
                              *(["language_model_only"] if m.source.language_model_only else [])],
                   "dtype": m.dtype, "quantization": m.quantization,
                   "max_model_len": m.max_model_len, "architecture": m.arch.architecture if m.arch else None,
                   "draft": m.draft_source.served_name if m.draft_source else None,
                   "cache": [self.cache.cache_dtype, self.cache.block_size], "device": self.device.device,
                   "speculative": self.speculative, "compilation": self.compilation, "lora": self.lora,
                   "parallel": [p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size,
                                p.enable_expert_parallel, p.nnodes]}
        return hashlib.sha256(msgspec.json.encode(factors)).hexdigest()

    @property
    def kv_cache_sized(self) -> bool:
        """False for a config resolved for CUDA whose KV cache is to take what
        gpu_memory_utilization leaves: the worker measures it (``with_kv_cache_bytes``)."""
        return self.cache.num_blocks > 0

    def with_kv_cache_bytes(self, kv_bytes: int) -> EngineConfig:
        """The resolved config with a KV cache of ``kv_bytes`` (as many blocks as they hold) and
        the context length capped to what one request can hold in it."""
        if not self.resolved:
            raise ValueError("with_kv_cache_bytes needs a resolved config")
        groups = self.kv_cache_groups()
        num_blocks = self._blocks_in(kv_bytes, self.kv_cache_specs(), groups, self.model.arch,
                                     self.model.max_model_len, self.model.dtype)
        return self.replace(
            model=msgspec.structs.replace(self.model, max_model_len=self._fitting_len(
                groups, num_blocks, self.model.max_model_len)),
            cache=msgspec.structs.replace(self.cache, kv_cache_memory_bytes=kv_bytes, num_blocks=num_blocks))

    def _blocks_in(self, kv_bytes: int, specs: list[KVCacheSpec], groups: tuple[KVCacheGroupSpec, ...],
                   arch: ArchConfig, max_model_len: int, dtype: str) -> int:
        """The KV blocks ``kv_bytes`` hold once the state-space layers' states (one per request the
        worker may run, vLLM counts them in the cache's memory too) are set aside. A model of
        state-space layers only: blocks that take no memory, enough for every request at its
        longest."""
        states = self.scheduler.max_num_seqs * arch.mamba_state_bytes(DTYPE_BYTES[dtype])
        if not arch.attention_layers:
            if states > kv_bytes:
                raise ValueError(self._states_too_large(arch, states, kv_bytes))
            return self.scheduler.max_num_seqs * -(-max_model_len // self.cache.block_size) + 1
        if states and kv_bytes - states < bytes_per_block(self._largest_stage(groups, arch.num_layers)):
            raise ValueError(self._states_too_large(arch, states, kv_bytes))
        return max(num_blocks_for(specs, kv_bytes - states, self._largest_stage(groups, arch.num_layers)), 2)

    def _fitting_seqs(self, kv_bytes: int, arch: ArchConfig, dtype: str) -> int:
        """The running requests whose recurrent states fit: in all of ``kv_bytes`` for a model of
        state-space layers only, in half of it beside attention layers' KV blocks (0 bytes:
        unknown yet, max_num_seqs stands); at least 1 (a start that cannot fit one says so)."""
        per_request = arch.mamba_state_bytes(DTYPE_BYTES[dtype])
        if not kv_bytes or not per_request:
            return self.scheduler.max_num_seqs
        share = kv_bytes if not arch.attention_layers else kv_bytes // 2
        return max(1, min(self.scheduler.max_num_seqs, share // per_request))

    def _states_too_large(self, arch: ArchConfig, states: int, kv_bytes: int) -> str:
        return (f"{arch.architecture}'s recurrent states for {self.scheduler.max_num_seqs} sequences take "
                f"{states / 2**20:.1f} MiB, more than the KV cache's {kv_bytes / 2**20:.1f} MiB leaves them: lower "
                "--max-num-seqs or raise --kv-cache-memory-bytes")

    def _check_state_space(self, arch: ArchConfig) -> None:
        """What a model with state-space layers cannot be served with (yet), refused by name: each
        request's state lives in one worker's slot, advances with every token it computes and
        cannot be rolled back or shipped."""
        name = arch.architecture
        refused = [("--speculative-config", self.speculative is not None,
                    "rejected drafts would have advanced its recurrent state"),
                   ("--tensor-parallel-size", self.parallel.tensor_parallel_size > 1, "its mixers run unsplit"),
                   ("--pipeline-parallel-size", self.parallel.pipeline_parallel_size > 1, "its layers run in one stage"),
                   ("--kv-transfer-config", self.kv_transfer is not None, "its recurrent state is not KV blocks"),
                   ("--enable-lora", self.lora is not None, "adapters on its mixers are not supported")]
        for flag, used, why in refused:
            if used:
                raise ValueError(f"{name} has state-space (Mamba) layers: {flag} is not supported with it ({why})")

    def _check_transformers_backend(self, arch: ArchConfig) -> None:
        """What a model served by transformers' modeling code cannot be served with (yet), refused
        by name (tensor parallelism splits it as its transformers config plans, or refuses at load)."""
        spec = self.speculative
        images = arch.image_token_id is not None
        refused = [("--enable-expert-parallel", self.parallel.enable_expert_parallel,
                    "its experts are transformers' own modules"),
                   ("--enable-lora with --pipeline-parallel-size", self.lora is not None
                    and self.parallel.pipeline_parallel_size > 1, "its adapters are read on one stage"),
                   ("--speculative-config", spec is not None and spec.method == "self_draft",
                    "a self draft quantizes Troupe's own layers"),
                   ("--speculative-config with a draft model on a model that takes images", images and spec is not None
                    and spec.method != "ngram", "the draft model reads tokens, not images; give --language-model-only "
                    "or ngram drafts")]
        for flag, used, why in refused:
            if used:
                raise ValueError(f"the transformers backend (--model-impl transformers): {flag} is not supported "
                                 f"with it ({why})")

    def kv_cache_specs(self, num_kv_heads: int | None = None) -> list[KVCacheSpec]:
        """One spec per attention layer of a resolved config's model, then of its draft model.
        With tensor parallelism, a rank's layers hold its KV heads only: ``num_kv_heads`` (a
        worker's own), or the most any rank holds (what a block is sized for)."""
        if not self.resolved:
            raise ValueError("the KV cache specs need a resolved config")
        bs, dtype_bytes = self.cache.block_size, DTYPE_BYTES[self.cache.cache_dtype]
        arch = rank_arch(self.model.arch, self.parallel.tensor_parallel_size, num_kv_heads)
        specs = model_kv_cache_specs(arch, bs, dtype_bytes)
        if self.model.draft_arch is not None:          # split as the target (the same KV heads)
            specs += model_kv_cache_specs(rank_arch(self.model.draft_arch, self.parallel.tensor_parallel_size,
                                                    num_kv_heads), bs, dtype_bytes)
        return specs

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The KV cache groups of a resolved config's model and draft model (kv_cache_spec.py)."""
        specs = self.kv_cache_specs()
        L = self.model.arch.num_layers
        groups = kv_cache_groups(specs[:L], hybrid=not self.scheduler.disable_hybrid_kv_cache_manager)
        return groups if len(specs) == L else with_draft_layers(groups, specs[:L], specs[L:])

    def _largest_stage(self, groups: tuple[KVCacheGroupSpec, ...], num_layers: int) -> tuple[KVCacheGroupSpec, ...]:
        """The groups as the pipeline stage with the most cache tensors holds them (``groups``
        without pipeline parallelism): a block id takes its pages there, so its memory sizes the
        blocks of every stage."""
        pp = self.parallel.pipeline_parallel_size
        if pp == 1:
            return groups
        from models.pp_layout import pp_layers
        total = max((i + 1 for g in groups for i in g.layer_ids), default=num_layers)   # a draft's layers after
        stages = [pp_layers(num_layers, pp, r) for r in range(pp)]
        stages[-1] = (stages[-1][0], total)            # the last stage holds the draft model's layers too
        return max((stage_groups(groups, *stage) for stage in stages), key=group_size)

    def _fitting_len(self, groups: tuple[KVCacheGroupSpec, ...], num_blocks: int, limit: int) -> int:
        """``limit`` capped to the longest request that fits alone in the cache (block 0 is the
        null block): every block of it in full-attention groups, a window and a step's tokens
        in sliding-window ones."""
        n = max_tokens_per_request(groups, num_blocks, self.scheduler.max_num_batched_tokens, limit)
        if n < 1:
            raise ValueError(f"a KV cache of {num_blocks} blocks cannot hold one token in each of its "
                             f"{len(groups)} KV cache groups; give it more memory or blocks")
        return n


def rank_arch(arch: ArchConfig, tp: int, num_kv_heads: int | None = None) -> ArchConfig:
    """The architecture as one tensor-parallel rank's KV cache sees it: ``num_kv_heads`` of its
    own, or the most any of ``tp`` ranks holds."""
    if tp == 1 and num_kv_heads is None:
        return arch
    from models.tp_layout import max_local_kv_heads
    local = num_kv_heads or max_local_kv_heads(arch.num_heads, arch.num_kv_heads, tp)
    return dataclasses.replace(arch, num_kv_heads=local)


def kv_scales_note(cache: CacheConfig) -> str:
    """How an fp8 cache's K/V scales are set, for the startup log ("" for other dtypes)."""
    if not cache.cache_dtype.startswith("fp8"):
        return ""
    return ", K/V scales from the first batch" if cache.calculate_kv_scales else ", K/V scales 1.0"


def _resolve_device(name: str, cuda_available: bool) -> str:
    if name == "cuda" and not cuda_available:
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device; "
                         "use device 'cpu' or 'auto'")
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    return name


GGUF_FLOAT_WEIGHTS_ENV = "TROUPE_GGUF_FLOAT_WEIGHTS"   # 1: exact mode holds float32 copies of a GGUF file's blocks


def exact_from_gguf_blocks(path: str, quantization: str | None, dtype: str, device: str, level: int,
                           weight_transfer: bool = False) -> bool:
    """Whether exact mode runs a GGUF file's Q4_1 / Q8_0 linear weights from their blocks: a .gguf
    model, no quantization, float32 weights and activations on the CPU, the native panel kernels
    (compilation level 1), ``TROUPE_GGUF_FLOAT_WEIGHTS`` unset and no --weight-transfer-config (a
    trainer's float weights replace float32 copies, not blocks). The kernel sums each output's
    products in input order whether its panel was dequantized from blocks or held as float32, and
    dequantizes exactly as the loader does, so the results are those of float32 copies bit for bit
    (the worker, actors/worker/worker.py, also needs the native kernels built; the step estimate
    of actors/scheduler/perf.py counts the blocks' bytes)."""
    return (quantization is None and path.endswith(".gguf") and dtype == "float32" and device == "cpu"
            and level == 1 and not weight_transfer
            and os.environ.get(GGUF_FLOAT_WEIGHTS_ENV, "").strip().lower() not in ("1", "true", "yes"))


def encoder_chunking_refused(architecture: str) -> str:
    return (f"{architecture} is an encoder-only model (bidirectional attention over the whole prompt): its prompts "
            "cannot be computed in chunks; drop --enable-chunked-prefill")


def _check_pooling(cfg: EngineConfig) -> None:
    """A pooling model (--runner pooling) computes each prompt once and samples nothing: the
    options that shape generation have nothing to act on, and are refused by name."""
    refused = [name for name, on in (
        ("--speculative-config", cfg.speculative is not None),
        ("--async-scheduling", cfg.scheduler.async_scheduling is True),
        ("--watermark-config", cfg.watermark is not None), ("--kv-transfer-config", cfg.kv_transfer is not None),
        ("--return-sampling-mask", cfg.model.return_sampling_mask)) if on]
    if refused:
        raise ValueError(f"--runner pooling (an embedding model) does not take {', '.join(refused)}")


def check_config(cfg: EngineConfig) -> None:
    """Refuse values no component could serve, naming the field and what is accepted."""
    _one_of("device", cfg.device.device, DEVICES)
    _one_of("dtype", cfg.model.dtype, DTYPES)
    _one_of("kv_cache_dtype", cfg.cache.cache_dtype, KV_CACHE_DTYPES)
    _one_of("prefix_caching_hash_algo", cfg.cache.prefix_caching_hash_algo, HASH_ALGOS)
    _one_of("scheduling_policy", cfg.scheduler.policy, SCHEDULING_POLICIES)
    _one_of("logprobs_mode", cfg.model.logprobs_mode, LOGPROBS_MODES)
    if cfg.model.quantization is not None:
        _one_of("quantization", cfg.model.quantization, QUANTIZATIONS)
    for name, value in (("block_size", cfg.cache.block_size),
                        ("max_num_seqs", cfg.scheduler.max_num_seqs),
                        ("max_num_batched_tokens", cfg.scheduler.max_num_batched_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if cfg.cache.kv_cache_memory_bytes < 0:
        raise ValueError(f"the KV cache's memory must be positive (0: the default), got "
                         f"{cfg.cache.kv_cache_memory_bytes} bytes")
    if not 0.0 < cfg.cache.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cfg.cache.gpu_memory_utilization}")
    if cfg.cache.num_blocks < 0:
        raise ValueError(f"num_blocks must be at least 0 (0: as many as the KV cache's memory holds), "
                         f"got {cfg.cache.num_blocks}")
    if cfg.model.return_sampling_mask and cfg.speculative is not None:
        raise ValueError(f"--return-sampling-mask with speculative decoding ({cfg.speculative.method}) is not "
                         "supported: a verified step's tokens come from the rejection sampler, whose supports "
                         "are not recorded; serve without --speculative-config")
    if cfg.watermark is not None and cfg.speculative is not None:
        raise ValueError(f"--watermark-config with speculative decoding ({cfg.speculative.method}) is not supported: "
                         "Troupe watermarks the tokens its sampler draws, and its drafts are verified by rejection "
                         "sampling; serve watermarked text without --speculative-config")
    if cfg.model.pooling is not None:
        _check_pooling(cfg)
    if cfg.model.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be at least 0 (-1: no bound), got {cfg.model.max_logprobs}")
    if any(not name for name in cfg.model.served_model_names):
        raise ValueError("served model names must not be empty")
    for name, value in (("max_waiting_requests", cfg.scheduler.max_waiting_requests),
                        ("max_waiting_tokens", cfg.scheduler.max_waiting_tokens)):
        if value < 0:
            raise ValueError(f"{name} must be at least 0 (0: no bound), got {value}")
    if cfg.scheduler.max_num_queued_reqs is not None and cfg.scheduler.max_num_queued_reqs < 0:
        raise ValueError(f"max_num_queued_reqs must be at least 0, got {cfg.scheduler.max_num_queued_reqs}")
    for name, value in (("max_num_partial_prefills", cfg.scheduler.max_num_partial_prefills),
                        ("max_long_partial_prefills", cfg.scheduler.max_long_partial_prefills)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if cfg.scheduler.max_long_partial_prefills > cfg.scheduler.max_num_partial_prefills:
        raise ValueError(f"max_long_partial_prefills ({cfg.scheduler.max_long_partial_prefills}) must not exceed "
                         f"max_num_partial_prefills ({cfg.scheduler.max_num_partial_prefills})")
    if cfg.scheduler.long_prefill_token_threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be at least 0 (0: off), got "
                         f"{cfg.scheduler.long_prefill_token_threshold}")
    latency = cfg.scheduler.max_step_latency_ms
    if latency != "auto" and (not isinstance(latency, (int, float)) or latency < 0):
        raise ValueError(f"max_step_latency_ms must be at least 0 (0: off) or 'auto', got "
                         f"{cfg.scheduler.max_step_latency_ms}")
    if not 0.0 <= cfg.scheduler.watermark < 1.0:
        raise ValueError(f"watermark must be in [0, 1), got {cfg.scheduler.watermark}")
    spec = cfg.speculative
    if (spec is not None and spec.method != "ngram") != (cfg.model.draft_source is not None):
        raise ValueError("a draft model's checkpoint (model.draft_source) goes with speculative method "
                         "draft_model or self_draft, and they need one")
    if spec is not None:
        if spec.method == "self_draft" and spec.quantization == cfg.model.quantization:
            raise ValueError(f"self_draft drafts with a cheaper copy of the target's weights, but the target "
                             f"already runs quantization {spec.quantization!r}; run the target exact (no "
                             "--quantization) or draft with another quantization")
        if cfg.scheduler.async_scheduling:
            raise ValueError("async scheduling and speculative decoding cannot be combined (a step's draft "
                             "tokens come from the previous step's output); leave async_scheduling unset "
                             "or turn it off")
    dp = cfg.parallel
    if dp.data_parallel_size < 1 or not 0 <= dp.data_parallel_rank < dp.data_parallel_size:
        raise ValueError(f"data_parallel_size must be at least 1 and data_parallel_rank in [0, size), got "
                         f"{dp.data_parallel_size} and {dp.data_parallel_rank}")
    _check_data_parallel_nodes(dp)
    _check_nodes(dp)
    if dp.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {dp.tensor_parallel_size}")
    if dp.tensor_parallel_size > 1:
        if not dp.multiprocess:
            raise ValueError("tensor parallelism runs each rank in a worker process of its own: it needs the "
                             "multiprocess layout (a server, or LLM(multiprocess=True))")
    if dp.pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {dp.pipeline_parallel_size}")
    if dp.pipeline_parallel_size > 1:
        _check_pipeline_parallel(cfg)
    _check_executor_backend(cfg)
    if dp.data_parallel_size > 1 and not dp.multiprocess:
        raise ValueError("data parallelism runs each engine core in a process of its own: it needs the "
                         "multiprocess layout (a server, or LLM(multiprocess=True))")
    if cfg.model.max_model_len < 0:
        raise ValueError(f"max_model_len must be at least 0 (0: the model's own), got {cfg.model.max_model_len}")


def _check_data_parallel_nodes(p: ParallelConfig) -> None:
    """Engine cores on several machines (vLLM's multi-node data parallelism with the mp backend)."""
    local = len(p.local_ranks)
    if (p.data_parallel_size_local or 0) < 0 or p.data_parallel_start_rank < 0:
        raise ValueError(f"data_parallel_size_local and data_parallel_start_rank must be at least 0, got "
                         f"{p.data_parallel_size_local} and {p.data_parallel_start_rank}")
    if p.data_parallel_start_rank + local > p.data_parallel_size:
        raise ValueError(f"data_parallel_start_rank {p.data_parallel_start_rank} + data_parallel_size_local {local} "
                         f"is more than data_parallel_size {p.data_parallel_size}: the ranks are 0 to "
                         f"{p.data_parallel_size - 1}")
    if not 1 <= p.data_parallel_rpc_port <= 65535:
        raise ValueError(f"data_parallel_rpc_port must be in [1, 65535], got {p.data_parallel_rpc_port}")
    if p.data_parallel_external_lb and p.data_parallel_hybrid_lb:
        raise ValueError("data_parallel_external_lb (a server per rank) and data_parallel_hybrid_lb (a server per "
                         "machine) are two load-balancing modes: choose one")
    if (p.data_parallel_external_lb or p.data_parallel_hybrid_lb) and p.data_parallel_backend != "mp":
        raise ValueError("external and hybrid load balancing start this machine's engine cores as processes: "
                         "data_parallel_backend 'mp'")
    if p.data_parallel_hybrid_lb and not p.data_parallel_size_local:
        raise ValueError("hybrid load balancing (a server per machine) needs each machine's "
                         "data_parallel_size_local and data_parallel_start_rank")
    if p.data_parallel_external_lb and p.data_parallel_size_local != 1:
        raise ValueError("with external load balancing a server runs one rank (--data-parallel-rank); "
                         "give each rank a server of its own")
    if p.remote_ranks and p.data_parallel_backend != "mp":
        raise ValueError("data_parallel_size_local below data_parallel_size (engine cores started on other "
                         "machines with --headless) goes with data_parallel_backend 'mp'; 'ray' places every "
                         "engine core on the cluster itself")


def _check_nodes(p: ParallelConfig) -> None:
    """An engine core's ranks on several machines (vLLM's --nnodes with the mp backend)."""
    if p.nnodes < 1 or not 0 <= p.node_rank < p.nnodes:
        raise ValueError(f"nnodes must be at least 1 and node_rank in [0, nnodes), got {p.nnodes} and "
                         f"{p.node_rank}: give each machine its zero-based index")
    if not 1 <= p.master_port <= 65535:
        raise ValueError(f"master_port must be in [1, 65535], got {p.master_port}")
    if p.nnodes == 1:
        return
    if p.world_size % p.nnodes:
        raise ValueError(f"nnodes {p.nnodes} must evenly divide the ranks of the engine core (tensor_parallel_size "
                         f"x pipeline_parallel_size = {p.world_size}): each machine runs as many")
    if not p.multiprocess:
        raise ValueError("nnodes above 1 runs worker processes on several machines: it needs the multiprocess "
                         "layout (a server)")
    if p.distributed_executor_backend != "mp":
        raise ValueError(f"nnodes above 1 goes with distributed_executor_backend 'mp' (processes each machine "
                         f"starts); {p.distributed_executor_backend!r} places the ranks itself: leave nnodes at 1")
    if p.data_parallel_size > 1:
        raise ValueError("nnodes above 1 splits one engine core's ranks over machines; with data parallelism, "
                         "run whole engine cores on the other machines instead (--data-parallel-size-local "
                         "here, --headless --data-parallel-start-rank there)")


def _check_executor_backend(cfg: EngineConfig) -> None:
    p = cfg.parallel
    backend = p.distributed_executor_backend
    _one_of("distributed_executor_backend", backend, DISTRIBUTED_EXECUTOR_BACKENDS)
    _one_of("data_parallel_backend", p.data_parallel_backend, DATA_PARALLEL_BACKENDS)
    if backend == "uni" and p.world_size > 1:
        raise ValueError(f"distributed_executor_backend 'uni' runs one worker, and tensor x pipeline parallel "
                         f"sizes ask for {p.world_size}: use 'mp' (processes on this machine) or 'ray'")
    for name, value, what in (("distributed_executor_backend", backend, "worker processes"),
                              ("data_parallel_backend", p.data_parallel_backend, "engine cores")):
        if value != "ray":
            continue
        if not p.multiprocess:
            raise ValueError(f"{name} 'ray' places {what} on a Ray cluster: it needs the multiprocess layout "
                             "(a server, or LLM(multiprocess=True))")
        from actors.runtime.ray_nodes import ray_installed
        if not ray_installed():
            raise ValueError(f"{name} 'ray' needs Ray, which is not installed here: "
                             "pip install ray (or pip install 'troupe[ray]')")


def _check_pipeline_parallel(cfg: EngineConfig) -> None:
    """What pipeline parallelism does not run yet, refused naming the combination."""
    pp = cfg.parallel.pipeline_parallel_size
    if not cfg.parallel.multiprocess:
        raise ValueError("pipeline parallelism runs each stage in a worker process of its own: it needs the "
                         "multiprocess layout (a server, or LLM(multiprocess=True))")
    unsupported = [
        (bool(cfg.scheduler.async_scheduling), "--async-scheduling (the stages' batch queue keeps "
                                               f"{pp} steps in flight instead)"),
    ]
    for refused, what in unsupported:
        if refused:
            raise ValueError(f"{what} with pipeline parallelism (pipeline_parallel_size={pp}) is not supported "
                             "yet: run it with one pipeline stage")


def _one_of(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted: {', '.join(accepted)}")
