"""Paged attention for decode: one query token per request, read through the block table, with
grouped-query attention and optional sliding window; long contexts split across programs
(split-K) and merged by a second reduction kernel. Kernels, launcher and torch reference.

Each program owns (request b, KV head, split): it loads the G query heads sharing that KV head
as one (BLOCK_G, D) tile, so every K/V page is read once per KV head, never once per query head.
A split's share of the context is computed in the kernel from the request's own seq_len, so the
grid depends only on (B, KVH, num_splits): fixed batch shapes launch identical grids, which is
what CUDA-graph capture needs.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.attention.fp8 import dequantize_kv
from kernels.triton import (LOG2E, check_attention_args, check_query_and_cache, check_shape, check_tensor,
                            dot_in_float32, dot_precision, kv_scale_args, next_power_of_2)
from kernels.triton.fp8 import fp8_format, fp8_to_float

MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 128


@triton.jit
def soft_capped(s, cap):
    """Log2-scaled scores ``s`` capped as Gemma 2 caps its scaled scores (C * tanh(x / C)):
    ``cap`` is C * log2(e), so the result stays log2-scaled. tanh from exp (1 - 2 / (e^2y + 1)),
    which saturates to +-1 without overflow trouble."""
    y = s / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def _paged_decode_kernel(
    q_ptr,              # (B, H, D)
    cache_ptr,          # (2, num_blocks, BLOCK_SIZE, KVH, D); uint8 bytes of an fp8 cache
    block_table_ptr,    # (B, max_blocks) int32
    seq_lens_ptr,       # (B,) int32
    out_ptr,            # (B, H, D), written when NUM_SPLITS == 1
    part_acc_ptr,       # (B, H, NUM_SPLITS, D) float32, unnormalised partial outputs
    part_m_ptr,         # (B, H, NUM_SPLITS) float32, running max of the log2-scaled scores
    part_l_ptr,         # (B, H, NUM_SPLITS) float32, sum of exp2(score - max)
    k_scale_ptr,        # () float32, read when FP8: keys are fp8 * k_scale
    v_scale_ptr,        # () float32, read when FP8
    sinks_ptr,          # (H,) float32, each head's sink logit, read when SINKS
    alibi_ptr,          # (H,) float32, ALiBi's slopes, read when ALIBI
    qk_scale,           # softmax scale * log2(e)
    window,             # sliding window in tokens, 0 = none
    soft_cap,           # the score cap C * log2(e), read when SOFT_CAP
    stride_qb, stride_qh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_bt,
    stride_ob, stride_oh,
    num_heads, group, head_size,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr, ALIBI: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # 1) this split's pages: [first_block, end_block) shared evenly among NUM_SPLITS
    seq_len = tl.load(seq_lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)   # first visible position
    first_block = first // BLOCK_SIZE
    end_block = tl.cdiv(seq_len, BLOCK_SIZE)
    per_split = tl.cdiv(end_block - first_block, NUM_SPLITS)
    start = first_block + split * per_split
    stop = tl.minimum(start + per_split, end_block)

    # 2) the query heads of this KV group: (BLOCK_G, BLOCK_D)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_SIZE)
    heads = kvh * group + g
    g_mask = g < group
    d_mask = d < head_size
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    kv_base = cache_ptr + kvh * stride_c_head + t[:, None] * stride_c_slot + d[None, :]  # (BLOCK_SIZE, BLOCK_D)
    if ALIBI:                  # log2-scaled like the scores
        slope = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634

    # 3) online softmax over the split's pages; every page in range holds a visible key
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for blk in range(start, stop):
        page = tl.load(block_table_ptr + b * stride_bt + blk).to(tl.int64)
        k = tl.load(kv_base + page * stride_c_block, mask=d_mask[None, :], other=0.0)
        v = tl.load(kv_base + stride_c_kv + page * stride_c_block, mask=d_mask[None, :], other=0.0)
        if FP8:                # dequantized in float32, then the dot's dtype (vLLM's Triton kernels' way)
            k = (fp8_to_float(k, FP8) * tl.load(k_scale_ptr)).to(q.dtype)
            v = (fp8_to_float(v, FP8) * tl.load(v_scale_ptr)).to(q.dtype)
        elif DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_SIZE)
        if SOFT_CAP:
            s = soft_capped(s, soft_cap)
        pos = blk * BLOCK_SIZE + t
        if ALIBI:              # the query is at seq_len - 1
            s += slope[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
        s = tl.where(((pos < seq_len) & (pos >= first))[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # 4) one split: normalise and write; several: leave partials for the reduction
    if NUM_SPLITS == 1:
        if SINKS:              # the sink: one more softmax term with no value (log2-scaled like the scores)
            l_i += tl.exp2(tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634 - m_i)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]          # seq_len 0 gives zeros
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (b * num_heads + heads) * NUM_SPLITS + split        # (BLOCK_G,)
        tl.store(part_acc_ptr + row[:, None] * head_size + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,            # (B, H, D)
    part_acc_ptr,       # (B, H, NUM_SPLITS, D) float32
    part_m_ptr,         # (B, H, NUM_SPLITS) float32
    part_l_ptr,         # (B, H, NUM_SPLITS) float32
    sinks_ptr,          # (H,) float32, read when SINKS
    stride_ob, stride_oh,
    num_heads, head_size,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    row = (b * num_heads + h) * NUM_SPLITS + s                   # (BLOCK_S,)
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_size + d[None, :],
                  mask=s_mask[:, None] & (d < head_size)[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    total = tl.sum(w * l, 0)
    if SINKS:
        total += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - m_max)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_size)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough splits to give a long context ~MIN_TOKENS_PER_SPLIT tokens each, capped so that
    a batch that already fills the GPU (>= 512 programs) is not split further."""
    by_length = math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT)
    by_occupancy = max(1, 512 // max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def paged_decode_attention(
    query: torch.Tensor,        # (B, H, D)
    kv_cache: torch.Tensor,     # (2, num_blocks, block_size, KVH, D)
    block_table: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,     # (B,) int32, tokens in the cache, the query's own included
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # (B, H, D), written in place when given
    k_scale: torch.Tensor | None = None,  # () float32 on the device: an fp8 cache's keys are fp8 * k_scale
    v_scale: torch.Tensor | None = None,
    soft_cap: float | None = None,    # Gemma 2's: each scaled score s becomes C * tanh(s / C)
    sinks: torch.Tensor | None = None,  # (H,) float32 on the device: each head's sink logit (gpt-oss)
    alibi_slopes: torch.Tensor | None = None,  # (H,) float32 on the device: ALiBi's slopes (BLOOM)
) -> torch.Tensor:                    # (B, H, D); rows with seq_len 0 are zeros
    """Attention of each request's single query (at position seq_len - 1) over its cached
    context. The cache must already hold the query's own key and value. The cache is in the
    query's dtype or fp8 (float8_e4m3fn / float8_e5m2, dequantized as it is read). ``sinks``:
    head h's softmax has one more term e^sinks[h] with no value behind it."""
    H, D, block_size, KVH = check_query_and_cache(query, kv_cache)
    B, dev = query.shape[0], query.device
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_shape("block_table", block_table, (B, None))
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    check_shape("seq_lens", seq_lens, (B,))
    check_attention_args(H, KVH, D, block_size, sliding_window)
    for name, per_head in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if per_head is not None:
            check_tensor(name, per_head, ndim=1, dtypes=(torch.float32,), device=dev)
            check_shape(name, per_head, (H,))
    if not 1 <= num_splits <= 64:
        raise ValueError(f"num_splits must be in [1, 64], got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, ndim=3, dtypes=(query.dtype,), device=dev)
    check_shape("out", out, (B, H, D))
    if B == 0:
        return out

    group = H // KVH
    if num_splits > 1:
        part_acc = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=dev)
        part_m = torch.empty(B, H, num_splits, dtype=torch.float32, device=dev)
        part_l = torch.empty(B, H, num_splits, dtype=torch.float32, device=dev)
    else:
        part_acc = part_m = part_l = out  # unused by the kernel
    fmt = fp8_format(kv_cache.dtype)
    k_scale, v_scale = kv_scale_args(kv_cache, k_scale, v_scale)
    cache = kv_cache.view(torch.uint8) if fmt else kv_cache
    _paged_decode_kernel[(B, KVH, num_splits)](
        query, cache, block_table, seq_lens, out, part_acc, part_m, part_l, k_scale, v_scale,
        out if sinks is None else sinks, out if alibi_slopes is None else alibi_slopes, scale * LOG2E, sliding_window or 0, (soft_cap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_table.stride(0), out.stride(0), out.stride(1),
        H, group, D,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=max(16, next_power_of_2(D)),
        NUM_SPLITS=num_splits, DOT_F32=dot_in_float32(query.dtype), DOT_PRECISION=dot_precision(query.dtype),
        FP8=fmt, SOFT_CAP=bool(soft_cap), SINKS=sinks is not None, ALIBI=alibi_slopes is not None,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(B, H)](
            out, part_acc, part_m, part_l, out if sinks is None else sinks, out.stride(0), out.stride(1), H, D,
            NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits), BLOCK_D=next_power_of_2(D),
            SINKS=sinks is not None,
        )
    return out


def paged_decode_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Per request: gather the context token by token (an fp8 cache dequantized: fp8 * scale),
    repeat K/V per query head, softmax in float32 over the visible positions (p - W < k <= p,
    p = seq_len - 1), the scores capped first when ``soft_cap`` (C * tanh(s / C))."""
    B, H, D = query.shape
    block_size, KVH = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros_like(query)
    for b in range(B):
        seq_len = int(seq_lens[b])
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=query.device)
        pages = block_table[b, pos // block_size].long()
        k = dequantize_kv(kv_cache[0, pages, pos % block_size], k_scale).repeat_interleave(H // KVH, dim=1)
        v = dequantize_kv(kv_cache[1, pages, pos % block_size], v_scale).repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("hd,shd->hs", query[b].float(), k) * scale                   # (H, S)
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        if sliding_window is not None:
            scores[:, pos <= seq_len - 1 - sliding_window] = float("-inf")
        out[b] = torch.einsum("hs,shd->hd", scores.softmax(-1), v).to(query.dtype)
    return out
