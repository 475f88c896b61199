"""The flags (and offline ``LLM(...)`` keywords) of vLLM that Troupe does not implement, or that
ask for what Troupe always does, in one place: ``tools/vllm_flags.py`` applies them to
``troupe serve``'s command line, ``offline_option`` to the offline API's keywords."""
from __future__ import annotations

from typing import Any

_PARALLEL = ("Troupe implements tensor, pipeline and data parallelism (--tensor-parallel-size, "
             "--pipeline-parallel-size, --data-parallel-size), across machines with --distributed-executor-backend ray, "
             "--nnodes or --headless")
_LOADING = "Troupe loads local GGUF files and Hugging Face checkpoint directories as they are"
_MODALITY = ("Troupe takes images (and Qwen2-VL's videos) with --limit-mm-per-prompt, --mm-processor-kwargs, "
             "--mm-processor-cache-gb, --enable-mm-embeds, --media-io-kwargs, --allowed-local-media-path and "
             "--allowed-media-domains only")
_LORA = "Troupe's LoRA takes --enable-lora, --lora-modules, --max-loras, --max-cpu-loras and --max-lora-rank only"
_SPEC = "Troupe takes speculative decoding as --speculative-config JSON only"
_COMPILE = ("Troupe takes the CUDA graph sizes as --cudagraph-capture-sizes or --max-cudagraph-capture-size "
            "(or in --compilation-config); --enforce-eager turns the graphs off")
_HTTP = "Troupe's HTTP server has no such option"
_KV = "Troupe keeps the KV cache on one device, in blocks of one layout"
_HYBRID = ("Troupe keeps a Mamba layer's state per request in the worker, its convolution inputs in the model's "
           "dtype and its state-space state in float32, and computes it again after a preemption (no prefix "
           "caching of states)")
_SCHED = "Troupe's scheduler has no such option"
_LOGS = "Troupe has no such logging option (see --enable-log-requests, /metrics, /debug/*)"
_STRUCT = "Troupe's structured outputs always use xgrammar"

# long flag -> why Troupe does not implement it
REFUSED: dict[str, str] = {
    # parallelism and distribution
    "--decode-context-parallel-size": _PARALLEL,
    "--all2all-backend": _PARALLEL, "--enable-dbo": _PARALLEL, "--dbo-decode-token-threshold": _PARALLEL,
    "--dbo-prefill-token-threshold": _PARALLEL, "--disable-nccl-for-dp-synchronization": _PARALLEL,
    "--enable-eplb": _PARALLEL, "--eplb-config": _PARALLEL, "--expert-placement-strategy": _PARALLEL,
    "--num-redundant-experts": _PARALLEL, "--eplb-window-size": _PARALLEL,
    "--eplb-step-interval": _PARALLEL, "--eplb-log-balancedness": _PARALLEL,
    "--max-parallel-loading-workers": _PARALLEL, "--ray-workers-use-nsight": _PARALLEL,
    "--disable-custom-all-reduce": _PARALLEL, "--worker-cls": _PARALLEL,
    "--enable-multimodal-encoder-data-parallel": _PARALLEL,
    "--disable-frontend-multiprocessing": "Troupe's engine always runs in a process of its own",
    # loading the model
    "--tokenizer-revision": _LOADING, "--revision": _LOADING,
    "--code-revision": _LOADING, "--hf-config-path": _LOADING, "--hf-token": "Troupe never downloads",
    "--download-dir": "Troupe never downloads",
    "--safetensors-load-strategy": _LOADING, "--model-loader-extra-config": _LOADING,
    "--ignore-patterns": _LOADING, "--use-tqdm-on-load": _LOADING, "--pt-load-map-location": _LOADING,
    "--rope-scaling": _LOADING, "--rope-theta": _LOADING, "--override-attention-dtype": _LOADING,
    "--max-seq-len-to-capture": _COMPILE,
    "--quantization-param-path": _LOADING,
    # what the model is run for
    "--task": "vLLM's old name: give --runner pooling (and --convert embed) for an embedding model",
    "--override-pooler-config": "vLLM's old name: give --pooler-config",
    "--io-processor-plugin": "Troupe loads no IO processor plugins",
    "--logits-processor-pattern": "Troupe has no per-request logits processors (see --logits-processors)",
    # other modalities
    "--disable-mm-preprocessor-cache": _MODALITY, "--mm-processor-cache-type": _MODALITY,
    "--mm-shm-cache-max-object-size-mb": _MODALITY, "--mm-encoder-tp-mode": _MODALITY,
    "--mm-encoder-attn-backend": _MODALITY, "--interleave-mm-strings": _MODALITY,
    "--skip-mm-profiling": _MODALITY, "--video-pruning-rate": _MODALITY,
        # adapters and speculative decoding
    "--lora-extra-vocab-size": _LORA, "--lora-dtype": _LORA, "--fully-sharded-loras": _LORA, "--default-mm-loras": _LORA, "--enable-prompt-adapter": _LORA,
    "--prompt-adapters": _LORA, "--max-prompt-adapters": _LORA, "--max-prompt-adapter-token": _LORA,
    "--speculative-model": _SPEC, "--num-speculative-tokens": _SPEC,
    # the KV cache
    "--swap-space": _KV, "--cpu-offload-gb": _KV,
    "--kv-sharing-fast-prefill": _KV, "--mamba-cache-dtype": _HYBRID, "--mamba-block-size": _HYBRID,
    "--kv-offloading-size": _KV, "--kv-offloading-backend": _KV,
    # the scheduler and compilation
    "--num-lookahead-slots": _SCHED, "--scheduler-cls": _SCHED,
    "--num-scheduler-steps": _SCHED,
    "--preemption-mode": "Troupe preempts by recomputing (no swapping)", "--scheduler-delay-factor": _SCHED,
    "--cuda-graph-sizes": _COMPILE, "--additional-config": "Troupe's platforms take no additional config",
    # structured outputs and reasoning
    "--enable-reasoning": "vLLM's older spelling: --reasoning-parser alone turns reasoning on",
    "--guided-decoding-backend": _STRUCT, "--guided-decoding-disable-fallback": _STRUCT,
    "--guided-decoding-disable-any-whitespace": _STRUCT,
    "--guided-decoding-disable-additional-properties": _STRUCT,
    # observability
    "--show-hidden-metrics-for-version": "Troupe shows every metric it has (see /metrics)",
    "--aggregate-engine-logging": _PARALLEL,
    # the HTTP frontend
    "--tool-server": "Troupe runs no built-in tools",
    "--h11-max-incomplete-event-size": _HTTP,
    "--h11-max-header-count": _HTTP,
}

# vLLM 0.32's other flags, by what they are about
_KERNELS = "Troupe picks its own kernels (the native C kernels on the CPU, its Triton kernels on GPUs)"
_METRICS = "Troupe has no such metrics or tracing option (see /metrics, /debug/* and --no-trace)"
_SLEEP = "Troupe's sleep mode (--enable-sleep-mode) has no such option"
for _flags, _why in (
    (("--cp-kv-cache-interleave-size", "--cpu-distributed-timeout-seconds", "--data-parallel-multi-port-external-lb",
      "--data-parallel-supervisor-port", "--dcp-comm-backend", "--dcp-kv-cache-interleave-size", "--dcp-q-replicate",
      "--distributed-timeout-seconds", "--dp-supervisor-probe-failure-threshold", "--dp-supervisor-probe-interval-s",
      "--dp-supervisor-probe-timeout-s", "--dp-sync-interval", "--elastic-ep-max-dp-size", "--enable-elastic-ep",
      "--enable-ep-weight-filter", "--enable-nccl-comm-suspend", "--prefill-context-parallel-size", "--ubatch-size",
      "--enable-hc-sp", "--enable-batch-sharded-sampling", "--enable-fault-tolerance", "--fault-tolerance-config",
      "--device-ids", "--numa-bind", "--numa-bind-cpus", "--numa-bind-nodes"), _PARALLEL),
    (("--attention-backend", "--attention-config", "--kernel-config", "--linear-backend", "--moe-backend",
      "--gdn-prefill-backend", "--kda-decode-backend", "--kda-prefill-backend", "--sparse-indexer-topk-backend",
      "--ir-op-priority", "--enable-flashinfer-autotune", "--enable-flash-late-interaction", "--performance-mode",
      "--use-fp64-gumbel", "--enable-cumem-allocator", "--enable-shm-tensor-arena"), _KERNELS),
    (("--mamba-backend", "--mamba-ssu-algorithm", "--mamba-cache-mode", "--mamba-cache-philox-rounds",
      "--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint", "--use-replayssm",
      "--replayssm-buffer-len", "--swa-bounded-replay"), _HYBRID),
    (("--mm-device-do-normalize", "--mm-encoder-attn-dtype", "--mm-encoder-fp8-scale-path",
      "--mm-encoder-fp8-scale-save-margin", "--mm-encoder-fp8-scale-save-path", "--mm-encoder-only",
      "--mm-hasher-algorithm", "--mm-ipc-gpu-memory-gb", "--mm-processor-device", "--mm-tensor-ipc",
      "--video-pruning-method", "--trust-request-mm-kwargs", "--ec-manager-config",
      "--ec-transfer-config", "--enable-tower-connector-lora", "--diffusion-config", "--aux-output-config"), _MODALITY),
    (("--allow-deprecated-quantization", "--quantization-config", "--model-class-overrides", "--engram-config",
      "--safetensors-prefetch-block-size", "--safetensors-prefetch-num-threads", "--offload-backend",
      "--offload-group-size", "--offload-num-in-group", "--offload-params", "--offload-prefetch-step",
      "--cpu-offload-params"), _LOADING),
    (("--lora-target-modules", "--max-lora-cls-labels", "--enable-mixed-moe-lora-format", "--enable-moe-shared-loras",
      "--specialize-active-lora"), _LORA),
    (("--cudagraph-metrics",
      "--enable-layerwise-nvtx-tracing", "--enable-trace-replay",
      "--jit-monitor-mode", "--jit-monitor-verbose", "--fail-on-environ-validation"), _METRICS),
    (("--enable-logging-iteration-details", "--logging-config"), _LOGS),
    (("--grpc", "--grpc-port", "--enable-offline-docs", "--renderer-num-workers",
      "--anthropic-disabled-thinking-effort",
      "--cohere-format", "--cohere-is-reasoning-model"), _HTTP),
    (("--prefill-schedule-interval",), _SCHED),
    (("--prefix-cache-retention-interval", "--prefix-match-unit", "--kv-cache-dtype-skip-layers",
      "--enable-return-routed-experts"), _KV),
    (("--sleep-mode-offload-cudagraph", "--sleep-preserve-parameter-names"), _SLEEP),
):
    REFUSED.update(dict.fromkeys(_flags, _why))
del _flags, _why

# vLLM's short forms
ALIASES: dict[str, str] = {
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-dpm": "--data-parallel-multi-port-external-lb", "-ac": "--attention-config", "-dc": "--diffusion-config",
}

# Refused flags that are booleans in vLLM: their --no- form asks for what Troupe does.
BOOLEAN = frozenset({
    "--enable-dbo",
    "--disable-nccl-for-dp-synchronization", "--enable-eplb", "--eplb-log-balancedness",
    "--ray-workers-use-nsight", "--disable-custom-all-reduce", "--disable-frontend-multiprocessing",
    "--use-tqdm-on-load",
    "--interleave-mm-strings",
    "--skip-mm-profiling", "--fully-sharded-loras",
    "--kv-sharing-fast-prefill",
    # vLLM 0.32's
    "--allow-deprecated-quantization", "--cohere-is-reasoning-model", "--cudagraph-metrics", "--dcp-q-replicate",
    "--enable-batch-sharded-sampling", "--enable-cumem-allocator", "--enable-elastic-ep", "--enable-ep-weight-filter",
    "--enable-fault-tolerance", "--enable-flash-late-interaction", "--enable-flashinfer-autotune", "--enable-hc-sp",
    "--enable-layerwise-nvtx-tracing", "--enable-logging-iteration-details",
    "--enable-mamba-cache-stochastic-rounding", "--enable-mamba-shared-prefix-checkpoint",
    "--enable-mixed-moe-lora-format", "--enable-moe-shared-loras", "--enable-nccl-comm-suspend",
    "--enable-offline-docs", "--enable-return-routed-experts",
    "--enable-shm-tensor-arena", "--enable-tower-connector-lora", "--enable-trace-replay",
    "--fail-on-environ-validation", "--jit-monitor-verbose",
    "--mm-device-do-normalize", "--mm-encoder-only", "--numa-bind",
    "--sleep-mode-offload-cudagraph",
    "--specialize-active-lora", "--swa-bounded-replay", "--trust-request-mm-kwargs", "--use-fp64-gumbel",
    "--use-replayssm",
})

# vLLM flags whose values name what Troupe does (accepted, changing nothing) or something else
# (refused, naming the value): flag -> (the values accepted, why the others are refused)
VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "--tokenizer-mode": (("auto", "hf"), "Troupe reads tokenizers with Hugging Face's tokenizers library "
                                         "(tokenizer.json, or a GGUF file's vocabulary)"),
    "--config-format": (("auto", "hf"), "Troupe reads Hugging Face config.json files and GGUF metadata"),
    "--mamba-ssm-cache-dtype": (("float32",), "Troupe keeps a state-space layer's recurrent state in float32"),
}

# vLLM flags that ask for what Troupe always does: accepted, changing nothing.
ALWAYS: dict[str, str] = {
    "--disable-uvicorn-access-log": "Troupe writes no access log",
    "--disable-fastapi-docs": "Troupe serves no API documentation pages",
    "--enable-request-id-headers": "Troupe always answers with an X-Request-Id header",
    "--enable-server-load-tracking": "Troupe always counts the requests being answered (GET /load)",
    "--enable-prompt-tokens-details": "Troupe reports prompt_tokens_details.cached_tokens whenever the "
                                      "prefix cache served part of a prompt",
}
NEVER: dict[str, str] = {    # the opposite of an ALWAYS flag: refused
    "--no-disable-uvicorn-access-log": "Troupe writes no access log",
    "--no-disable-fastapi-docs": "Troupe serves no API documentation pages",
    "--no-enable-request-id-headers": "Troupe always answers with an X-Request-Id header",
    "--no-enable-server-load-tracking": "Troupe always counts the requests being answered (GET /load)",
    "--no-enable-prompt-tokens-details": "Troupe reports prompt_tokens_details.cached_tokens whenever the "
                                         "prefix cache served part of a prompt",
}

# vLLM offline keywords (LLM(...), EngineArgs) that are no flag of Troupe's server and ask for
# what Troupe does anyway: accepted, changing nothing
OFFLINE_ALWAYS: dict[str, str] = {
    "trust_remote_code": "Troupe runs no code from checkpoints",
}


def offline_option(name: str, value: Any) -> str | None:
    """A keyword of vLLM's ``LLM(...)`` that is no engine option here, given ``value``: None when
    it asks for what Troupe does (accepted, it changes nothing); otherwise why not, in one line
    naming it (as the server refuses the flag). KeyError when vLLM has no such option either."""
    flag = "--" + name.replace("_", "-")
    if name in OFFLINE_ALWAYS:
        return None
    if flag in ALWAYS:
        never = "--no-" + flag[2:]
        if value is False and never in NEVER:
            return f"{name}=False is a vLLM setting Troupe does not implement: {NEVER[never]}"
        return None
    if flag in VALUES:
        accepted, reason = VALUES[flag]
        if value is None or str(value) in accepted:
            return None
        return (f"{name}={value!r} is a vLLM setting Troupe does not implement: {reason} "
                f"({name}={' or '.join(map(repr, accepted))})")
    if flag in REFUSED:
        if value is None or (value is False and flag in BOOLEAN):
            return None                      # unset, or the --no- form: what Troupe does
        return f"{name} is a vLLM option Troupe does not implement: {REFUSED[flag]}"
    raise KeyError(name)
