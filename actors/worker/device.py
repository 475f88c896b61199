"""Where the worker runs and in which dtype: ``device`` "auto" | "cpu" | "cuda" and ``dtype``
"auto" | a torch floating dtype name, resolved once when the model is loaded.

"auto" picks CUDA when torch sees a device, else the CPU; the dtype "auto" is bfloat16 on CUDA
and float32 on the CPU. An explicit dtype is always kept (float32 on CUDA is allowed)."""
from __future__ import annotations

from typing import NamedTuple

import torch

DEVICES = ("auto", "cpu", "cuda")


class Placement(NamedTuple):
    device: torch.device
    dtype: torch.dtype

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(name: str) -> torch.device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; accepted: {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device "
                           f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                           "use device 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; accepted: auto, float32, bfloat16")
    return dtype


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: "auto" is the model's dtype; float16 / bfloat16 halve the
    bytes each cached token takes (and that decode attention reads) at a rounding of K and V."""
    if name == "auto":
        return dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; accepted: {', '.join(KV_CACHE_DTYPES)}")
    return getattr(torch, name)


def resolve_placement(device: str, dtype: str) -> Placement:
    dev = resolve_device(device)
    return Placement(dev, resolve_dtype(dtype, dev))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
