"""CompilationConfig: how the worker runs the model's forward (vLLM's ``--compilation-config``
and its ``-O`` shorthand), parsed and validated at the edge.

Levels (``level``, or vLLM's newer name ``mode``):

    0  eager, the layers as plain torch ops (no custom kernels): the reference path
    1  eager with the custom ops (torch.ops.troupe.*: the native C kernels on the CPU, Triton on
       GPUs); the default, what the engine did before it had levels
    2  level 1 with torch.compile (inductor) of the pieces between attention calls: attention
       is the splitting op, left out of the graphs; linear layers stay torch's (not packed for
       the native matmuls, whose ctypes calls dynamo cannot trace)
    3  level 2 with the elementwise custom ops left to inductor (the plain torch forms), so it
       fuses them with their neighbours (the residual add into the norm, SiLU into the product,
       on GPUs an 8-bit layer's per-token activation quantization into the norm before it: vLLM's
       RMSNorm + quant fusion); casts to 16-bit types round inside fused kernels as they do eagerly

``-O3`` is ``--compilation-config '{"level": 3}'``; ``--compilation-config`` also takes the
level alone. ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size`` (the sizes the worker
picks stop there; larger decode batches run eagerly) and ``cudagraph_mode`` ("NONE" or
"FULL_DECODE_ONLY": whole decode steps, what CUDA graphs capture here) steer the CUDA graphs.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

LEVELS = (0, 1, 2, 3)
DEFAULT_LEVEL = 1
CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")
SPLITTING_OPS = ("troupe.attention",)          # the only op the graphs are split at
FIELDS = ("level", "mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "cudagraph_mode",
          "splitting_ops", "cache_dir")


class CompilationConfig(msgspec.Struct, frozen=True, kw_only=True):
    level: int = DEFAULT_LEVEL
    cudagraph_capture_sizes: tuple[int, ...] | None = None   # None: the worker's own sizes
    max_cudagraph_capture_size: int | None = None   # the largest decode batch with a graph (None: max_num_seqs)
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    splitting_ops: tuple[str, ...] = SPLITTING_OPS
    cache_dir: str = ""                   # compiled artifacts ("": $TROUPE_CACHE_DIR or ~/.cache/troupe)

    @property
    def compiles(self) -> bool:
        return self.level >= 2

    @property
    def custom_ops(self) -> bool:
        """Whether the layers call the custom kernels (levels 1 and 2)."""
        return self.level in (1, 2)


def compilation_config(value: CompilationConfig | dict[str, Any] | str | int | None) -> CompilationConfig:
    """--compilation-config (JSON text or a level digit), -O's level, or the offline API's dict."""
    if value is None:
        return CompilationConfig()
    if isinstance(value, CompilationConfig):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compilation-config takes a level (0-3) or a JSON object, got {text!r}: {e}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"level": value}
    if not isinstance(value, dict):
        raise ValueError(f"--compilation-config takes a level (0-3) or a JSON object, got {value!r}")
    unknown = set(value) - set(FIELDS)
    if unknown:
        raise ValueError(f"--compilation-config: unknown field(s) {sorted(unknown)}; accepted: {', '.join(FIELDS)}")
    fields = dict(value)
    if "mode" in fields:
        mode = fields.pop("mode")
        if "level" in fields and fields["level"] != mode:
            raise ValueError(f"--compilation-config: level {fields['level']} and mode {mode} disagree")
        fields["level"] = mode
    level = fields.get("level", DEFAULT_LEVEL)
    if level not in LEVELS or isinstance(level, bool):
        raise ValueError(f"--compilation-config: level must be one of {LEVELS}, got {level!r}")
    mode = fields.get("cudagraph_mode", "FULL_DECODE_ONLY")
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"--compilation-config: cudagraph_mode {mode!r} is not supported; supported: "
                         f"{', '.join(CUDAGRAPH_MODES)} (decode steps are captured whole)")
    sizes = fields.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(isinstance(s, int) and s > 0 for s in sizes):
            raise ValueError(f"--compilation-config: cudagraph_capture_sizes must be a list of positive "
                             f"integers, got {sizes!r}")
        fields["cudagraph_capture_sizes"] = tuple(sorted(set(sizes)))
    largest = fields.get("max_cudagraph_capture_size")
    if largest is not None:
        if not isinstance(largest, int) or isinstance(largest, bool) or largest < 1:
            raise ValueError(f"--compilation-config: max_cudagraph_capture_size must be a positive integer, "
                             f"got {largest!r}")
        if sizes is not None and largest != max(sizes):
            raise ValueError(f"--compilation-config: max_cudagraph_capture_size {largest} is not the largest of "
                             f"cudagraph_capture_sizes {sorted(set(sizes))}")
    ops = fields.get("splitting_ops")
    if ops is not None:
        if not isinstance(ops, list) or set(ops) - set(SPLITTING_OPS) or not ops:
            raise ValueError(f"--compilation-config: splitting_ops {ops!r} is not supported; the graphs are "
                             f"split at attention: {list(SPLITTING_OPS)}")
        fields["splitting_ops"] = tuple(ops)
    return CompilationConfig(**fields)


def with_graph_flags(config: CompilationConfig, sizes: list[int] | None, largest: int | None) -> CompilationConfig:
    """vLLM's --cudagraph-capture-sizes and --max-cudagraph-capture-size, the compilation
    config's fields of those names given as flags of their own (not both ways: vLLM refuses that)."""
    fields: dict[str, Any] = {k: v for k, v in msgspec.structs.asdict(config).items()}
    for flag, name, value in (("--cudagraph-capture-sizes", "cudagraph_capture_sizes", sizes),
                              ("--max-cudagraph-capture-size", "max_cudagraph_capture_size", largest)):
        if value is None:
            continue
        if fields[name] is not None:
            raise ValueError(f"{flag} and --compilation-config's {name} are mutually exclusive")
        fields[name] = list(value) if isinstance(value, (list, tuple)) else value
    if fields["cudagraph_capture_sizes"] is not None:
        fields["cudagraph_capture_sizes"] = list(fields["cudagraph_capture_sizes"])
    fields["splitting_ops"] = list(fields["splitting_ops"])
    return compilation_config(fields)
