"""RMSNorm with an optional fused residual add: Triton kernel, launcher and torch reference.

Arithmetic follows Hugging Face's LlamaRMSNorm: the sum ``x + residual`` is rounded to the input
dtype (it becomes the next residual), normalised in float32, rounded to the input dtype, and
only then multiplied by the weight, so bfloat16 results match transformers'.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2


class RMSNormOutput(NamedTuple):
    out: torch.Tensor       # (T, N) normalised
    residual: torch.Tensor  # (T, N) x + residual (or x itself when no residual was given)


@triton.jit
def _rms_norm_kernel(
    x_ptr,              # (T, N)
    residual_ptr,       # (T, N), read when HAS_RESIDUAL
    weight_ptr,         # (N,)
    out_ptr,            # (T, N)
    residual_out_ptr,   # (T, N), written when HAS_RESIDUAL
    stride_xt, stride_rt, stride_ot, stride_rot,
    N, eps,
    BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)   # one program per row
    n = tl.arange(0, BLOCK_N)
    mask = n < N
    x = tl.load(x_ptr + t * stride_xt + n, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + n, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + t * stride_rot + n, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)   # rounded before the weight, like HF
    w = tl.load(weight_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> RMSNormOutput:
    """x (T, N), weight (N,), residual (T, N) or None -> (normed (T, N), new residual (T, N)).

    With a residual: new_residual = x + residual and normed = norm(new_residual); without one,
    new_residual is x itself (the next layer's residual), as in vLLM's fused_add_rms_norm.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, N = x.shape
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    check_shape("weight", weight, (N,))
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check_shape("residual", residual, (T, N))
    if N > 65536:
        raise ValueError(f"rms_norm handles rows of at most 65536 elements, got {N}")
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    if T > 0:
        res = residual if residual is not None else x   # unused when HAS_RESIDUAL is False
        _rms_norm_kernel[(T,)](
            x, res, weight, out, residual_out,
            x.stride(0), res.stride(0), out.stride(0), residual_out.stride(0),
            N, eps,
            BLOCK_N=next_power_of_2(N), HAS_RESIDUAL=residual is not None,
        )
    return RMSNormOutput(out, residual_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> RMSNormOutput:
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return RMSNormOutput((weight * y).to(x.dtype), x)
