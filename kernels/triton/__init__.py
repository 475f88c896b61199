"""Triton kernels for the GPU worker, one kernel per module, each beside its launcher and its
pure-torch reference; shared here: the argument checks the launchers run and the numeric
choices (dot dtype and precision) of the two attention kernels.

Kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which
is how the tests prove them without a GPU. Launchers never synchronise with the host.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES     # an fp8 cache goes to the kernels as its uint8 bytes
LOG2E = 1.4426950408889634   # softmax runs in base 2: exp(x) = exp2(x * log2(e))


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_tensor(name: str, t: torch.Tensor, *, ndim: int | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, device: torch.device | None = None,
                 last_dim_contiguous: bool = True) -> None:
    """Raise ValueError naming ``name`` when ``t`` has the wrong rank, dtype, device or layout.

    Device rule: CUDA, or the CPU while the interpreter is on; ``device`` (when given) must match.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; accepted: {accepted}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(f"{name} is on {t.device}: Triton kernels need CUDA tensors "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Raise ValueError unless t.shape matches ``expected`` (None = any size)."""
    if len(t.shape) != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want}")


def check_query_and_cache(query: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The paged attention kernels' first checks: a (N, H, D) float query and a
    (2, blocks, block_size, KVH, D) cache in the query's dtype or fp8, on one device. Returns
    (H, D, block_size, KVH)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    _, H, D = query.shape
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(query.dtype,) + FP8_DTYPES, device=query.device)
    _, _, block_size, KVH, _ = kv_cache.shape
    check_shape("kv_cache", kv_cache, (2, None, block_size, KVH, D))
    return H, D, block_size, KVH


def check_attention_args(H: int, KVH: int, D: int, block_size: int, sliding_window: int | None) -> None:
    """What the paged attention kernels support: GQA, head size <= 256, power-of-two pages >= 16."""
    if KVH == 0 or H % KVH:
        raise ValueError(f"num_heads {H} must be a multiple of num_kv_heads {KVH}")
    if not 1 <= D <= 256:
        raise ValueError(f"head_size must be in [1, 256], got {D}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


_ONES: dict[torch.device, torch.Tensor] = {}


def kv_scale_args(kv_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel takes for ``kv_cache``: for an fp8 cache the layer's () float32
    scales (None: a shared 1.0 on the cache's device); for the others the cache itself, never read."""
    if kv_cache.dtype not in FP8_DTYPES:
        return kv_cache, kv_cache
    dev = kv_cache.device
    if k_scale is None or v_scale is None:
        if dev not in _ONES:
            _ONES[dev] = torch.ones((), dtype=torch.float32, device=dev)
        k_scale = _ONES[dev] if k_scale is None else k_scale
        v_scale = _ONES[dev] if v_scale is None else v_scale
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or s.numel() != 1 or s.device != dev:
            raise ValueError(f"{name} must be one float32 on {dev}, got {tuple(s.shape)} {s.dtype} on {s.device}")
    return k_scale, v_scale


def dot_in_float32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bfloat16 tiles as raw 16-bit integers (its tl.dot hands
    numpy the bit patterns), so under the interpreter dot operands are upcast to float32 first.
    On the GPU they stay in the input dtype."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs multiply in full precision ("ieee"), not TF32, to match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"
