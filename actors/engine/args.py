"""EngineArgs: the engine's options as one flat list, shared by the command line
(``python -m tools.serve`` and the benchmarks: ``add_cli_args``) and the offline API
(``LLM(**options)``), and turned into the composed ``EngineConfig`` in one place
(``create_engine_config``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from typing import Any

from actors.engine.config import (CHAT_TEMPLATE_CONTENT_FORMATS, DATA_PARALLEL_BACKENDS, DEFAULT_MAX_LOGPROBS,
                                  DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MM_LIMIT, DEVICES, MODALITIES,
                                  MultiModalConfig, media_io_problem,
                                  DISTRIBUTED_EXECUTOR_BACKENDS, DTYPES, GENERATION_CONFIGS,
                                  KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, CacheConfig,
                                  DeviceConfig, EngineConfig, ModelConfig, ObservabilityConfig, ReasoningConfig,
                                  ParallelConfig, SchedulerConfig, encoder_chunking_refused)
from actors.engine.compilation import compilation_config, with_graph_flags
from actors.engine.json_flags import checked_fields, convert, parse_object
from actors.engine.lora import LoRAConfig, LoRAModulePath, parse_lora_module
from actors.engine.pooling import CONVERTS, RUNNERS, ModelPooling, model_pooling, pooler_config, resolve_runner
from actors.engine.sampling_params import LOGPROBS_MODES, SamplingDefaults
from actors.grammar.config import structured_outputs_config
from actors.engine.profiler import profiler_config
from actors.kv_manager.block_hash import HASH_ALGOS
from actors.kv_manager.kv_events import kv_events_config
from actors.engine.weight_transfer import weight_transfer_config
from actors.kv_transfer.config import kv_transfer_config
from actors.kv_transfer.factory import KVConnectorFactory
from actors.frontend.stats import check_histogram_buckets
from actors.engine.watermark import WatermarkConfig
from actors.runtime.otel import check_available as check_otel
from actors.runtime.plugins import load_general_plugins, qualified_name, resolve_class
from actors.spec_decode.config import SpeculativeConfig
from actors.engine.vllm_options import offline_option
from models.architectures import ENCODER_ONLY_ARCHITECTURES
from models.hf_config import MODEL_IMPLS
from models.resolve import ModelSource, resolve_model, resolve_tokenizer

log = logging.getLogger("troupe.engine")


@dataclasses.dataclass(slots=True, kw_only=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    disable_cascade_attn: bool = False
    quantization: str | None = None
    logprobs_mode: str = "raw_logprobs"
    return_sampling_mask: bool = False
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    load_format: str = "auto"             # vLLM's: what the weights are (Troupe reads it from the files)
    enable_sleep_mode: bool = False
    enable_prompt_embeds: bool = False    # vLLM's: prompts may be given as input embeddings
    skip_tokenizer_init: bool = False     # vLLM's: load no tokenizer (token ids in and out)
    disable_sliding_window: bool = False  # vLLM's: no sliding windows, max_model_len capped at the window
    reasoning_parser: str | None = None   # the server's --reasoning-parser (its tags start and end reasoning)
    reasoning_config: str | dict[str, Any] | None = None   # vLLM's --reasoning-config JSON
    hf_overrides: dict[str, Any] | str | None = None   # vLLM's: config.json keys over the checkpoint's
    model_impl: str = "auto"              # vLLM's: "vllm" (Troupe's own classes), "transformers" (transformers'
                                          # modeling code), "auto" (Troupe's where it has one)
    language_model_only: bool = False     # vLLM's: a multimodal checkpoint served as its language model, on text
    limit_mm_per_prompt: dict[str, Any] | str | None = None   # vLLM's JSON: most items of a modality a prompt holds
    mm_processor_kwargs: dict[str, Any] | str | None = None   # vLLM's JSON: the checkpoint processor's keywords
    allowed_local_media_path: str = ""    # vLLM's: file:// image URLs are read from under this folder only
    allowed_media_domains: list[str] | tuple[str, ...] | None = None   # vLLM's: the hosts http(s) URLs may name
    mm_processor_cache_gb: float = 4.0    # vLLM's: GiB of processed images the frontend keeps (0: none)
    enable_mm_embeds: bool = False        # vLLM's: images may come as their embeddings (image_embeds parts)
    media_io_kwargs: dict[str, Any] | str | None = None   # vLLM's JSON: how videos are read ({"video": {"num_frames": 16}})
    runner: str = "auto"                  # vLLM's: "generate" | "pooling" ("auto": as the architecture says)
    convert: str = "auto"                 # vLLM's: a generative model adapted into a pooling one ("embed")
    pooler_config: dict[str, Any] | str | None = None   # vLLM's --pooler-config JSON
    tokenizer: str | None = None          # None: the model's own
    served_model_name: str | list[str] | tuple[str, ...] | None = None   # None: the model's own name
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config: str = "auto"       # "auto" | "vllm" | a folder with a generation_config.json
    override_generation_config: dict[str, Any] | str | None = None   # over generation_config's fields
    seed: int = 0
    max_model_len: int = 0
    block_size: int = 16
    kv_cache_bytes: int = 0               # 0: 1 GiB on the CPU; on CUDA, what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.92    # vLLM 0.32's default
    num_gpu_blocks_override: int = 0      # 0: as many blocks as the KV cache's memory holds
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    disable_hybrid_kv_cache_manager: bool = False
    disable_chunked_mm_input: bool = False   # vLLM's: a step never ends inside an image's positions
    max_num_batched_encoder_embeds: int | None = None   # vLLM's: image embeddings encoded a step (None: the token budget)
    encoder_cache_size: int | None = None    # vLLM's: image embeddings the encoder cache keeps (None: the above)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None     # None: 2048, or the context length where prompts go whole
    # vLLM's --enable-chunked-prefill: prompts longer than the step's budget computed in chunks
    # (None: on, except for encoder-only models, whose prompts are computed whole)
    enable_chunked_prefill: bool | None = None
    max_num_scheduled_tokens: int | None = None   # vLLM's: a step's token budget (None: max_num_batched_tokens)
    max_num_active_seqs: int | None = None        # vLLM's: requests running at once (None: max_num_seqs)
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False   # vLLM's: the threshold floored at a fair share
    scheduler_reserve_full_isl: bool = True   # vLLM's: admit a request only when its whole sequence fits
    max_step_latency_ms: float | str = 0.0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    kv_cache_watermark: float = 0.01
    async_scheduling: bool | None = None  # None: on when the worker has a process of its own
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 0
    max_num_queued_reqs: int | None = None
    max_waiting_tokens: int = 0
    num_threads: int = 0
    multiprocess: bool = True
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    data_parallel_backend: str = "mp"
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    data_parallel_rank: int | None = None
    data_parallel_external_lb: bool = False
    data_parallel_hybrid_lb: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    max_restarts: int = 3
    restart_window_s: float = 120.0
    worker_extension_cls: str = ""        # vLLM's: methods mixed into every worker (module.Class)
    trace: bool = True
    flight_recorder_dir: str = ""
    disable_log_stats: bool = False       # vLLM's: no periodic statistics lines (the offline LLM: none by default)
    kv_cache_metrics: bool = False        # vLLM's: sampled KV block residency histograms on /metrics
    kv_cache_metrics_sample: float = 0.01
    enable_mfu_metrics: bool = False
    otlp_traces_endpoint: str | None = None   # vLLM's: OpenTelemetry spans of requests exported there
    # vLLM's: "model", "worker" or "all" (a list, or one comma-separated text): model times in spans
    collect_detailed_traces: list[str] | str | None = None
    per_request_spec_decode_metrics: str = "none"   # vLLM's: "none" | "summary" | "detailed"
    # vLLM's: bucket family -> bounds, replacing those histograms' buckets (JSON text or a dict)
    custom_histogram_buckets: dict[str, list[float]] | str | None = None
    # vLLM's --speculative-config: its JSON object (text on the command line, a dict in LLM(...))
    speculative_config: dict[str, Any] | str | None = None
    # vLLM's --spec-method, --spec-model, --spec-tokens: keys of the speculative config, one flag each
    spec_method: str | None = None
    spec_model: str | None = None
    spec_tokens: int | None = None
    # vLLM's --logits-processors: classes or their fully qualified names (models/logits_processors.py)
    logits_processors: list[str | type] | tuple[str | type, ...] | None = None
    # vLLM's --compilation-config (-O): a level 0-3, its JSON text, or a dict in LLM(...)
    compilation_config: dict[str, Any] | str | int | None = None
    cudagraph_capture_sizes: list[int] | None = None      # vLLM's flags for the config's fields
    max_cudagraph_capture_size: int | None = None
    # vLLM's --kv-transfer-config: its JSON object (text on the command line, a dict in LLM(...))
    kv_transfer_config: dict[str, Any] | str | None = None
    # vLLM's --kv-events-config: the prefix cache's changes published over ZeroMQ (JSON text or a dict)
    kv_events_config: dict[str, Any] | str | None = None
    structured_outputs_config: dict[str, Any] | str | None = None
    # vLLM's --profiler-config: what /start_profile records (JSON text or a dict)
    profiler_config: dict[str, Any] | str | None = None
    # vLLM's --watermark-config: the watermark's key and settings (JSON text or a dict)
    watermark_config: dict[str, Any] | str | None = None
    # vLLM's --weight-transfer-config: how a trainer pushes weights (JSON text or a dict)
    weight_transfer_config: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        load_general_plugins()         # this process's plugins first (e.g. an architecture they register)
    enable_lora: bool = False
    # vLLM's --lora-modules: name=path, a JSON object, or (offline) a dict or LoRAModulePath each
    lora_modules: list[Any] | None = None
    max_loras: int = 1
    max_cpu_loras: int | None = None      # None: max_loras
    max_lora_rank: int = 16

    @classmethod
    def from_options(cls, model: str | None, options: dict[str, Any]) -> EngineArgs:
        """The offline API's keyword options; an unknown one is a TypeError listing them all."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown: list[str] = []
        for name in sorted(set(options) - names):
            try:
                why = offline_option(name, options[name])
            except KeyError:
                unknown.append(name)
                continue
            if why is not None:                 # a vLLM option asking for what Troupe does not do
                raise ValueError(why)
        if unknown:
            raise TypeError(f"unknown engine options {unknown}; accepted: {sorted(names)}")
        if isinstance(model, os.PathLike):           # a pathlib.Path of a checkpoint directory or file
            model = os.fspath(model)
        return cls(model=model, **{k: v for k, v in options.items() if k in names})

    def _data_parallel_ranks(self) -> dict[str, Any]:
        """This server's ranks: --data-parallel-rank (external load balancing) is a server of that
        one rank; otherwise the local size and start rank as given."""
        if self.data_parallel_external_lb and self.data_parallel_rank is None:
            raise ValueError("--data-parallel-external-lb: give this server's --data-parallel-rank")
        if self.data_parallel_rank is None:
            return dict(data_parallel_size_local=self.data_parallel_size_local,
                        data_parallel_start_rank=self.data_parallel_start_rank,
                        data_parallel_hybrid_lb=self.data_parallel_hybrid_lb)
        if self.data_parallel_hybrid_lb or self.data_parallel_start_rank or self.data_parallel_size_local not in (None, 1):
            raise ValueError("--data-parallel-rank asks for external load balancing, a server of that one rank: "
                             "it goes without --data-parallel-hybrid-lb, --data-parallel-start-rank and "
                             "--data-parallel-size-local")
        return dict(data_parallel_size_local=1, data_parallel_start_rank=self.data_parallel_rank,
                    data_parallel_rank=self.data_parallel_rank, data_parallel_external_lb=True)

    def create_engine_config(self) -> EngineConfig:
        """The composed config; resolves the model's source (fails fast, naming the package to
        install, when the model is not on this machine) and reads its generation config."""
        source = with_model_impl(with_hf_overrides(resolve_model(self.model), self.hf_overrides), self.model_impl)
        multimodal = self.multimodal()
        if self.language_model_only or (multimodal.limit_per_prompt and not any(multimodal.limit_per_prompt.values())):
            source = dataclasses.replace(source, language_model_only=True)     # vLLM's: every limit 0 asks the same
        check_load_format(self.load_format, source)
        names = self.served_model_name
        speculative = speculative_config(with_spec_flags(self.speculative_config, self.spec_method,
                                                         self.spec_model, self.spec_tokens))
        if self.otlp_traces_endpoint is not None:
            check_otel(self.otlp_traces_endpoint)
        detailed = detailed_trace_modules(self.collect_detailed_traces)
        if detailed and not self.otlp_traces_endpoint:
            raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
        if self.per_request_spec_decode_metrics not in SPEC_DECODE_METRICS_LEVELS:
            raise ValueError(f"per_request_spec_decode_metrics must be one of {SPEC_DECODE_METRICS_LEVELS}, "
                             f"got {self.per_request_spec_decode_metrics!r}")
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs ({self.max_num_active_seqs}) cannot be greater than "
                             f"max_num_seqs ({self.max_num_seqs}).")
        budget = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens > budget:
            raise ValueError(f"max_num_scheduled_tokens ({self.max_num_scheduled_tokens}) cannot be greater than "
                             f"max_num_batched_tokens ({budget}), what the worker is sized for.")
        if self.enable_prompt_embeds and speculative is not None and speculative.method != "ngram":
            raise ValueError(f"--enable-prompt-embeds with speculative method {speculative.method!r} is not "
                             "supported (its draft model reads tokens); ngram drafts are")
        compilation = with_graph_flags(compilation_config(self.compilation_config), self.cudagraph_capture_sizes,
                                       self.max_cudagraph_capture_size)
        config = EngineConfig(
            model=ModelConfig(source=source, dtype=self.dtype,
                              quantization=self.quantization, max_model_len=_context_len(self.max_model_len),
                              seed=self.seed, enforce_eager=self.enforce_eager,
                              disable_cascade_attn=self.disable_cascade_attn,
                              logprobs_mode=self.logprobs_mode,
                              return_sampling_mask=self.return_sampling_mask,
                              chat_template=load_chat_template(self.chat_template),
                              chat_template_content_format=self.chat_template_content_format,
                              enable_sleep_mode=self.enable_sleep_mode,
                              enable_prompt_embeds=self.enable_prompt_embeds,
                              skip_tokenizer_init=self.skip_tokenizer_init,
                              disable_sliding_window=self.disable_sliding_window,
                              reasoning=self.reasoning(),
                              served_model_names=(names,) if isinstance(names, str) else tuple(names or ()),
                              max_logprobs=self.max_logprobs, generation_config=self.generation_config,
                              sampling_defaults=load_sampling_defaults(source, self.generation_config,
                                                                        self.override_generation_config),
                              draft_source=draft_source(speculative, source),
                              logits_processors=logits_processor_names(self.logits_processors),
                              tokenizer_source=resolve_tokenizer(self.tokenizer),
                              pooling=self.pooling(source), multimodal=multimodal),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              num_blocks=self.num_gpu_blocks_override, cache_dtype=self.kv_cache_dtype,
                              calculate_kv_scales=self.calculate_kv_scales,
                              enable_prefix_caching=self.enable_prefix_caching,
                              prefix_caching_hash_algo=self.prefix_caching_hash_algo),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=budget,
                                      budget_given=self.max_num_batched_tokens is not None,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_num_scheduled_tokens=self.max_num_scheduled_tokens,
                                      max_num_active_seqs=self.max_num_active_seqs,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
                                      scheduler_reserve_full_isl=self.scheduler_reserve_full_isl,
                                      max_step_latency_ms=self.max_step_latency_ms,
                                      max_num_partial_prefills=self.max_num_partial_prefills,
                                      max_long_partial_prefills=self.max_long_partial_prefills,
                                      watermark=self.kv_cache_watermark,
                                      async_scheduling=self.async_scheduling,
                                      policy=self.scheduling_policy,
                                      max_waiting_requests=self.max_waiting_requests,
                                      max_waiting_tokens=self.max_waiting_tokens,
                                      max_num_queued_reqs=self.max_num_queued_reqs,
                                      disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
                                      disable_chunked_mm_input=self.disable_chunked_mm_input,
                                      max_num_batched_encoder_embeds=self.max_num_batched_encoder_embeds,
                                      encoder_cache_size=self.encoder_cache_size),
            parallel=ParallelConfig(multiprocess=self.multiprocess, data_parallel_size=self.data_parallel_size,
                                    tensor_parallel_size=self.tensor_parallel_size,
                                    enable_expert_parallel=self.enable_expert_parallel,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    data_parallel_backend=self.data_parallel_backend,
                                    **self._data_parallel_ranks(),
                                    data_parallel_address=self.data_parallel_address,
                                    data_parallel_rpc_port=self.data_parallel_rpc_port,
                                    nnodes=self.nnodes, node_rank=self.node_rank,
                                    master_addr=self.master_addr, master_port=self.master_port,
                                    max_restarts=self.max_restarts,
                                    restart_window_s=self.restart_window_s,
                                    worker_extension_cls=self.worker_extension_cls),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads),
            observability=ObservabilityConfig(trace=self.trace, flight_recorder_dir=self.flight_recorder_dir,
                                              log_stats=not self.disable_log_stats,
                                              kv_cache_metrics=self.kv_cache_metrics,
                                              kv_cache_metrics_sample=self.kv_cache_metrics_sample,
                                              enable_mfu_metrics=self.enable_mfu_metrics,
                                              otlp_traces_endpoint=self.otlp_traces_endpoint,
                                              collect_detailed_traces=detailed,
                                              per_request_spec_decode_metrics=self.per_request_spec_decode_metrics,
                                              custom_histogram_buckets=self.histogram_buckets()),
            speculative=speculative, compilation=compilation, lora=self.lora_config(),
            kv_transfer=kv_transfer_config(self.kv_transfer_config),
            kv_events=kv_events_config(self.kv_events_config),
            structured_outputs=structured_outputs_config(self.structured_outputs_config),
            profiler=profiler_config(self.profiler_config),
            watermark=self.watermark(),
            weight_transfer=weight_transfer_config(self.weight_transfer_config))
        KVConnectorFactory.check_engine(config)
        config.scheduler.check_encoder_cache()
        return config

    def multimodal(self) -> MultiModalConfig:
        """--limit-mm-per-prompt, --mm-processor-kwargs and the media flags, checked."""
        limits = self.limit_mm_per_prompt
        limits = parse_object(limits, "--limit-mm-per-prompt") if isinstance(limits, str) else (limits or {})
        kwargs = self.mm_processor_kwargs
        kwargs = parse_object(kwargs, "--mm-processor-kwargs") if isinstance(kwargs, str) else (kwargs or {})
        if not isinstance(limits, dict) or not isinstance(kwargs, dict):
            raise ValueError("--limit-mm-per-prompt and --mm-processor-kwargs take JSON objects")
        counts = {}
        for modality, value in limits.items():
            count = value.get("count", DEFAULT_MM_LIMIT) if isinstance(value, dict) else value
            if modality not in MODALITIES:
                raise ValueError(f"--limit-mm-per-prompt: {modality!r} is not a modality ({', '.join(MODALITIES)})")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"--limit-mm-per-prompt: {modality}'s limit must be a count of at least 0, "
                                 f"got {count!r}")
            counts[modality] = count
        path = self.allowed_local_media_path
        if path:
            if not os.path.isdir(path):
                raise ValueError(f"--allowed-local-media-path {path!r} is not a folder on this machine")
            path = os.path.realpath(path)
        if self.mm_processor_cache_gb < 0:
            raise ValueError(f"--mm-processor-cache-gb must be at least 0, got {self.mm_processor_cache_gb:g}")
        media = self.media_io_kwargs
        media = parse_object(media, "--media-io-kwargs") if isinstance(media, str) else (media or {})
        problem = media_io_problem(media)
        if problem:
            raise ValueError(f"--media-io-kwargs: {problem}")
        return MultiModalConfig(limit_per_prompt=counts, mm_processor_kwargs=kwargs, allowed_local_media_path=path,
                                allowed_media_domains=tuple(self.allowed_media_domains or ()),
                                processor_cache_gb=float(self.mm_processor_cache_gb),
                                enable_mm_embeds=self.enable_mm_embeds, media_io_kwargs=media)

    def pooling(self, source: ModelSource) -> ModelPooling | None:
        """--runner, --convert and --pooler-config resolved for the checkpoint (vLLM's rules):
        None for a generative model."""
        raw = checkpoint_config(source)
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]   # a GGUF file's: a causal LM
        runner, convert = resolve_runner(architecture, self.runner, self.convert)
        encoder = architecture in ENCODER_ONLY_ARCHITECTURES or bool(raw.get("use_bidirectional_attention"))
        if encoder and self.enable_chunked_prefill:     # refused before any process starts
            raise ValueError(encoder_chunking_refused(architecture))
        user = pooler_config(self.pooler_config)
        if runner != "pooling":
            if user is not None:
                raise ValueError("--pooler-config is for pooling models (--runner pooling)")
            return None
        if convert == "classify" and source.kind != "hf_dir":
            raise ValueError("--convert classify needs a classifier's score head, which only a Hugging Face "
                             "checkpoint (score.weight) holds; a GGUF file has none")
        if raw.get("is_original_qwen3_reranker") and self.chat_template is None:     # vLLM's warning
            log.warning("Serving an original Qwen3 reranker without a --chat-template. The model was trained with "
                        "a specific prompt template; running without it may produce inaccurate relevance scores. "
                        "Give --chat-template with its score template (a 'query' and a 'document' message).")
        token_id = None
        if raw.get("classifier_from_token"):     # the tokenizer's ids of the tokens whose head rows score
            from actors.tokenizer.gguf_tokenizer import TextTokenizer
            tokenizer_source = resolve_tokenizer(self.tokenizer) or source
            token_id = TextTokenizer.from_source(tokenizer_source.kind, tokenizer_source.path).backend_tokenizer.token_to_id
        return model_pooling(user, convert, source.path if source.kind == "hf_dir" else None, raw, token_id)

    def watermark(self) -> WatermarkConfig | None:
        """--watermark-config, checked; vLLM's warning for settings that favour repetition loops."""
        given = self.watermark_config
        if given is None:
            return None
        config = WatermarkConfig.of(parse_object(given, "--watermark-config") if isinstance(given, str) else given)
        if config.dedup_warning:
            log.warning(config.dedup_warning)
        return config

    def histogram_buckets(self) -> tuple[tuple[str, tuple[float, ...]], ...]:
        """--custom-histogram-buckets, checked (vLLM's errors)."""
        given = self.custom_histogram_buckets
        if given is None:
            return ()
        return check_histogram_buckets(parse_object(given, "--custom-histogram-buckets")
                                       if isinstance(given, str) else given)

    def reasoning(self) -> ReasoningConfig | None:
        """vLLM's reasoning config from --reasoning-config and --reasoning-parser (None: neither);
        the strings a parser implies and the token ids are filled in once the tokenizer is read."""
        given = self.reasoning_config
        if isinstance(given, str):
            given = parse_object(given, "--reasoning-config")
        fields = checked_fields(ReasoningConfig, given or {}, "--reasoning-config")
        unknown = set(fields) - {"reasoning_parser", "reasoning_start_str", "reasoning_end_str"}
        if unknown:
            raise ValueError(f"--reasoning-config: {', '.join(sorted(unknown))} cannot be given (the token ids "
                             "come from the tokenizer)")
        named = fields.get("reasoning_parser") or ""
        if named and self.reasoning_parser and named != self.reasoning_parser:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser} and --reasoning-config's reasoning_parser "
                             f"{named} disagree")
        fields["reasoning_parser"] = named or self.reasoning_parser or ""
        if not any(fields.values()):
            return None
        return convert(ReasoningConfig, fields, "--reasoning-config")

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        modules = tuple(m if isinstance(m, LoRAModulePath) else LoRAModulePath(**m) if isinstance(m, dict)
                        else parse_lora_module(m) for m in self.lora_modules or ())
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {names}")
        return LoRAConfig(max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras or 0,
                          max_lora_rank=self.max_lora_rank, lora_modules=modules)

    # -- the command line --------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: Any) -> None:
        """The engine's flags (vLLM's names where vLLM has the option); ``defaults`` overrides a
        flag's default by its dest name, ``skip`` leaves out flags (by dest name) the caller's
        parser already has."""
        d = {f.name: f.default for f in dataclasses.fields(EngineArgs)} | defaults
        for flags, dest, options in _cli_flags(d):
            if dest not in skip:
                p.add_argument(*flags, dest=dest, **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in vars(args).items() if k in names}
        given["kv_cache_bytes"] = kv_cache_bytes(given.get("kv_cache_bytes"),
                                                 getattr(args, "kv_cache_memory_bytes", None))
        if given.get("num_gpu_blocks_override") is None:
            given.pop("num_gpu_blocks_override", None)
        return cls(**(given | overrides))


LOAD_FORMATS = ("auto", "safetensors", "gguf")


def with_hf_overrides(source: ModelSource, overrides: dict[str, Any] | str | None) -> ModelSource:
    """vLLM's --hf-overrides (a JSON object, or the offline API's dict) carried by the model's
    source, so that every process reads the checkpoint's config with them (models/registry.py);
    checked here, so that a bad one stops the start."""
    if overrides is None or overrides == {} or overrides == "":
        return source
    if isinstance(overrides, str):
        overrides = parse_object(overrides, "--hf-overrides")
    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides takes a JSON object of config.json keys, got {overrides!r}")
    source = dataclasses.replace(source, hf_overrides=json.dumps(overrides, sort_keys=True))
    from models.registry import model_config       # torch: loaded here only when overrides are given
    model_config(source)               # the keys apply, or the start stops naming them
    return source


def with_model_impl(source: ModelSource, model_impl: str) -> ModelSource:
    """vLLM's --model-impl carried by the model's source (every process reads the checkpoint with it)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl == "transformers" and source.kind != "hf_dir":
        raise ValueError("--model-impl transformers builds the model with transformers from a Hugging Face checkpoint "
                         f"directory; {source.path} is a GGUF file")
    return source if model_impl == source.model_impl else dataclasses.replace(source, model_impl=model_impl)


def checkpoint_config(source: ModelSource) -> dict[str, Any]:
    """A checkpoint directory's config.json with its --hf-overrides (top-level keys), read
    without torch; {} for a GGUF file."""
    if source.kind != "hf_dir":
        return {}
    with open(os.path.join(source.path, "config.json")) as f:
        raw = json.load(f)
    return {**raw, **(json.loads(source.hf_overrides) if source.hf_overrides else {})}


def check_load_format(load_format: str, source: ModelSource) -> None:
    """vLLM's --load-format against what the model's files are."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    kind = "gguf" if source.kind == "gguf" else "safetensors"
    if load_format not in ("auto", kind):
        raise ValueError(f"--load-format {load_format}: the model's weights are {kind} ({source.path})")


def logits_processor_names(given: list[str | type] | tuple[str | type, ...] | None) -> tuple[str, ...]:
    """--logits-processors as names a worker process can import, each checked here (a class
    that cannot be imported fails at start-up, naming it). Without any, nothing is imported
    (the check needs torch, which the frontend otherwise does without)."""
    names = tuple(qualified_name(c) for c in given or ())
    if names:
        from models.logits_processors import check_processor_class
    for name in names:
        check_processor_class(resolve_class(name, "--logits-processors"), "--logits-processors")
    return names


def kv_cache_bytes(gib: float | None, memory_bytes: int | None) -> int:
    """The KV cache's bytes from --kv-cache-gib or vLLM's --kv-cache-memory-bytes (one at
    most); 0 when neither is given (the default size)."""
    if gib is not None and memory_bytes is not None:
        raise ValueError("give --kv-cache-gib or --kv-cache-memory-bytes, not both")
    if memory_bytes is not None:
        return memory_bytes
    return int(gib * 2**30) if gib else 0


def speculative_config(value: dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON text, or the offline API's dict, parsed and validated."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_json(value) if isinstance(value, str) else SpeculativeConfig.from_dict(value)


def with_spec_flags(value: dict[str, Any] | str | None, method: str | None, model: str | None,
                    tokens: int | None) -> dict[str, Any] | str | None:
    """The speculative config with vLLM's --spec-method / --spec-model / --spec-tokens set in
    it; a key given both ways is an error, as in vLLM."""
    flags = (("--spec-method", "method", method), ("--spec-model", "model", model),
             ("--spec-tokens", "num_speculative_tokens", tokens))
    if all(v is None for _, _, v in flags):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError("--spec-method, --spec-model and --spec-tokens need --speculative-config to be a JSON object")
    merged = dict(value or {})
    for flag, key, v in flags:
        if v is None:
            continue
        if key in merged:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        merged[key] = v
    return merged


def draft_source(spec: SpeculativeConfig | None, target: ModelSource) -> ModelSource | None:
    """The draft model's checkpoint: the target's own for self_draft, ``model`` resolved like
    --model for draft_model (failing fast when it is not on this machine); None for n-gram."""
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "self_draft":
        return target
    return resolve_model(spec.model)


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def load_sampling_defaults(source: ModelSource, generation_config: str,
                           override: dict[str, Any] | str | None = None) -> SamplingDefaults:
    """vLLM's --generation-config: "auto" reads the checkpoint directory's
    generation_config.json (a GGUF file has none), "vllm" reads nothing, anything else is a
    folder holding a generation_config.json (or that file itself). Its sampling fields
    (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens as max_tokens) become
    the defaults of requests that leave them unset. ``override`` (vLLM's
    --override-generation-config, a JSON object) replaces or adds fields over what was read
    (with "vllm", it alone gives the defaults)."""
    raw, where = _read_generation_config(source, generation_config)
    extra = _override_generation_config(override)
    if extra:
        ignored = sorted(set(extra) - set(GENERATION_FIELDS))
        if ignored:
            log.warning("--override-generation-config: %s %s no sampling default (the fields read are %s)",
                        ", ".join(ignored), "sets" if len(ignored) == 1 else "set", ", ".join(GENERATION_FIELDS))
        raw = {**raw, **extra}
        where = "--override-generation-config" if not raw.keys() - extra.keys() else f"{where} with --override-generation-config"
    values: dict[str, Any] = {}
    for name in GENERATION_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        integral = name in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ValueError(f"{where}: {name} must be {'an integer' if integral else 'a number'}, got {value!r}")
        if not _GENERATION_RANGES[name](value):
            raise ValueError(f"{where}: {name} {value!r} is out of the range a request may ask for")
        values["max_tokens" if name == "max_new_tokens" else name] = value if integral else float(value)
    return SamplingDefaults(**values)


def _read_generation_config(source: ModelSource, generation_config: str) -> tuple[dict[str, Any], str]:
    """The generation_config.json that --generation-config names (its fields and its path), or
    nothing ("vllm", or "auto" where the model has none)."""
    if generation_config == "vllm":
        return {}, "--generation-config vllm"
    if generation_config == "auto":
        path = os.path.join(source.path, "generation_config.json") if source.kind == "hf_dir" else None
        if path is None or not os.path.isfile(path):
            return {}, "the model's generation config"
    else:
        path = os.path.expanduser(generation_config)
        if os.path.isdir(path):
            path = os.path.join(path, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config {generation_config!r}: no generation_config.json there "
                             f"(accepted: {', '.join(GENERATION_CONFIGS)}, or a folder holding one)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw, path


def _override_generation_config(value: dict[str, Any] | str | None) -> dict[str, Any]:
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: not valid JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"--override-generation-config: a JSON object is required, got {value!r}")
    return parsed


# what a request's own field accepts (protocol.py), so a default never fails a request
_GENERATION_RANGES = {
    "temperature": lambda v: 0.0 <= v <= 2.0, "top_p": lambda v: 0.0 < v <= 1.0,
    "top_k": lambda v: v >= -1, "min_p": lambda v: 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: 0.0 < v <= 10.0, "max_new_tokens": lambda v: v >= 1,
}


def load_chat_template(template: str | None) -> str | None:
    """vLLM's reading of --chat-template: a file's text, or the template itself when it has
    Jinja's or a line's characters; anything else is a missing file."""
    if template is None:
        return None
    try:
        with open(template) as f:
            return f.read()
    except OSError as exc:
        if any(c in template for c in "{}\n"):
            return template
        raise ValueError(f"--chat-template {template!r}: not a readable file ({exc.strerror}) "
                         "nor a template") from None


def _cli_flags(d: dict[str, Any]) -> list[tuple[tuple[str, ...], str, dict[str, Any]]]:
    """(flags, dest, argparse options) of every engine flag, with defaults from ``d``."""
    return [
        (("--model",), "model", dict(default=d["model"], help="model name, .gguf path or checkpoint dir "
                                     "(default: HuggingFaceTB/SmolLM2-135M-Instruct)")),
        (("--served-model-name",), "served_model_name", dict(
            nargs="+", default=d["served_model_name"], metavar="NAME",
            help="the names the model answers to in /v1/models and a request's model field; the "
                 "first is the one responses and metrics report (default: the model's name)")),
        (("--dtype",), "dtype", dict(default=d["dtype"], choices=DTYPES, type=_dtype,
                                     help="auto: float32 on the CPU, bfloat16 on a GPU (half: float16, "
                                          "float: float32)")),
        (("--device",), "device", dict(default=d["device"], choices=DEVICES,
                                       help="auto: a CUDA GPU when one is present, else the CPU")),
        (("--enforce-eager",), "enforce_eager", dict(
            action=argparse.BooleanOptionalAction, default=d["enforce_eager"],
            help="never capture CUDA graphs (GPU only; for debugging)")),
        (("--disable-cascade-attn",), "disable_cascade_attn", dict(
            action=argparse.BooleanOptionalAction, default=d["disable_cascade_attn"],
            help="never use cascade attention (by default a step whose requests share a prefix of 256+ "
                 "tokens, 1,024+ on the CPU, 8+ requests, attends that prefix once for all when a cost model "
                 "says it pays)")),
        (("--quantization", "-q"), "quantization", dict(
            default=d["quantization"], choices=QUANTIZATIONS,
            help="by default the checkpoint's own (config.json's quantization_config: fp8, "
                 "compressed-tensors, awq, gptq), else exact; 'fp8' on a float checkpoint quantizes it at "
                 "load; 'gguf': the checkpoint's GGUF Q4_1/Q8_0 blocks run natively with float32 activations "
                 "(same weights, faster decoding); 'gguf-i8': Q4_1 layers also take int8 activations in "
                 "two parts (AVX512-VNNI or AVX2; faster decoding, rare token changes)")),
        (("--logprobs-mode",), "logprobs_mode", dict(
            default=d["logprobs_mode"], choices=LOGPROBS_MODES,
            help="what returned log-probs are: the model's own (raw_*) or those sampled from, after "
                 "penalties, temperature and truncation (processed_*); log-probs or logits")),
        (("--return-sampling-mask",), "return_sampling_mask", dict(
            action=argparse.BooleanOptionalAction, default=d["return_sampling_mask"],
            help="vLLM's: each sampled token's support (the token ids its draw could pick, after the "
                 "processors, min-p, top-k and top-p) comes back with it, as the generate endpoint's "
                 "sampling_mask and the offline outputs' sampling_mask; requests must then sample with "
                 "temperature > 0 and top_k > 0 (for reinforcement learning's replay of the distribution)")),
        (("--max-logprobs",), "max_logprobs", dict(
            type=int, default=d["max_logprobs"], metavar="N",
            help="the most log-probs a request may ask for (chat top_logprobs, completions logprobs, "
                 "also for the echoed prompt); more is a 400 naming the field; -1: no bound")),
        (("--generation-config",), "generation_config", dict(
            default=d["generation_config"], metavar="{auto,vllm,FOLDER}",
            help="auto: the checkpoint directory's generation_config.json gives the defaults of requests "
                 "that leave temperature, top_p, top_k, min_p, repetition_penalty or (chat) max_tokens "
                 "unset (max_new_tokens); vllm: ignore it; FOLDER: that folder's generation_config.json")),
        (("--override-generation-config",), "override_generation_config", dict(
            default=d["override_generation_config"], metavar="JSON",
            help='generation config fields over --generation-config\'s, e.g. \'{"temperature": 0.5}\' (with '
                 '--generation-config vllm, these alone)')),
        (("--enable-sleep-mode",), "enable_sleep_mode", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_sleep_mode"],
            help="vLLM's: the engine may sleep at levels 1 and 2 (POST /sleep with VLLM_SERVER_DEV_MODE=1, or "
                 "LLM.sleep()): its workers give back the KV cache's memory, and at level 2 the weights' too "
                 "(read again from the checkpoint at wake-up)")),
        (("--enable-prompt-embeds",), "enable_prompt_embeds", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_prompt_embeds"],
            help="vLLM's: /v1/completions takes prompt_embeds (base64 of a torch.save'd (tokens, hidden) "
                 "tensor, or a list of them) and LLM.generate {'prompt_embeds': tensor}: the model reads "
                 "the rows instead of token embeddings")),
        (("--skip-tokenizer-init",), "skip_tokenizer_init", dict(
            action=argparse.BooleanOptionalAction, default=d["skip_tokenizer_init"],
            help="vLLM's: load no tokenizer (the checkpoint may have none): prompts come as token ids, "
                 "answers carry token ids (their text empty); text prompts, chat, stop strings and "
                 "structured outputs are refused")),
        (("--disable-sliding-window",), "disable_sliding_window", dict(
            action=argparse.BooleanOptionalAction, default=d["disable_sliding_window"],
            help="vLLM's: a model with sliding-window layers (Gemma 3, Mistral's) attends to the whole context "
                 "in every layer, and the context is capped at the window's size (ignored for other models)")),
        (("--reasoning-config",), "reasoning_config", dict(
            default=d["reasoning_config"], metavar="JSON",
            help="vLLM's: how a thinking model's reasoning starts and is ended when a request's "
                 "thinking_token_budget runs out: '{\"reasoning_start_str\": \"<think>\", \"reasoning_end_str\": "
                 "\"Enough thinking.</think>\"}' (default: --reasoning-parser's tags)")),
        (("--hf-overrides",), "hf_overrides", dict(
            default=d["hf_overrides"], metavar="JSON",
            help="vLLM's: config.json keys over the checkpoint's, as a JSON object (e.g. "
                 "'{\"max_position_embeddings\": 4096}'; a nested config such as text_config merged key by "
                 "key); on a GGUF file, the keys its header gives (max_position_embeddings, rope_theta, "
                 "rope_scaling, rms_norm_eps, sliding_window, bos/eos_token_id, softcapping)")),
        (("--model-impl",), "model_impl", dict(
            choices=MODEL_IMPLS, default=d["model_impl"],
            help="vLLM's: which implementation of the architecture runs: vllm (Troupe's own), transformers "
                 "(transformers' modeling code, its attention over Troupe's paged KV cache: any causal LM "
                 "transformers implements), auto (Troupe's where it has one, else transformers')")),
        (("--language-model-only",), "language_model_only", dict(
            action=argparse.BooleanOptionalAction, default=d["language_model_only"],
            help="vLLM's: a multimodal checkpoint is served as its language model, on text (its vision tower "
                 "never loaded; image parts refused)")),
        (("--limit-mm-per-prompt",), "limit_mm_per_prompt", dict(
            default=d["limit_mm_per_prompt"], metavar="JSON",
            help="vLLM's: the most items of each modality one prompt may hold, e.g. '{\"image\": 2}' (unset: 999; "
                 "every limit 0 serves the language model alone)")),
        (("--mm-processor-kwargs",), "mm_processor_kwargs", dict(
            default=d["mm_processor_kwargs"], metavar="JSON",
            help="vLLM's: keywords for the checkpoint's processor (its processor_config.json's settings), as JSON")),
        (("--mm-processor-cache-gb",), "mm_processor_cache_gb", dict(
            type=float, default=d["mm_processor_cache_gb"], metavar="GIB",
            help="vLLM's: GiB of processed images the frontend keeps, by the image and the processing, so an image "
                 "sent again (each turn of a chat about it) is not processed again (0: none)")),
        (("--enable-mm-embeds",), "enable_mm_embeds", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_mm_embeds"],
            help="vLLM's: images may come as their embeddings: chat image_embeds parts (base64 of a torch.save'd "
                 "(positions, hidden) tensor), offline multi_modal_data={'image': tensor}; for a model whose "
                 "image placeholder expands to image tokens alone (LLaVA's)")),
        (("--media-io-kwargs",), "media_io_kwargs", dict(
            default=d["media_io_kwargs"], metavar="JSON",
            help="vLLM's: how media are read, per modality: '{\"video\": {\"num_frames\": 16, \"fps\": 2}}' samples a "
                 "video's frames evenly, that many (default 32; -1: all) and at most fps a second (a request's "
                 "media_io_kwargs over it)")),
        (("--allowed-local-media-path",), "allowed_local_media_path", dict(
            default=d["allowed_local_media_path"], metavar="DIR",
            help="vLLM's: image_url and video_url parts may name file:// URLs of files under this folder (unset: none)")),
        (("--allowed-media-domains",), "allowed_media_domains", dict(
            nargs="+", default=d["allowed_media_domains"], metavar="HOST",
            help="vLLM's: the only hosts http(s) image and video URLs may name (unset: any)")),
        (("--runner",), "runner", dict(
            choices=RUNNERS, default=d["runner"],
            help="vLLM's: generate (the model writes text) or pooling (it embeds prompts: /v1/embeddings, "
                 "/pooling, LLM.embed); auto: as the checkpoint's architecture name says (...ForCausalLM "
                 "generates, a bare ...Model embeds)")),
        (("--convert",), "convert", dict(
            choices=CONVERTS, default=d["convert"],
            help="vLLM's: embed turns a generative checkpoint into an embedding model (its last layer's "
                 "hidden states pooled, by default the last token's, L2-normalized); implies --runner pooling")),
        (("--pooler-config",), "pooler_config", dict(
            default=d["pooler_config"], metavar="JSON",
            help="vLLM's: how a pooling model pools, e.g. '{\"pooling_type\": \"MEAN\"}' (CLS, LAST, MEAN; "
                 "ALL for token_embed), '{\"use_activation\": false}' (no normalization), \"dimensions\" "
                 "(a Matryoshka model's default size); unset keys come from a sentence-transformers "
                 "checkpoint's modules.json")),
        (("--load-format",), "load_format", dict(
            choices=LOAD_FORMATS, default=d["load_format"],
            help="vLLM's: the weights' format; Troupe reads it from the model's files (a .gguf file, or a "
                 "checkpoint directory's safetensors), and stops the start when the name given disagrees")),
        (("--tokenizer",), "tokenizer", dict(
            default=d["tokenizer"], metavar="DIR_OR_MODEL",
            help="read the tokenizer (and its chat template) from here instead of the model's checkpoint: a "
                 "directory with a tokenizer.json (a Hugging Face checkpoint, or its tokenizer files alone), "
                 "a .gguf file, or a model name Troupe knows; its vocabulary must fit the model's")),
        (("--chat-template",), "chat_template", dict(
            default=d["chat_template"], metavar="FILE_OR_TEMPLATE",
            help="a Jinja chat template (a file, or the template itself) used instead of the model's")),
        (("--chat-template-content-format",), "chat_template_content_format", dict(
            choices=CHAT_TEMPLATE_CONTENT_FORMATS, default=d["chat_template_content_format"],
            help="how message content reaches the chat template: 'string' (text parts joined by newlines) "
                 "or 'openai' (a list of {\"type\": \"text\", \"text\": ...} parts); 'auto' detects which one "
                 "the template reads (it loops over a message's content: 'openai')")),
        (("--kv-cache-gib",), "kv_cache_bytes", dict(
            type=_positive(float), default=None, metavar="GIB",
            help="memory for the KV cache (default: 1 GiB on the CPU; on CUDA, what "
                 "--gpu-memory-utilization leaves)")),
        (("--kv-cache-memory-bytes",), "kv_cache_memory_bytes", dict(
            type=_positive(human_readable_int), default=None, metavar="BYTES",
            help="the same in bytes, as vLLM takes it (1k = 1000, 1K = 1024, 4G = 4 GiB)")),
        (("--gpu-memory-utilization", "--device-memory-utilization"), "gpu_memory_utilization", dict(
            type=_fraction, default=d["gpu_memory_utilization"], metavar="FRACTION",
            help="CUDA: the share of the GPU's total memory for weights, activations and the KV cache; "
                 "the KV cache gets what is left of it once the weights are loaded and a forward pass "
                 "ran (--kv-cache-gib wins). Does not apply on the CPU, where the KV cache takes "
                 "--kv-cache-gib (default 1 GiB)")),
        (("--num-gpu-blocks-override",), "num_gpu_blocks_override", dict(
            type=_positive(int), default=None, metavar="N",
            help="the KV cache's number of blocks, whatever its memory would hold")),
        (("--kv-cache-dtype",), "kv_cache_dtype", dict(
            default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
            help="auto: the model's dtype; float16 / bfloat16 store K and V rounded to 16 bits (twice the "
                 "tokens per GiB, half the bytes long-context decoding reads); fp8 (= fp8_e4m3) / fp8_e5m2 "
                 "store them as 8-bit floats with a scale per layer (four times float32's tokens per GiB)")),
        (("--calculate-kv-scales",), "calculate_kv_scales", dict(
            action="store_true", default=d["calculate_kv_scales"],
            help="with an fp8 KV cache: each layer's K and V scales from the first batch's largest "
                 "magnitudes (as vLLM: key amax / 200, value amax / 100), instead of 1.0")),
        (("--enable-prefix-caching",), "enable_prefix_caching", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_prefix_caching"],
            help="reuse the KV cache of prompt prefixes seen before (whole blocks)")),
        (("--prefix-caching-hash-algo",), "prefix_caching_hash_algo", dict(
            default=d["prefix_caching_hash_algo"], choices=HASH_ALGOS,
            help="vLLM's: how the prefix cache hashes its blocks, as vLLM does, so KV events carry the hashes "
                 "vLLM would: sha256 (pickle, then SHA-256), sha256_cbor (canonical CBOR, then SHA-256: "
                 "reproducible from any language), xxhash, xxhash_cbor (faster, not collision resistant; "
                 "the xxhash package); the first block's parent is the algorithm's hash of PYTHONHASHSEED, "
                 "else of \"vllm-none-hash\" (xxhash: a random seed per process)")),
        (("--disable-chunked-mm-input",), "disable_chunked_mm_input", dict(
            action=argparse.BooleanOptionalAction, default=d["disable_chunked_mm_input"],
            help="vLLM's: with chunked prefill, a step never ends inside an image's positions (it takes the image "
                 "whole, or stops before it); always so for a model whose image positions attend to each other "
                 "(Gemma 3's)")),
        (("--max-num-batched-encoder-embeds",), "max_num_batched_encoder_embeds",
         dict(type=_positive(human_readable_int), default=d["max_num_batched_encoder_embeds"],
              help="vLLM's: the image embeddings the model's encoder makes in one step at most (default: "
                   "--max-num-batched-tokens); a prompt chunk stops before an image that does not fit, which "
                   "waits for a later step (an image larger than this goes alone)")),
        (("--encoder-cache-size",), "encoder_cache_size",
         dict(type=_positive(human_readable_int), default=d["encoder_cache_size"],
              help="vLLM's: the image embeddings the workers keep (default: --max-num-batched-encoder-embeds): "
                   "an image's embeddings serve every step over its positions and later requests with the same "
                   "image, until evicted (oldest unused first) for a new one")),
        (("--disable-hybrid-kv-cache-manager",), "disable_hybrid_kv_cache_manager", dict(
            action=argparse.BooleanOptionalAction, default=d["disable_hybrid_kv_cache_manager"],
            help="every layer holds a KV block for every token; by default the sliding-window layers of "
                 "a model that also has full-attention ones (Gemma 3) hold only their window's blocks")),
        (("--block-size",), "block_size", dict(type=_positive(int), default=d["block_size"],
                                               help="tokens per KV cache block")),
        (("--max-num-seqs",), "max_num_seqs", dict(type=_positive(int), default=d["max_num_seqs"],
                                                   help="requests per engine step at most")),
        (("--max-num-batched-tokens",), "max_num_batched_tokens",
         dict(type=_positive(human_readable_int), default=d["max_num_batched_tokens"],
              help="tokens per engine step at most (prompts are chunked to fit; default 2048, or the context "
                   "length where prompts are computed whole, if that is more)")),
        (("--enable-chunked-prefill",), "enable_chunked_prefill", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_chunked_prefill"],
            help="vLLM's: compute a prompt longer than --max-num-batched-tokens in chunks over several steps "
                 "(the default); --no-enable-chunked-prefill schedules each prompt whole, the default for "
                 "encoder-only models (BERT, RoBERTa: bidirectional attention over the whole prompt)")),
        (("--max-num-scheduled-tokens",), "max_num_scheduled_tokens",
         dict(type=_positive(human_readable_int), default=d["max_num_scheduled_tokens"],
              help="vLLM's: the tokens the scheduler gives a step (default: --max-num-batched-tokens, what the "
                   "worker is sized for); at most --max-num-batched-tokens")),
        (("--max-num-active-seqs",), "max_num_active_seqs",
         dict(type=_positive(int), default=d["max_num_active_seqs"],
              help="vLLM's: the requests that may run at once (default: --max-num-seqs, what the model runner "
                   "and its CUDA graphs are sized for): smaller decode batches without smaller graphs")),
        (("--max-step-latency-ms",), "max_step_latency_ms", dict(
            type=_step_latency, default=d["max_step_latency_ms"], metavar="MS|auto",
            help="stall-free batching: while requests are decoding, a step takes prompt chunks only as "
                 "large as keep its predicted time under MS (a cost model of tokens and attention fitted "
                 "on the steps run); every prompt still progresses by at least a block per step. 'auto': "
                 "the target follows the machine, a prompt chunk beside decodes costing at most "
                 "10 times the fitted fixed cost of a step, or 128 prompt tokens' fitted cost where "
                 "that is more. 0 (the default): chunks as large as --max-num-batched-tokens")),
        (("--long-prefill-token-threshold-adaptive",), "long_prefill_token_threshold_adaptive", dict(
            action=argparse.BooleanOptionalAction, default=d["long_prefill_token_threshold_adaptive"],
            help="vLLM's: floor --long-prefill-token-threshold at a fair share of the token budget (the "
                 "budget over the requests waiting and running), so a few requests are not cut into "
                 "needlessly small chunks")),
        (("--scheduler-reserve-full-isl",), "scheduler_reserve_full_isl", dict(
            action=argparse.BooleanOptionalAction, default=d["scheduler_reserve_full_isl"],
            help="vLLM's: admit a waiting request only when its whole sequence fits in the free KV blocks "
                 "(beside the watermark), though only its first chunk gets blocks; --no-scheduler-reserve-"
                 "full-isl checks the first chunk alone (more prompts admitted, more preemption later)")),
        (("--long-prefill-token-threshold",), "long_prefill_token_threshold", dict(
            type=int, default=d["long_prefill_token_threshold"], metavar="N",
            help="a prompt with more tokens than this left to compute gets at most this many per step "
                 "while other requests run or wait, and counts as long for --max-long-partial-prefills "
                 "(0: off; with --max-num-partial-prefills above 1, 4%% of the context length)")),
        (("--max-num-partial-prefills",), "max_num_partial_prefills", dict(
            type=_positive(int), default=d["max_num_partial_prefills"], metavar="N",
            help="prompts that may be part-way computed at once (a chunked prompt counts until its last "
                 "chunk); a waiting prompt that would exceed it waits")),
        (("--max-long-partial-prefills",), "max_long_partial_prefills", dict(
            type=_positive(int), default=d["max_long_partial_prefills"], metavar="N",
            help="of those, prompts longer than --long-prefill-token-threshold, so short prompts pass "
                 "long ones (at most --max-num-partial-prefills)")),
        (("--kv-cache-watermark", "--watermark"), "kv_cache_watermark", dict(
            type=_watermark, default=d["kv_cache_watermark"], metavar="FRACTION",
            help="share of the KV cache's blocks a new request may not take while others run, so "
                 "running requests can grow without preemption")),
        (("--async-scheduling",), "async_scheduling", dict(
            action=argparse.BooleanOptionalAction, default=d["async_scheduling"],
            help="plan the next engine step while the worker computes this one (default: on when the "
                 "worker runs in a process of its own; the same tokens either way)")),
        (("--tensor-parallel-size", "-tp"), "tensor_parallel_size", dict(
            type=int, default=d["tensor_parallel_size"], metavar="N",
            help="split the model over N worker processes: attention heads (and their KV cache) and MLP "
                 "columns per rank, an all-reduce after each attention and MLP (gloo on the CPU, NCCL on "
                 "GPUs); exact weights only")),
        (("--enable-expert-parallel", "-ep"), "enable_expert_parallel", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_expert_parallel"],
            help="with --tensor-parallel-size N, give each rank 1/N of a mixture-of-experts model's experts "
                 "whole, tokens sent to their experts' ranks and back by all-to-all (attention stays "
                 "tensor-parallel); without it every expert is split over the ranks like a dense MLP")),
        (("--pipeline-parallel-size", "-pp"), "pipeline_parallel_size", dict(
            type=int, default=d["pipeline_parallel_size"], metavar="N",
            help="split the model's decoder layers into N contiguous stages, a worker process each (times "
                 "--tensor-parallel-size), the hidden states sent from stage to stage (gloo on the CPU, NCCL "
                 "on GPUs) and N steps in flight so the stages overlap; exact weights only")),
        (("--worker-extension-cls",), "worker_extension_cls", dict(
            default=d["worker_extension_cls"], metavar="MODULE.CLASS",
            help="vLLM's: a class whose methods every worker gains (it may not redefine one the worker has), "
                 "called by name with collective_rpc (offline, or POST /collective_rpc with "
                 "VLLM_SERVER_DEV_MODE=1); they see the worker as self (self.model, self.device, self.config)")),
        (("--distributed-executor-backend",), "distributed_executor_backend", dict(
            default=d["distributed_executor_backend"], choices=DISTRIBUTED_EXECUTOR_BACKENDS,
            help="where each engine core's worker processes run: 'mp' (default), processes it starts on this "
                 "machine; 'ray', one Ray actor per rank on the running Ray cluster (`ray start --head` here, "
                 "`ray start --address=HEAD_IP:6379` on the other machines; needs `pip install ray`); 'uni': "
                 "one worker, as mp runs it")),
        (("--data-parallel-size", "-dp"), "data_parallel_size", dict(
            type=int, default=d["data_parallel_size"], metavar="N",
            help="engine cores, each with its own scheduler, KV cache and worker process, behind one "
                 "frontend that sends each request to the least loaded one (waiting plus running), "
                 "preferring the one that served the same prompt prefix")),
        (("--data-parallel-backend", "-dpb"), "data_parallel_backend", dict(
            default=d["data_parallel_backend"], choices=DATA_PARALLEL_BACKENDS,
            help="where the engine cores run: 'mp' (default), processes the server starts on this machine; "
                 "'ray', one Ray actor per engine core on the running Ray cluster (each starts its worker "
                 "processes where it runs, or places them on the cluster too with "
                 "--distributed-executor-backend ray); the server itself stays on this machine")),
        (("--data-parallel-size-local", "-dpl"), "data_parallel_size_local", dict(
            type=int, default=d["data_parallel_size_local"], metavar="N",
            help="the engine cores this machine runs (default: all of --data-parallel-size; 0: none, this "
                 "machine runs the server only); the rest run on other machines, started there with "
                 "--headless, and join this server at --data-parallel-address:--data-parallel-rpc-port")),
        (("--data-parallel-start-rank", "-dpr"), "data_parallel_start_rank", dict(
            type=int, default=d["data_parallel_start_rank"], metavar="RANK",
            help="with --headless: the first data-parallel rank this machine runs (it runs "
                 "--data-parallel-size-local of them from there)")),
        (("--data-parallel-rank", "-dpn"), "data_parallel_rank", dict(
            type=int, default=d["data_parallel_rank"], metavar="RANK",
            help="vLLM's external load balancing: this server runs data-parallel rank RANK only (of "
                 "--data-parallel-size), a server per rank with a load balancer of your own in front")),
        (("--data-parallel-external-lb", "-dpe"), "data_parallel_external_lb", dict(
            action=argparse.BooleanOptionalAction, default=d["data_parallel_external_lb"],
            help="external load balancing (what --data-parallel-rank implies; it needs that flag)")),
        (("--data-parallel-hybrid-lb", "-dph"), "data_parallel_hybrid_lb", dict(
            action=argparse.BooleanOptionalAction, default=d["data_parallel_hybrid_lb"],
            help="vLLM's hybrid load balancing: a server per machine balancing its own "
                 "--data-parallel-size-local ranks from --data-parallel-start-rank, a load balancer of your "
                 "own in front of the machines")),
        (("--data-parallel-address", "-dpa"), "data_parallel_address", dict(
            default=d["data_parallel_address"], metavar="HOST",
            help="the address of the machine that runs the server (default 127.0.0.1): there it listens for "
                 "the engine cores of headless machines, and they connect to it")),
        (("--data-parallel-rpc-port", "-dpp"), "data_parallel_rpc_port", dict(
            type=int, default=d["data_parallel_rpc_port"], metavar="PORT",
            help="the port of --data-parallel-address where headless machines' engine cores join "
                 "(default 29550)")),
        (("--nnodes", "-n"), "nnodes", dict(
            type=int, default=d["nnodes"], metavar="N",
            help="split each engine core's worker ranks (--tensor-parallel-size x --pipeline-parallel-size) "
                 "evenly over N machines, in rank order, without Ray: node rank 0 runs the server, the others "
                 "`troupe serve MODEL --headless --nnodes N --node-rank R --master-addr A --master-port P` "
                 "with the same model and engine flags")),
        (("--node-rank", "-r"), "node_rank", dict(
            type=int, default=d["node_rank"], metavar="R",
            help="with --nnodes: this machine's zero-based index (0: the one running the server; the others "
                 "run --headless)")),
        (("--master-addr",), "master_addr", dict(
            default=d["master_addr"], metavar="HOST",
            help="with --nnodes: the address of node rank 0 (default 127.0.0.1), where its engine core listens "
                 "for the other machines' ranks and their process group meets")),
        (("--master-port",), "master_port", dict(
            type=int, default=d["master_port"], metavar="PORT",
            help="with --nnodes: the port of --master-addr where the other machines join its engine core "
                 "(default 29501)")),
        (("--compilation-config", "-O", "-cc", "--optimization-level"), "compilation_config", dict(
            default=d["compilation_config"], metavar="LEVEL|JSON",
            help="how the model's forward runs, as vLLM takes it: -O0 eager with plain torch ops, -O1 "
                 "eager with the custom kernels (the default), -O2 torch.compile of the pieces between "
                 "attention calls, -O3 that with the elementwise ops left to the compiler to fuse; or a "
                 'JSON object such as {"level": 2, "cudagraph_capture_sizes": [1, 2, 4], '
                 '"cudagraph_mode": "NONE"} ("mode" is accepted for "level")')),
        (("--cudagraph-capture-sizes",), "cudagraph_capture_sizes", dict(
            type=_positive(int), nargs="+", default=d["cudagraph_capture_sizes"], metavar="N",
            help="vLLM's: the decode batch sizes captured as CUDA graphs (the compilation config's "
                 "cudagraph_capture_sizes)")),
        (("--max-cudagraph-capture-size",), "max_cudagraph_capture_size", dict(
            type=_positive(int), default=d["max_cudagraph_capture_size"], metavar="N",
            help="vLLM's: the largest decode batch captured as a CUDA graph (1, 2, 4, then steps of 8 and "
                 "16 up to it); larger batches run eagerly (default: --max-num-seqs)")),
        (("--spec-method",), "spec_method", dict(
            default=d["spec_method"], metavar="METHOD",
            help="vLLM's: the speculative config's method (ngram, draft_model, self_draft), without the JSON")),
        (("--spec-model",), "spec_model", dict(
            default=d["spec_model"], metavar="MODEL", help="vLLM's: the speculative config's draft model")),
        (("--spec-tokens",), "spec_tokens", dict(
            type=int, default=d["spec_tokens"], metavar="K",
            help="vLLM's: the speculative config's num_speculative_tokens")),
        (("--speculative-config", "-sc"), "speculative_config", dict(
            default=d["speculative_config"], metavar="JSON",
            help='speculative decoding, as vLLM takes it: a JSON object such as {"method": "ngram", '
                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} (n-gram '
                 "prompt lookup: drafts copied from earlier in the sequence), {\"method\": \"draft_model\", "
                 '"model": PATH, "num_speculative_tokens": 3} (a smaller model of the same vocabulary drafts) '
                 'or {"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 4} (the '
                 "target's own weights, quantized, draft); the target verifies every draft in one step, so "
                 "greedy requests get the same tokens as without it (structured outputs, penalties and "
                 "the other logits processors apply at every draft position). Requests that ask for "
                 "log-probs decode without drafts. Turns async scheduling off")),
        (("--kv-transfer-config",), "kv_transfer_config", dict(
            default=d["kv_transfer_config"], metavar="JSON",
            help='prefill/decode disaggregation, as vLLM takes it: a JSON object such as {"kv_connector": '
                 '"TroupeConnector", "kv_role": "kv_producer", "kv_port": 14579} (kv_role kv_producer, '
                 "kv_consumer or kv_both; kv_ip, kv_port: where a producer's side channel listens; "
                 'kv_connector_extra_config: {"kv_lease_duration", "heartbeat_s", "transfer_timeout_s", "shm"}). '
                 "Requests then carry kv_transfer_params (see tools/pd_proxy.py)")),
        (("--structured-outputs-config",), "structured_outputs_config", dict(
            default=d["structured_outputs_config"], metavar="JSON",
            help="vLLM's, as JSON: backend (\"auto\" or \"xgrammar\": Troupe always uses xgrammar), "
                 "disable_any_whitespace (JSON outputs compact, without the whitespace the model may "
                 "otherwise put between tokens), reasoning_parser (as --reasoning-parser), "
                 "disable_fallback and disable_additional_properties (accepted; nothing to change)")),
        (("--watermark-config",), "watermark_config", dict(
            default=d["watermark_config"], metavar="JSON",
            help="vLLM's: sampled (non-greedy) tokens carry a keyed Gumbel-max watermark, detectable with the key "
                 "(troupe detect-watermark): {\"key\": SECRET_INT, \"algorithm\": \"gumbel\" or "
                 "\"dual_key_gumbel\", \"alpha\": 0.1, \"context_width\": 4, \"deduplicate_contexts\": "
                 "\"single_turn\" (or none, all), \"deduplicate_contexts_max_history\": 8192}; a request's "
                 "watermarking false opts out")),
        (("--profiler-config",), "profiler_config", dict(
            default=d["profiler_config"], metavar="JSON",
            help='vLLM\'s: what POST /start_profile and /stop_profile (LLM.start_profile, stop_profile) record, e.g. '
                 '{"profiler": "torch", "torch_profiler_dir": "./traces"}: each worker\'s steps and the server\'s '
                 "frontend as Chrome traces (*.pt.trace.json.gz) plus a table of operators, in that folder; "
                 "\"cuda\": cudaProfilerStart/Stop for nsys. Also torch_profiler_with_stack (default true), "
                 "_record_shapes, _with_memory, _with_flops, _use_gzip, _activities, delay_iterations, "
                 "max_iterations, wait/warmup/active_iterations, ignore_frontend, detailed_trace_annotation")),
        (("--weight-transfer-config",), "weight_transfer_config", dict(
            default=d["weight_transfer_config"], metavar="JSON",
            help='vLLM\'s: let a trainer push new weights into the running engine (RL loops), e.g. '
                 '{"backend": "gloo"} (gloo on any device; "nccl" between CUDA devices) and "timeout_s" (300): '
                 "the routes /init_weight_transfer_engine, /start_weight_update, /update_weights, "
                 "/finish_weight_update (VLLM_SERVER_DEV_MODE=1), LLM.update_weights offline")),
        (("--kv-events-config",), "kv_events_config", dict(
            default=d["kv_events_config"], metavar="JSON",
            help='publish the prefix cache\'s changes as vLLM\'s KV events, for KV-aware routers: a JSON object '
                 'such as {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                 '"topic": "kv"} (vLLM\'s keys; also replay_endpoint, buffer_steps, hwm, max_queue_size)')),
        (("--logits-processors",), "logits_processors", dict(
            nargs="+", default=d["logits_processors"], metavar="CLASS",
            help="batch-level logits processors (vLLM's interface, models/logits_processors.py), as fully "
                 "qualified class names, applied to every step's batch beside those installed packages "
                 "declare as troupe.logits_processors entry points; requests pass them arguments in "
                 "vllm_xargs (SamplingParams.extra_args)")),
        (("--enable-lora",), "enable_lora", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_lora"],
            help="serve LoRA adapters (PEFT format) beside the base model: a request picks one by its model "
                 "field; /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove them")),
        (("--lora-modules",), "lora_modules", dict(
            nargs="+", default=d["lora_modules"], metavar="NAME=PATH",
            help='adapters served from the start: name=path, or a JSON object {"name": ..., "path": ..., '
                 '"base_model_name": ...}')),
        (("--max-loras",), "max_loras", dict(
            type=_positive(int), default=d["max_loras"], metavar="N",
            help="adapters one step may use (the layers' slots); requests of another adapter wait")),
        (("--max-cpu-loras",), "max_cpu_loras", dict(
            type=_positive(int), default=d["max_cpu_loras"], metavar="N",
            help="adapters the worker keeps loaded in host memory (default: --max-loras)")),
        (("--max-lora-rank",), "max_lora_rank", dict(
            type=_positive(int), default=d["max_lora_rank"], metavar="R",
            help="the largest rank an adapter may have (its A and B are padded to it in the slots)")),
        (("--max-model-len",), "max_model_len", dict(type=human_readable_int_or_auto, default=d["max_model_len"],
                                                     help="0, -1 or auto: the model's own, capped to what the "
                                                          "KV cache holds")),
        (("--scheduling-policy",), "scheduling_policy", dict(
            default=d["scheduling_policy"], choices=SCHEDULING_POLICIES,
            help="'priority': requests' priority field orders the queue (lower first)")),
        (("--max-waiting-requests",), "max_waiting_requests", dict(
            type=int, default=d["max_waiting_requests"], metavar="N",
            help="requests queued for the engine beyond which new ones get 503 with Retry-After (0: no bound)")),
        (("--max-waiting-tokens", "--max-num-queued-tokens"), "max_waiting_tokens", dict(
            type=int, default=d["max_waiting_tokens"], metavar="N",
            help="the same bound on their prompt tokens, counted until their prefill is done "
                 "(vLLM's --max-num-queued-tokens) (0: none)")),
        (("--max-num-queued-reqs",), "max_num_queued_reqs", dict(
            type=int, default=d["max_num_queued_reqs"], metavar="N",
            help="vLLM's: requests in flight (waiting or running) beyond which new ones get 503 with "
                 "Retry-After (default: no bound)")),
        (("--threads",), "num_threads", dict(type=int, default=d["num_threads"], metavar="N",
                                             help="worker compute threads (0: all cores)")),
        (("--seed",), "seed", dict(type=int, default=d["seed"])),
        (("--kv-cache-metrics",), "kv_cache_metrics", dict(
            action=argparse.BooleanOptionalAction, default=d["kv_cache_metrics"],
            help="vLLM's: sample KV cache blocks' residency into /metrics' kv_block_lifetime_seconds, "
                 "kv_block_idle_before_evict_seconds and kv_block_reuse_gap_seconds histograms")),
        (("--enable-mfu-metrics",), "enable_mfu_metrics", dict(
            action=argparse.BooleanOptionalAction, default=d["enable_mfu_metrics"],
            help="vLLM's: estimate each step's floating-point operations and bytes read and written per "
                 "device from the model's shape (vllm:estimated_flops_per_gpu_total, "
                 "vllm:estimated_read_bytes_per_gpu_total, vllm:estimated_write_bytes_per_gpu_total on "
                 "/metrics; 'MFU: X TF/s/device Y GB/s/device' in the periodic stats line)")),
        (("--otlp-traces-endpoint",), "otlp_traces_endpoint", dict(
            default=d["otlp_traces_endpoint"], metavar="URL",
            help="vLLM's: export an OpenTelemetry span per request (llm_request, vLLM's attributes) to this "
                 "OTLP collector, over gRPC (http://host:4317) or, with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
                 "http/protobuf, HTTP (http://host:4318/v1/traces); a request's traceparent header puts its "
                 "span in the caller's trace")),
        (("--collect-detailed-traces",), "collect_detailed_traces", dict(
            nargs="+", default=d["collect_detailed_traces"], metavar="{model,worker,all}",
            help="vLLM's (with --otlp-traces-endpoint): each request's span also holds its seconds in the "
                 "model's forward passes (model: gen_ai.latency.time_in_model_forward) and in the workers' "
                 "whole steps (worker: gen_ai.latency.time_in_model_execute); all: both. Every output then "
                 "carries the times, a small cost per step")),
        (("--per-request-spec-decode-metrics",), "per_request_spec_decode_metrics", dict(
            default=d["per_request_spec_decode_metrics"], choices=SPEC_DECODE_METRICS_LEVELS,
            help="vLLM's: with speculative decoding, a one-choice answer's metrics.speculative_decoding "
                 "tells its drafts' acceptance (summary: mean acceptance length, acceptance rate, the "
                 "histogram of drafts accepted per verify step; detailed: also each step's counts in order)")),
        (("--custom-histogram-buckets",), "custom_histogram_buckets", dict(
            default=d["custom_histogram_buckets"], metavar="JSON",
            help="vLLM's: a JSON object of bucket family -> strictly increasing bounds, replacing the "
                 "buckets of that family's /metrics histograms: request_latency (e2e, queue, prefill, "
                 "decode, inference), time_to_first_token, inter_token_latency (and time per output "
                 "token), iteration_tokens, request_params_n, request_tokens (prompt, generation, "
                 "max_tokens), kv_cache_residency, request_num_preemptions (no histogram here)")),
        (("--kv-cache-metrics-sample",), "kv_cache_metrics_sample", dict(
            type=_sample_rate, default=d["kv_cache_metrics_sample"], metavar="FRACTION",
            help="vLLM's: the fraction of blocks --kv-cache-metrics follows, in (0, 1] (default: 0.01)")),
        (("--disable-log-stats",), "disable_log_stats", dict(
            action="store_true", default=d["disable_log_stats"],
            help="no periodic statistics lines (vLLM's: every VLLM_LOG_STATS_INTERVAL seconds, 10, each "
                 "engine core's throughput, requests, KV cache usage, prefix cache hit rate and "
                 "speculative decoding's acceptance)")),
        (("--no-trace",), "trace", dict(action="store_false", default=d["trace"],
                                        help="record no trace spans (the dashboard then shows counters only)")),
        (("--flight-recorder-dir",), "flight_recorder_dir", dict(
            default=d["flight_recorder_dir"], metavar="DIR",
            help="where the last seconds of a process that dies are written as a trace file "
                 "(default: troupe-flight-recorder in the temp dir)")),
    ]


DTYPE_ALIASES = {"half": "float16", "float": "float32"}     # vLLM's other names


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


_HUMAN_INT = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kmgtKMGT]?)")


def human_readable_int(text: str) -> int:
    """vLLM's reading of sizes: an integer, or with a suffix: k, m, g, t are powers of 1000
    (decimals allowed: 25.6k), K, M, G, T powers of 1024 (whole numbers only)."""
    m = _HUMAN_INT.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a number (like 4096, 32k or 2G): {text!r}")
    number, suffix = m.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
        return int(number)
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: K, M, G and T (powers of 1024) take whole numbers")
        return int(number) * 1024 ** power
    return int(round(float(number) * 1000 ** power))


human_readable_int.__name__ = "int"


def human_readable_int_or_auto(text: str) -> int:
    """--max-model-len's (vLLM's): a size as ``human_readable_int`` reads it, or -1 / ``auto``:
    the longest context that fits (here 0, what Troupe does when not told)."""
    if text.strip().lower() in ("auto", "-1"):
        return 0
    return human_readable_int(text)


human_readable_int_or_auto.__name__ = "int"


def _context_len(value: int | str | None) -> int:
    """An offline max_model_len as vLLM takes it: None, -1 or "auto" mean the model's own (0)."""
    if value is None or value == -1 or (isinstance(value, str) and value.strip().lower() == "auto"):
        return 0
    return human_readable_int(value) if isinstance(value, str) else value


SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")
DETAILED_TRACE_MODULES = ("model", "worker", "all")


def detailed_trace_modules(given: list[str] | str | None) -> tuple[str, ...]:
    """vLLM's --collect-detailed-traces values (each may be comma-separated) as a tuple."""
    if not given:
        return ()
    names = tuple(n.strip() for part in ([given] if isinstance(given, str) else given)
                  for n in part.split(",") if n.strip())
    bad = [n for n in names if n not in DETAILED_TRACE_MODULES]
    if bad:
        raise ValueError(f"--collect-detailed-traces: {', '.join(map(repr, bad))} is not one of "
                         f"{', '.join(DETAILED_TRACE_MODULES)}")
    return names


def _watermark(text: str) -> float:
    """vLLM's --watermark: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"the watermark is a fraction of the KV cache's blocks in [0, 1), got {value}")
    return value


_watermark.__name__ = "watermark"


def _sample_rate(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_sample_rate.__name__ = "sample rate"


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


_fraction.__name__ = "float"


def _step_latency(text: str) -> float | str:
    """--max-step-latency-ms: milliseconds (0: off), or 'auto'."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes milliseconds or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0 (0: off), got {text}")
    return value


def at_least(kind: type, low: float, strict: bool = False) -> Any:
    """An argparse type: ``kind`` of at least ``low`` (more than it when ``strict``)."""
    def parse(text: str) -> Any:
        value = kind(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be positive, got {text}" if strict and low == 0
                                             else f"must be at least {low}, got {text}")
        return value
    parse.__name__ = kind.__name__        # argparse names the type in its error messages
    return parse


def _positive(kind: type) -> Any:
    return at_least(kind, 0, strict=True)


AsyncEngineArgs = EngineArgs      # vLLM's name for the same arguments of its AsyncLLM
