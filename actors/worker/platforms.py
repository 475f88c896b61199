"""Platforms: what the worker asks of the device it runs on (vLLM's ``Platform`` classes) instead
of testing torch itself: whether the device is there, the dtypes and KV cache dtypes it runs, the
attention backends to try in order, whether decode steps replay CUDA graphs, whether linear
layers are packed for the native CPU kernels, whether host buffers are pinned.

A package may provide its own through a ``troupe.platform_plugins`` entry point: a callable that
returns "module:Class" (a Platform subclass) when its platform is usable here, else None. Its
class then serves the device type it names (``cpu`` or ``cuda``, the devices the engine's config
accepts) in place of the built-in one; two plugins returning a platform is an error."""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import ctypes

import torch

from actors.runtime.plugins import PLATFORM_PLUGINS, call_plugins, resolve_class

if TYPE_CHECKING:
    from kernels.attention.base import AttentionBackend, AttentionRequirements


class Platform:
    """A device kind. Class attributes and class methods only (never instantiated)."""
    device_type: ClassVar[str]                     # torch's device type
    dtypes: ClassVar[tuple[str, ...]]              # model dtypes it runs
    kv_cache_dtypes: ClassVar[tuple[str, ...]]     # resolved KV cache dtypes it stores
    attention_backends: ClassVar[tuple[str, ...]]  # names in kernels.attention.selector.BACKENDS, tried in order
    supports_cuda_graphs: ClassVar[bool] = False   # decode steps captured and replayed
    packs_linears: ClassVar[bool] = False          # linear layers packed for kernels/cpu's native matmuls
    pin_memory: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        """Whether this process can run on the platform's device (each platform says how)."""
        raise NotImplementedError(f"{cls.__name__} does not say whether its device is available")

    @classmethod
    def check_dtypes(cls, dtype: str, kv_cache_dtype: str) -> None:
        """Refuse what this platform does not run, naming what it does (a resolved config's)."""
        if dtype not in cls.dtypes:
            raise ValueError(f"dtype {dtype!r} is not supported on {cls.device_type}; supported: "
                             f"{', '.join(cls.dtypes)}")
        if kv_cache_dtype not in cls.kv_cache_dtypes:
            raise ValueError(f"KV cache dtype {kv_cache_dtype!r} is not supported on {cls.device_type}; "
                             f"supported: {', '.join(cls.kv_cache_dtypes)}")

    @classmethod
    def compute_dtype(cls, dtype: str, packs_linears: bool) -> str:
        """The dtype the model computes in for ``--dtype dtype`` (its activations, norms and
        embeddings); the linear layers' weights keep ``dtype``. ``packs_linears``: whether this
        load packs its linear layers (the platform's and the compilation level's say)."""
        return dtype

    @classmethod
    def empty_cache(cls) -> None:
        """Give the memory freed tensors held back to the system (sleep mode): the C allocator
        keeps freed blocks for its next allocations (glibc's: malloc_trim hands them back)."""
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):        # not glibc: its allocator keeps what it keeps
            pass

    @classmethod
    def select_attention_backend(cls, req: AttentionRequirements) -> AttentionBackend:
        """The first of ``attention_backends`` that accepts ``req`` (the error names every refusal)."""
        from kernels.attention.selector import select_backend
        return select_backend(req, list(cls.attention_backends))


_KV_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")


class CpuPlatform(Platform):
    device_type = "cpu"
    dtypes = ("float32", "bfloat16", "float16")
    kv_cache_dtypes = _KV_DTYPES
    attention_backends = ("triton", "cpu")         # Triton refuses the CPU's tensors (kept: the same order everywhere)
    packs_linears = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def compute_dtype(cls, dtype: str, packs_linears: bool) -> str:
        """bfloat16 runs as bfloat16 weights in the native panels (their matmuls round the
        activations to bfloat16 and sum in float32, with AVX512-BF16 where the CPU has it) around
        float32 activations, norms and attention; where the panels are not used (no C compiler,
        compilation levels 2 and 3) everything is bfloat16, through oneDNN's matmuls."""
        from kernels.cpu.native import available
        if dtype == "bfloat16" and packs_linears and available()[0]:
            return "float32"
        return dtype


class CudaPlatform(Platform):
    device_type = "cuda"
    dtypes = ("float32", "bfloat16", "float16")
    kv_cache_dtypes = _KV_DTYPES
    attention_backends = ("triton", "cpu")
    supports_cuda_graphs = True
    pin_memory = True

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def empty_cache(cls) -> None:
        super().empty_cache()           # the weights moved to the host's memory (level 1) stay there
        torch.cuda.empty_cache()


BUILTIN_PLATFORMS: dict[str, type[Platform]] = {"cpu": CpuPlatform, "cuda": CudaPlatform}


def plugin_platform() -> type[Platform] | None:
    """The platform a ``troupe.platform_plugins`` entry point activates here, if one does."""
    active = {name: path for name, path in call_plugins(PLATFORM_PLUGINS).items() if path is not None}
    if len(active) > 1:
        raise ValueError(f"more than one platform plugin is active: {', '.join(sorted(active))}; "
                         f"keep one (TROUPE_PLUGINS names the plugins to load)")
    if not active:
        return None
    (name, path), = active.items()
    cls = resolve_class(path, f"platform plugin {name!r}")
    if not (issubclass(cls, Platform) and cls.device_type in BUILTIN_PLATFORMS):
        raise ValueError(f"platform plugin {name!r}: {path} must be a Platform subclass whose device_type is "
                         f"one of {', '.join(BUILTIN_PLATFORMS)}")
    return cls


def platform_for(device_type: str) -> type[Platform]:
    """The platform serving ``device_type`` ("cpu" or "cuda"): a plugin's, else the built-in one."""
    plugin = plugin_platform()
    if plugin is not None and plugin.device_type == device_type:
        return plugin
    if device_type not in BUILTIN_PLATFORMS:
        raise ValueError(f"no platform for device {device_type!r}; known: {', '.join(BUILTIN_PLATFORMS)}")
    return BUILTIN_PLATFORMS[device_type]
