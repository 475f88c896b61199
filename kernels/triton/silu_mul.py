"""The gated activation SiLU(gate) * up of a fused (T, 2I) gate|up projection: Triton kernel,
launcher and torch reference. SiLU is computed in float32 and rounded to the input dtype before
the product, as ``F.silu(gate) * up`` does in bfloat16."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor

BLOCK_I = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,              # (T, 2I): gate | up
    out_ptr,            # (T, I)
    stride_xt, stride_ot,
    inter,              # I
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    gate = tl.load(x_ptr + t * stride_xt + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + i, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + i, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, 2I) = gate | up -> SiLU(gate) * up, (T, I); written into ``out`` when given."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x must have an even last dimension (gate | up), got {two_i}")
    inter = two_i // 2
    if out is None:
        out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
    check_shape("out", out, (T, inter))
    if T > 0 and inter > 0:
        block = min(BLOCK_I, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
