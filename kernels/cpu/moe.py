"""The fused mixture-of-experts kernel of the float32 CPU path (moe.c; its experts in float32, or
in bfloat16 under the CPU's --dtype bfloat16: fused_moe_bf16): the (token, expert) pairs
grouped by expert and every expert's gate|up, activation and down matmuls (with their biases,
when the experts have them) in one native call, threaded with OpenMP. A torch custom op
(``torch.ops.troupe.cpu_fused_moe``, with a fake kernel giving the output's shape) so
torch.compile traces it as one node::

    cpu_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias,
                  activation, alpha, limit) -> Tensor

``activation`` 0 is SiLU(gate) * up, 1 gpt-oss's swigluoai (ACTIVATIONS; models/moe.py).

``supports`` decides between it and models/moe.py's torch reference, as kernels/cpu/fused.py
does for the elementwise kernels (``TROUPE_FUSED_CPU=0`` forces the torch path)."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kernels.cpu import fused, native

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
ACTIVATIONS = {"silu": 0, "swigluoai": 1}      # the kernel's codes


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """float32 CPU tensors, x (T, H) with unit column stride, the stacked weights contiguous
    (float32, or bfloat16: the CPU's --dtype bfloat16), the native library built here."""
    if x.dim() != 2 or not w13.is_contiguous() or not w2.is_contiguous():
        return False
    if w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16 and w13.is_cpu and w2.is_cpu:
        return fused.supports(x)
    return fused.supports(x, w13, w2)


@lru_cache(maxsize=None)
def _kernel(name: str = "fused_moe_f32") -> ctypes._CFuncPtr:
    """fused_moe_f32, or fused_moe_bf16 (bfloat16 weights; the same signature)."""
    return native.declare(name, [_P, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _P,
                                 _P, _P, ctypes.c_int, ctypes.c_float, ctypes.c_float], ctypes.c_int)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                  limit: float = 7.0) -> torch.Tensor:
    """x (T, H) float32, w13 (E, 2I, H), w2 (E, H, I), topk_weights (T, k), topk_ids (T, k) global
    expert ids (those outside ``expert_start`` .. ``expert_start + E`` add nothing), the biases
    w13_bias (E, 2I) and w2_bias (E, H) or None -> (T, H)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return torch.ops.troupe.cpu_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_start, w13_bias, w2_bias,
                                          ACTIVATIONS[activation], alpha, limit)


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, expert_start: int, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
               activation: int, alpha: float, limit: float) -> torch.Tensor:
    T, H = x.shape
    E, two_i, H13 = w13.shape
    if (H13 != H or two_i % 2 or tuple(w2.shape) != (E, H, two_i // 2)
            or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T):
        raise ValueError(f"fused MoE takes x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk weights and ids (T, k); "
                         f"got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    for name, bias, shape in (("w13_bias", w13_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if bias is not None and (tuple(bias.shape) != shape or bias.dtype != torch.float32):
            raise ValueError(f"fused MoE takes {name} as float32 {shape}, got {tuple(bias.shape)} {bias.dtype}")
    out = torch.empty(T, H, dtype=torch.float32)
    if T == 0:
        return out
    b13 = None if w13_bias is None else w13_bias.contiguous()
    b2 = None if w2_bias is None else w2_bias.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    name = "fused_moe_bf16" if w13.dtype == torch.bfloat16 else "fused_moe_f32"
    rc = _kernel(name)(x.data_ptr(), x.stride(0), ids.data_ptr(), weights.data_ptr(), T, ids.shape[1],
                   w13.data_ptr(), w2.data_ptr(), E, expert_start, H, two_i // 2, out.data_ptr(),
                   None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(), activation,
                   alpha, limit)
    if rc != 0:
        raise MemoryError(f"fused MoE: no memory for the work buffers of {T} tokens x {ids.shape[1]} experts")
    return out


_LIB = torch.library.Library("troupe", "FRAGMENT")
_LIB.define("cpu_fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
            "int expert_start, Tensor? w13_bias, Tensor? w2_bias, int activation, float alpha, float limit) -> Tensor")
_LIB.impl("cpu_fused_moe", _fused_moe, "CPU")
torch.library.register_fake("troupe::cpu_fused_moe", lambda x, *rest: x.new_empty(x.shape), lib=_LIB)
