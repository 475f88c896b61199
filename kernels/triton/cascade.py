"""Cascade attention's two Triton pieces (kernels/attention/cascade.py has the plan): every query of
a step against one shared prefix, and the log-sum-exp merge of two partial attentions. Kernels,
launchers and torch references.

Prefix: each program owns (tile of BLOCK_M query rows, KV head). The step's N tokens times the G
query heads of that KV head are laid out as N * G rows (row r = token r // G, head r % G), whatever
request each token belongs to, so a page of the prefix is loaded once per tile of 64 rows instead
of once per request: the GEMM that replaces per-request reads. The prefix precedes every query, so
no mask but the rows' own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.fp8 import dequantize_kv
from kernels.triton import (LOG2E, check_query_and_cache, check_shape, check_tensor,
                            dot_in_float32, dot_precision, kv_scale_args, next_power_of_2)
from kernels.triton.fp8 import fp8_format, fp8_to_float


@triton.jit
def _prefix_attention_kernel(
    q_ptr,              # (N, H, D)
    cache_ptr,          # (2, num_blocks, BLOCK_SIZE, KVH, D); uint8 bytes of an fp8 cache
    blocks_ptr,         # (num_prefix_blocks,) int32, the prefix's pages in order
    out_ptr,            # (N, H, D) float32
    lse_ptr,            # (N, H) float32, natural log-sum-exp of each row's scaled scores
    k_scale_ptr,        # () float32, read when FP8
    v_scale_ptr,        # () float32, read when FP8
    qk_scale,           # softmax scale * log2(e)
    num_rows,           # N * G
    num_prefix_blocks,
    stride_qt, stride_qh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_ot, stride_oh, stride_lt,
    group, head_size,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    kvh = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    tokens = (r // group).to(tl.int64)
    heads = kvh * group + r % group
    row_mask = r < num_rows
    d_mask = d < head_size
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    kv_base = cache_ptr + kvh * stride_c_head + t[:, None] * stride_c_slot + d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(0, num_prefix_blocks):          # every position of every page is visible
        page = tl.load(blocks_ptr + blk).to(tl.int64)
        k = tl.load(kv_base + page * stride_c_block, mask=d_mask[None, :], other=0.0)
        v = tl.load(kv_base + stride_c_kv + page * stride_c_block, mask=d_mask[None, :], other=0.0)
        if FP8:
            k = (fp8_to_float(k, FP8) * tl.load(k_scale_ptr)).to(q.dtype)
            v = (fp8_to_float(v, FP8) * tl.load(v_scale_ptr)).to(q.dtype)
        elif DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # (BLOCK_M, BLOCK_SIZE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], acc / safe_l[:, None],
             mask=row_mask[:, None] & d_mask[None, :])
    lse = tl.where(l_i > 0, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + tokens * stride_lt + heads, lse, mask=row_mask)


@triton.jit
def _merge_attn_states_kernel(
    out_ptr,            # (N, H, D)
    p_out_ptr,          # (N, H, D) prefix outputs
    p_lse_ptr,          # (N, H) float32
    s_out_ptr,          # (N, H, D) suffix outputs
    s_lse_ptr,          # (N, H) float32
    stride_ot, stride_oh, stride_pt, stride_ph, stride_st, stride_sh, stride_plt, stride_slt,
    head_size,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_size
    p_lse = tl.load(p_lse_ptr + n * stride_plt + h)
    s_lse = tl.load(s_lse_ptr + n * stride_slt + h)
    m = tl.maximum(p_lse, s_lse)
    m = tl.where(m == float("-inf"), 0.0, m)             # both empty: both weights 0
    wp = tl.exp2((p_lse - m) * 1.4426950408889634)
    ws = tl.exp2((s_lse - m) * 1.4426950408889634)
    total = tl.where(wp + ws > 0, wp + ws, 1.0)
    po = tl.load(p_out_ptr + n * stride_pt + h * stride_ph + d, mask=d_mask, other=0.0).to(tl.float32)
    so = tl.load(s_out_ptr + n * stride_st + h * stride_sh + d, mask=d_mask, other=0.0).to(tl.float32)
    out = (po * wp + so * ws) / total
    tl.store(out_ptr + n * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def prefix_attention(
    query: torch.Tensor,          # (N, H, D)
    kv_cache: torch.Tensor,       # (2, num_blocks, block_size, KVH, D)
    prefix_blocks: torch.Tensor,  # (P / block_size,) int32, the shared prefix's pages
    scale: float,
    k_scale: torch.Tensor | None = None,   # () float32 on the device, fp8 caches only
    v_scale: torch.Tensor | None = None,
    block_m: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:   # out (N, H, D) float32, lse (N, H) float32
    """Attention of every query over the whole prefix, unmasked, and each row's log-sum-exp."""
    H, D, block_size, KVH = check_query_and_cache(query, kv_cache)
    N, dev = query.shape[0], query.device
    check_tensor("prefix_blocks", prefix_blocks, ndim=1, dtypes=(torch.int32,), device=dev)
    if KVH == 0 or H % KVH:
        raise ValueError(f"num_heads {H} must be a multiple of num_kv_heads {KVH}")
    if query.stride(2) != 1:
        raise ValueError("query must have unit stride along its head size")
    out = torch.empty(N, H, D, dtype=torch.float32, device=dev)
    lse = torch.empty(N, H, dtype=torch.float32, device=dev)
    if N == 0:
        return out, lse
    group = H // KVH
    BLOCK_M = max(block_m, next_power_of_2(group))
    fmt = fp8_format(kv_cache.dtype)
    k_scale, v_scale = kv_scale_args(kv_cache, k_scale, v_scale)
    cache = kv_cache.view(torch.uint8) if fmt else kv_cache
    grid = (triton.cdiv(N * group, BLOCK_M), KVH)
    _prefix_attention_kernel[grid](
        query, cache, prefix_blocks, out, lse, k_scale, v_scale, scale * LOG2E, N * group, prefix_blocks.numel(),
        query.stride(0), query.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        out.stride(0), out.stride(1), lse.stride(0), group, D,
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_D=max(16, next_power_of_2(D)),
        DOT_F32=dot_in_float32(query.dtype), DOT_PRECISION=dot_precision(query.dtype), FP8=fmt,
    )
    return out, lse


def merge_attn_states(out: torch.Tensor, prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_out: torch.Tensor, suffix_lse: torch.Tensor) -> torch.Tensor:
    """out (N, H, D) = attention over both key sets, from each part's output (N, H, D) and
    log-sum-exp (N, H) float32; a part with lse -inf weighs nothing."""
    N, H, D = out.shape
    for name, t in (("prefix_out", prefix_out), ("suffix_out", suffix_out)):
        check_shape(name, t, (N, H, D))
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride along its head size")
    for name, t in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=out.device)
        check_shape(name, t, (N, H))
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its heads")
    if out.stride(2) != 1:
        raise ValueError("out must have unit stride along its head size")
    if N == 0:
        return out
    _merge_attn_states_kernel[(N, H)](
        out, prefix_out, prefix_lse, suffix_out, suffix_lse,
        out.stride(0), out.stride(1), prefix_out.stride(0), prefix_out.stride(1),
        suffix_out.stride(0), suffix_out.stride(1), prefix_lse.stride(0), suffix_lse.stride(0), D,
        BLOCK_D=max(16, next_power_of_2(D)),
    )
    return out


def prefix_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, prefix_blocks: torch.Tensor, scale: float,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the prefix page by page (fp8 dequantized), repeat K/V per query head, softmax in
    float32 over all of it. -> (out (N, H, D) float32, lse (N, H) float32)."""
    N, H, D = query.shape
    KVH = kv_cache.shape[3]
    pages = prefix_blocks.long()
    k = dequantize_kv(kv_cache[0, pages].flatten(0, 1), k_scale).repeat_interleave(H // KVH, dim=1)  # (P, H, D)
    v = dequantize_kv(kv_cache[1, pages].flatten(0, 1), v_scale).repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,phd->nhp", query.float(), k) * scale
    return torch.einsum("nhp,phd->nhd", scores.softmax(-1), v), torch.logsumexp(scores, -1)


def merge_attn_states_ref(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                          suffix_lse: torch.Tensor) -> torch.Tensor:
    """The same merge in plain torch, float32."""
    m = torch.maximum(prefix_lse, suffix_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wp, ws = (prefix_lse - m).exp(), (suffix_lse - m).exp()
    return (prefix_out.float() * wp[..., None] + suffix_out.float() * ws[..., None]) / (wp + ws)[..., None]
