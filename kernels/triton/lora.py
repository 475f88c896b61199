"""LoRA's shrink and expand for one (possibly fused) linear layer on the GPU, every adapter of a
step in two launches (vLLM's punica shrink/expand): each token reads the weights of its own
adapter slot (``token_slots``, -1: none), so the grids depend on the token count only and the
inputs are stable buffers (the layers' slots, the step's slot map), as a CUDA graph needs.

    shrink  h[t, j R + k] = sum_i x[t, i] a[s, i, j R + k]          s = token_slots[t]
    expand  y[t, o]      += sum_{k < rank[s]} h[t, j(o) R + k] b[s, k, o]   j(o): the slice of column o

Layouts as kernels/cpu/lora.py: a (S, in, num_slices R), b (S, R, out), offsets (num_slices + 1,)
int64, slot_ranks (S,) int64. The reference is ``kernels.cpu.lora.lora_shrink_expand_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor

BLOCK_IN = 64
BLOCK_OUT = 64


@triton.jit
def _lora_shrink_kernel(
    x_ptr,              # (T, in)
    a_ptr,              # (S, in, NR) float32
    h_ptr,              # (T, NR) float32, out
    slots_ptr,          # (T,) int64
    stride_xt, inp, NR,
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    s = tl.load(slots_ptr + t)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    if s >= 0:
        for i0 in range(0, inp, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            xv = tl.load(x_ptr + t * stride_xt + i, mask=i < inp, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + s * inp * NR + i[:, None] * NR + k[None, :],
                         mask=(i[:, None] < inp) & (k[None, :] < NR), other=0.0)
            acc += tl.sum(xv[:, None] * av, axis=0)
    tl.store(h_ptr + t * NR + k, acc, mask=k < NR)


@triton.jit
def _lora_expand_kernel(
    h_ptr,              # (T, NR) float32
    b_ptr,              # (S, R, out) float32
    y_ptr,              # (T, out), added to
    slots_ptr, ranks_ptr, offsets_ptr,
    stride_yt, out, R, NR, num_slices,
    BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    s = tl.load(slots_ptr + t)
    if s >= 0:
        rank = tl.load(ranks_ptr + s)
        j = tl.zeros((BLOCK_O,), dtype=tl.int64)
        for n in range(1, num_slices):
            j += (o >= tl.load(offsets_ptr + n)).to(tl.int64)
        k = tl.arange(0, BLOCK_R)
        km = k < rank
        hv = tl.load(h_ptr + t * NR + j[None, :] * R + k[:, None], mask=km[:, None] & (o[None, :] < out), other=0.0)
        bv = tl.load(b_ptr + s * R * out + k[:, None] * out + o[None, :], mask=km[:, None] & (o[None, :] < out),
                     other=0.0)
        delta = tl.sum(hv * bv, axis=0)
        yv = tl.load(y_ptr + t * stride_yt + o, mask=o < out, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + o, (yv + delta).to(y_ptr.dtype.element_ty), mask=o < out)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, slot_ranks: torch.Tensor, offsets: torch.Tensor) -> None:
    """y (T, out) += the LoRA delta of x (T, in), in place: shrink into a float32 (T, num_slices R)
    scratch, then expand. All tensors on one device; a, b float32."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    T, inp = x.shape
    S, R, out = b.shape
    num_slices = offsets.shape[0] - 1
    NR = num_slices * R
    check_shape("y", y, (T, out))
    check_shape("a", a, (S, inp, NR))
    check_shape("token_slots", token_slots, (T,))
    for name, t, dtype in (("a", a, torch.float32), ("b", b, torch.float32), ("token_slots", token_slots, torch.int64),
                           ("slot_ranks", slot_ranks, torch.int64), ("offsets", offsets, torch.int64)):
        check_tensor(name, t, dtypes=(dtype,), device=x.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("x and y must have unit stride along their rows")
    if T == 0:
        return
    h = torch.empty(T, NR, dtype=torch.float32, device=x.device)
    block_k = min(64, triton.next_power_of_2(NR))
    _lora_shrink_kernel[(T, triton.cdiv(NR, block_k))](
        x, a, h, token_slots, x.stride(0), inp, NR, BLOCK_I=min(BLOCK_IN, triton.next_power_of_2(inp)),
        BLOCK_K=block_k)
    block_o = min(BLOCK_OUT, triton.next_power_of_2(out))
    _lora_expand_kernel[(T, triton.cdiv(out, block_o))](
        h, b, y, token_slots, slot_ranks, offsets, y.stride(0), out, R, NR, num_slices,
        BLOCK_O=block_o, BLOCK_R=triton.next_power_of_2(R))
