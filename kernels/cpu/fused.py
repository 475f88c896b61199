"""Fused elementwise kernels of the float32 CPU path (fused.c): RMSNorm with the residual add
folded in, rotary embedding in place on q and k, SiLU(gate) * up.

``supports`` is the one place that decides between them and the plain torch ops: float32 CPU
tensors, the native library available, and ``ENABLED`` (set ``TROUPE_FUSED_CPU=0``, or patch it,
to force the plain path). The kernels take the memory layouts noted on each function; callers
check those and fall back to torch otherwise.
"""
from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

from kernels.cpu import native

ENABLED = os.environ.get("TROUPE_FUSED_CPU", "1") != "0"

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


@lru_cache(maxsize=1)
def _native_ok() -> bool:
    return native.available()[0]


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors: float32 on the CPU, each with a
    contiguous last dimension (the shapes and other strides each kernel takes are on it)."""
    if not ENABLED:
        return False
    for t in tensors:   # a plain loop: this runs several times per layer, at decode too
        if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return _native_ok()


@lru_cache(maxsize=None)
def _kernel(name: str) -> ctypes._CFuncPtr:
    argtypes = {
        "rms_norm_f32": [_P, _I64, _P, _P, _P, _I64, _I64, _F32],
        "rotary_f32": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64],
        "silu_and_mul_f32": [_P, _I64, _P, _I64, _I64],
    }[name]
    return native.declare(name, argtypes)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, N) with any row stride, weight (N,) contiguous. Without ``residual``:
    x / sqrt(mean(x^2) + eps) * weight. With ``residual`` (T, N) contiguous: residual += x in
    place, and the norm of that sum is returned. -> (T, N) contiguous."""
    T, N = x.shape
    out = torch.empty(T, N, dtype=x.dtype)
    if T:
        r = residual.data_ptr() if residual is not None else None
        _kernel("rms_norm_f32")(x.data_ptr(), x.stride(0), r, weight.data_ptr(), out.data_ptr(), T, N, eps)
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Half-split (NeoX) rotary in place: q (T, H, D) and k (T, KVH, D) with packed heads
    (stride(1) == D) and any row stride (views into a fused qkv output need no copy); cos and
    sin (T, 1, D) or (T, D) with one row stride."""
    T, H, D = q.shape
    if T:
        _kernel("rotary_f32")(q.data_ptr(), q.stride(0), H, k.data_ptr(), k.stride(0), k.shape[1],
                              cos.data_ptr(), sin.data_ptr(), cos.stride(0), T, D)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) with any row stride = gate | up -> silu(gate) * up (T, I), silu(g) = g / (1 + exp(-g))."""
    T, I2 = gate_up.shape
    out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
    if T:
        _kernel("silu_and_mul_f32")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), T, I2 // 2)
    return out
