"""vLLM's --profiler-config: what ``/start_profile`` and ``/stop_profile`` (``LLM.start_profile``,
``LLM.stop_profile``) record. ``profiler: "torch"`` runs PyTorch's profiler in every worker
(the steps between the two calls: torch's operators, and with ``torch_profiler_with_stack`` every
Python function, so the native kernels show under the calls that make them) and in the server's
frontend process, each writing a Chrome trace (``*.pt.trace.json.gz``, Perfetto opens it) and a
table of the most expensive operators into ``torch_profiler_dir``; ``"cuda"`` brackets the steps
with cudaProfilerStart/Stop for an outside profiler (``nsys profile --capture-range=cudaProfilerApi``).
vLLM's field names, defaults and checks; Triton's Proton profiler is not one Troupe runs.
Parsed without torch (the engine core reads it); actors/worker/profiler.py does the recording."""
from __future__ import annotations

import os
from typing import Any, Mapping

import msgspec

from actors.engine.json_flags import checked_fields, convert, parse_object

PROFILERS = ("torch", "cuda")
ACTIVITIES = ("CPU", "CUDA")
WHAT = "profiler config"
_PROTON_DEFAULTS = {"proton_profiler_dir": "", "proton_context": "shadow", "proton_data": "tree",
                    "proton_backend": None, "proton_mode": None, "proton_hook": None,
                    "proton_output_format": None, "proton_graph_attribution": False}


class ProfilerConfig(msgspec.Struct, frozen=True, kw_only=True):
    profiler: str | None = None                      # None: /start_profile does not exist
    torch_profiler_dir: str = ""                     # where the traces go (made absolute)
    torch_profiler_activities: list[str] | None = None   # None: CPU, and CUDA on a GPU
    torch_profiler_with_stack: bool = True           # Python functions recorded, with their stacks
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True     # the operator table sorted by device time
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    detailed_trace_annotation: bool = False          # each step's label also gives its attention sizes
    ignore_frontend: bool = False                    # the server's frontend process not profiled
    delay_iterations: int = 0                        # steps a worker lets pass before recording
    max_iterations: int = 0                          # steps recorded before stopping by itself (0: no limit)
    warmup_iterations: int = 0                       # torch's schedule: steps run but not kept ...
    active_iterations: int = 5                       # ... then steps kept (with warm-up or wait only)
    wait_iterations: int = 0                         # ... after steps not profiled at all

    def __post_init__(self) -> None:
        for name in ("delay_iterations", "max_iterations", "warmup_iterations", "wait_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be greater than or equal to 0")
        if self.active_iterations < 1:
            raise ValueError("active_iterations must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @property
    def uses_schedule(self) -> bool:
        return self.warmup_iterations > 0 or self.wait_iterations > 0

    @property
    def profiles_frontend(self) -> bool:
        """vLLM's should_profile_frontend: the torch profiler, recording the CPU, not told otherwise."""
        activities = self.torch_profiler_activities
        return self.profiler == "torch" and not self.ignore_frontend and (activities is None or "CPU" in activities)


def profiler_config(value: ProfilerConfig | Mapping[str, Any] | str | None) -> ProfilerConfig:
    """--profiler-config (JSON text) or the offline API's dict, checked as vLLM checks it;
    ValueError naming what is wrong."""
    if value is None:
        return ProfilerConfig()
    if isinstance(value, ProfilerConfig):
        return value
    raw = parse_object(value, "--profiler-config") if isinstance(value, str) else value
    if not isinstance(raw, Mapping):
        raise ValueError(f"the {WHAT} must be a JSON object, got {type(raw).__name__}")
    raw = dict(raw)
    if raw.get("profiler") == "proton":
        raise ValueError("--profiler-config: profiler 'proton' (Triton's Proton) is not one Troupe runs; "
                         "use 'torch' (traces of the workers and the frontend) or 'cuda'")
    proton = sorted(k for k, default in _PROTON_DEFAULTS.items() if k in raw and raw[k] != default)
    if proton:
        raise ValueError(f"--profiler-config: {', '.join(proton)} only applicable when profiler is set to 'proton'")
    if raw.get("capture_torch_profiler"):
        raise ValueError("--profiler-config: capture_torch_profiler (profiling the CUDA graphs' capture) "
                         "is not implemented")
    for k in (*_PROTON_DEFAULTS, "capture_torch_profiler"):
        raw.pop(k, None)
    fields = checked_fields(ProfilerConfig, raw, WHAT)
    kind = fields.get("profiler")
    if kind is not None and kind not in PROFILERS:
        raise ValueError(f"--profiler-config: profiler must be one of {', '.join(PROFILERS)}, got {kind!r}")
    activities = fields.get("torch_profiler_activities")
    if activities is not None:
        if kind != "torch":
            raise ValueError("torch_profiler_activities is only applicable when profiler is set to 'torch'")
        if not isinstance(activities, list) or not activities:
            raise ValueError("torch_profiler_activities must be a non-empty list")
        bad = [a for a in activities if a not in ACTIVITIES]
        if bad:
            raise ValueError(f"torch_profiler_activities: {bad[0]!r} is not one of {', '.join(ACTIVITIES)}")
        if len(activities) != len(set(activities)):
            raise ValueError("torch_profiler_activities must not contain duplicates")
    folder = fields.get("torch_profiler_dir", "")
    if folder and kind != "torch":
        raise ValueError("torch_profiler_dir is only applicable when profiler is set to 'torch'")
    if kind == "torch" and not folder:
        raise ValueError("torch_profiler_dir must be set when profiler is 'torch'")
    if folder:
        if "://" in folder:
            raise ValueError(f"torch_profiler_dir must be a local folder, got {folder!r}")
        fields["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(folder))
    return convert(ProfilerConfig, fields, WHAT)


def check_prefix(prefix: str | None) -> None:
    """vLLM's rule for a session's trace-name prefix: 1-128 ASCII letters, digits, '.', '_' or
    '-', starting with a letter or digit."""
    if prefix is None:
        return
    if (not isinstance(prefix, str) or not 1 <= len(prefix) <= 128 or not prefix.isascii()
            or not prefix[0].isalnum() or any(not (c.isalnum() or c in "._-") for c in prefix[1:])):
        raise ValueError("profile_prefix must be 1-128 ASCII characters, start with a letter "
                         "or number, and contain only letters, numbers, '.', '_', or '-'")


def check_bounds(delay_iterations: int | None, max_iterations: int | None) -> None:
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value is not None and value < 0:
            raise ValueError(f"{name} must be greater than or equal to 0")
