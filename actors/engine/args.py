"""EngineArgs: the engine's options as one flat list, shared by the command line
(``python -m tools.serve`` and the benchmarks: ``add_cli_args``) and the offline API
(``LLM(**options)``), and turned into the composed ``EngineConfig`` in one place
(``create_engine_config``)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from actors.engine.config import (DEVICES, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS,
                                  SCHEDULING_POLICIES, CacheConfig, DeviceConfig, EngineConfig,
                                  ModelConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig)
from actors.engine.sampling_params import LOGPROBS_MODES
from models.resolve import resolve_model


@dataclasses.dataclass(slots=True, kw_only=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    enforce_eager: bool = False
    quantization: str | None = None
    logprobs_mode: str = "raw_logprobs"
    chat_template: str | None = None
    seed: int = 0
    max_model_len: int = 0
    block_size: int = 16
    kv_cache_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 0
    max_waiting_tokens: int = 0
    num_threads: int = 0
    multiprocess: bool = True
    max_restarts: int = 3
    restart_window_s: float = 120.0
    trace: bool = True
    flight_recorder_dir: str = ""

    @classmethod
    def from_options(cls, model: str | None, options: dict[str, Any]) -> EngineArgs:
        """The offline API's keyword options; an unknown one is a TypeError listing them all."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(options) - names
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; accepted: {sorted(names)}")
        return cls(model=model, **options)

    def create_engine_config(self) -> EngineConfig:
        """The composed config; resolves the model's source (fails fast, naming the package to
        install, when the model is not on this machine)."""
        return EngineConfig(
            model=ModelConfig(source=resolve_model(self.model), dtype=self.dtype,
                              quantization=self.quantization, max_model_len=self.max_model_len,
                              seed=self.seed, enforce_eager=self.enforce_eager,
                              logprobs_mode=self.logprobs_mode,
                              chat_template=load_chat_template(self.chat_template)),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_bytes,
                              cache_dtype=self.kv_cache_dtype, calculate_kv_scales=self.calculate_kv_scales,
                              enable_prefix_caching=self.enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      long_prefill_token_threshold=self.long_prefill_token_threshold,
                                      policy=self.scheduling_policy,
                                      max_waiting_requests=self.max_waiting_requests,
                                      max_waiting_tokens=self.max_waiting_tokens),
            parallel=ParallelConfig(multiprocess=self.multiprocess, max_restarts=self.max_restarts,
                                    restart_window_s=self.restart_window_s),
            device=DeviceConfig(device=self.device, num_threads=self.num_threads),
            observability=ObservabilityConfig(trace=self.trace, flight_recorder_dir=self.flight_recorder_dir))

    # -- the command line --------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: Any) -> None:
        """The engine's flags; ``defaults`` overrides a flag's default by its dest name, ``skip``
        leaves out flags (by dest name) the caller's parser already has."""
        d = {f.name: f.default for f in dataclasses.fields(EngineArgs)} | defaults
        for flag, dest, options in _cli_flags(d):
            if dest not in skip:
                p.add_argument(flag, dest=dest, **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in vars(args).items() if k in names}
        given["kv_cache_bytes"] = int(given["kv_cache_bytes"] * 2**30)   # the flag is in GiB
        return cls(**(given | overrides))


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


def _cli_flags(d: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(flag, dest, argparse options) of every engine flag, with defaults from ``d``."""
    return [
        ("--model", "model", dict(default=d["model"], help="model name, .gguf path or checkpoint dir "
                                  "(default: HuggingFaceTB/SmolLM2-135M-Instruct)")),
        ("--dtype", "dtype", dict(default=d["dtype"], choices=DTYPES,
                                  help="auto: float32 on the CPU, bfloat16 on a GPU")),
        ("--device", "device", dict(default=d["device"], choices=DEVICES,
                                    help="auto: a CUDA GPU when one is present, else the CPU")),
        ("--enforce-eager", "enforce_eager", dict(action="store_true", default=d["enforce_eager"],
                                                  help="never capture CUDA graphs (GPU only; for debugging)")),
        ("--quantization", "quantization", dict(
            default=d["quantization"], choices=QUANTIZATIONS,
            help="'gguf': the checkpoint's GGUF Q4_1/Q8_0 blocks run natively with float32 activations "
                 "(same weights, faster decoding); 'gguf-i8': Q4_1 layers also take int8 activations in "
                 "two parts (AVX512-VNNI; faster prefill, rare token changes)")),
        ("--logprobs-mode", "logprobs_mode", dict(
            default=d["logprobs_mode"], choices=LOGPROBS_MODES,
            help="what returned log-probs are: the model's own (raw_*) or those sampled from, after "
                 "penalties, temperature and truncation (processed_*); log-probs or logits")),
        ("--chat-template", "chat_template", dict(
            default=d["chat_template"], metavar="FILE_OR_TEMPLATE",
            help="a Jinja chat template (a file, or the template itself) used instead of the model's")),
        ("--kv-cache-gib", "kv_cache_bytes", dict(type=_positive(float), default=d["kv_cache_bytes"] / 2**30,
                                                  metavar="GIB", help="memory for the KV cache")),
        ("--kv-cache-dtype", "kv_cache_dtype", dict(
            default=d["kv_cache_dtype"], choices=KV_CACHE_DTYPES,
            help="auto: the model's dtype; float16 / bfloat16 store K and V rounded to 16 bits (twice the "
                 "tokens per GiB, half the bytes long-context decoding reads); fp8 (= fp8_e4m3) / fp8_e5m2 "
                 "store them as 8-bit floats with a scale per layer (four times float32's tokens per GiB)")),
        ("--calculate-kv-scales", "calculate_kv_scales", dict(
            action="store_true", default=d["calculate_kv_scales"],
            help="with an fp8 KV cache: each layer's K and V scales from the first batch's largest "
                 "magnitudes (amax / the format's max), instead of 1.0")),
        ("--block-size", "block_size", dict(type=_positive(int), default=d["block_size"])),
        ("--max-num-seqs", "max_num_seqs", dict(type=_positive(int), default=d["max_num_seqs"])),
        ("--max-num-batched-tokens", "max_num_batched_tokens",
         dict(type=_positive(int), default=d["max_num_batched_tokens"])),
        ("--max-model-len", "max_model_len", dict(type=int, default=d["max_model_len"], help="0: the model's own")),
        ("--scheduling-policy", "scheduling_policy", dict(
            default=d["scheduling_policy"], choices=SCHEDULING_POLICIES,
            help="'priority': requests' priority field orders the queue (lower first)")),
        ("--max-waiting-requests", "max_waiting_requests", dict(
            type=int, default=d["max_waiting_requests"], metavar="N",
            help="requests queued for the engine beyond which new ones get 503 with Retry-After (0: no bound)")),
        ("--max-waiting-tokens", "max_waiting_tokens", dict(
            type=int, default=d["max_waiting_tokens"], metavar="N",
            help="the same bound on their prompt tokens (0: none)")),
        ("--threads", "num_threads", dict(type=int, default=d["num_threads"], metavar="N",
                                          help="worker compute threads (0: all cores)")),
        ("--seed", "seed", dict(type=int, default=d["seed"])),
        ("--no-trace", "trace", dict(action="store_false", default=d["trace"],
                                     help="record no trace spans (the dashboard then shows counters only)")),
        ("--flight-recorder-dir", "flight_recorder_dir", dict(
            default=d["flight_recorder_dir"], metavar="DIR",
            help="where the last seconds of a process that dies are written as a trace file "
                 "(default: troupe-flight-recorder in the temp dir)")),
    ]


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__        # argparse names the type in its error messages
    return parse
