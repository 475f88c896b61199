"""Rotary position embedding, Hugging Face "half-split" (NeoX) style, applied to q and k in
place or out of place: Triton kernel, launcher and torch reference.

For a head vector x and rot_dim = cos_sin_cache.shape[1] (<= head_size), dimension j < rot_dim/2
pairs with j + rot_dim/2:
    out[j]             = x[j] * cos[j] - x[j + rot/2] * sin[j]
    out[j + rot/2]     = x[j + rot/2] * cos[j] + x[j] * sin[j]
and dimensions >= rot_dim pass through. Two ways to give cos and sin:

* ``rotary_embedding(positions, q, k, cos_sin_cache)``: rows of cat(cos, sin) per position,
  vLLM's layout, gathered by the kernel; from the model's (P, D) cos/sin caches it is
  ``torch.cat([cos_cache[:, :D // 2], sin_cache[:, :D // 2]], dim=-1)``;
* ``rotary_embedding_rows(q, k, cos, sin)``: one cos and one sin row per token, Hugging Face's
  layout (the halves repeated, only the first half read), as the model layers already hold them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2


class RotaryOutput(NamedTuple):
    query: torch.Tensor  # (T, H, D)
    key: torch.Tensor    # (T, KVH, D)


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # x_ptr points at one token's (num_heads, head_size) rows; cos/sin: (1, BLOCK_HALF) float32
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < half)
    p1 = x_ptr + h * stride_h + j
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,      # (T,) int64 or int32, read when HAS_POSITIONS
    q_ptr,              # (T, H, D), rotated in place
    k_ptr,              # (T, KVH, D), rotated in place
    cos_ptr,            # row r: cos[0:half]; r = positions[t] (HAS_POSITIONS) or t
    sin_ptr,            # row r: sin[0:half]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    num_heads, num_kv_heads, half,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)   # one program per token, all heads
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + t).to(tl.int64)
    else:
        row = t
    j = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + row * stride_cos + j, mask=j < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + j, mask=j < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_heads, cos, sin, half, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, sin, half, BLOCK_KVH, BLOCK_HALF)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, inplace: bool = True) -> RotaryOutput:
    """Rotate query (T, H, D) and key (T, KVH, D) at positions (T,). In place (the default; the
    inputs may be strided views of a fused qkv tensor) or on copies. cos_sin_cache is
    (max_positions, rot_dim) with rot_dim even and <= D; positions must be < max_positions."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    T, H, D = query.shape
    dev = query.device
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=dev)
    check_shape("key", key, (T, None, D))
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    check_shape("positions", positions, (T,))
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or not 2 <= rot_dim <= D:
        raise ValueError(f"cos_sin_cache has rot_dim {rot_dim}; it must be even and in [2, head_size={D}]")
    if not inplace:
        query, key = query.clone(), key.clone()
    half = rot_dim // 2
    _launch(positions, query, key, cos_sin_cache, cos_sin_cache[:, half:], half)
    return RotaryOutput(query, key)


def rotary_embedding_rows(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          inplace: bool = True) -> RotaryOutput:
    """Rotate query (T, H, D) and key (T, KVH, D) by per-token cos and sin, each (T, D) or
    (T, 1, D) in Hugging Face's layout (cos[:, j] == cos[:, j + D/2]; the first half is read).
    In place by default (the inputs may be strided views of a fused qkv tensor)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    T, H, D = query.shape
    dev = query.device
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=dev)
    check_shape("key", key, (T, None, D))
    rows = []
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, device=dev)
        if t.dim() == 3:
            check_shape(name, t, (T, 1, None))
            t = t[:, 0]
        check_shape(name, t, (T, None))
        rows.append(t)
    cos, sin = rows
    if cos.shape[1] != sin.shape[1] or cos.shape[1] % 2 or not 2 <= cos.shape[1] <= D:
        raise ValueError(f"cos and sin must have the same even width in [2, head_size={D}], "
                         f"got {cos.shape[1]} and {sin.shape[1]}")
    if not inplace:
        query, key = query.clone(), key.clone()
    _launch(None, query, key, cos, sin, cos.shape[1] // 2)
    return RotaryOutput(query, key)


def _launch(positions: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
    T, H, _ = query.shape
    if T == 0:
        return
    KVH = key.shape[1]
    _rotary_kernel[(T,)](
        positions if positions is not None else cos, query, key, cos, sin,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos.stride(0), sin.stride(0),
        H, KVH, half, HAS_POSITIONS=positions is not None,
        BLOCK_H=next_power_of_2(H), BLOCK_KVH=next_power_of_2(KVH), BLOCK_HALF=next_power_of_2(half),
    )


def rotary_embedding_ref(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> RotaryOutput:
    """Out of place, in float32, rounded once to the input dtype."""
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions.long(), :half].float()[:, None, :]   # (T, 1, half)
    sin = cos_sin_cache[positions.long(), half:].float()[:, None, :]   # (T, 1, half)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    return RotaryOutput(rotate(query), rotate(key))
