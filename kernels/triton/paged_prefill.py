"""Paged attention for variable-length queries (prefill, chunked prefill over a cached prefix,
and mixed batches where decodes are queries of length 1): causal at absolute positions, grouped-
query attention, optional sliding window. Kernel, launcher and torch reference.

Each program owns (request b, query tile, KV head). Its BLOCK_M rows are BLOCK_Q query tokens
times the G query heads of that KV head (row r = token r // G, head r % G), so a K/V page is
loaded once for the whole group and multiplied with tl.dot:

    rows  0..G-1      token q0,   heads kvh*G .. kvh*G+G-1
    rows  G..2G-1     token q0+1, same heads
    ...
    rows  BLOCK_Q*G.. padding (when G does not divide BLOCK_M), masked

Request b's queries are the last query_len of its seq_len tokens: query j sits at absolute
position seq_len - query_len + j and sees keys k with p - W < k <= p.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.fp8 import dequantize_kv
from kernels.triton import (LOG2E, check_attention_args, check_query_and_cache, check_shape, check_tensor,
                            dot_in_float32, dot_precision, kv_scale_args, next_power_of_2)
from kernels.triton.fp8 import fp8_format, fp8_to_float
from kernels.triton.paged_decode import soft_capped


@triton.jit
def _paged_prefill_kernel(
    q_ptr,              # (T, H, D)
    cache_ptr,          # (2, num_blocks, BLOCK_SIZE, KVH, D); uint8 bytes of an fp8 cache
    block_table_ptr,    # (B, max_blocks) int32
    seq_lens_ptr,       # (B,) int32
    query_start_loc_ptr,  # (B + 1,) int32
    out_ptr,            # (T, H, D)
    lse_ptr,            # (T, H) float32, written when STORE_LSE: each row's natural log-sum-exp
    k_scale_ptr,        # () float32, read when FP8: keys are fp8 * k_scale
    v_scale_ptr,        # () float32, read when FP8
    sinks_ptr,          # (H,) float32, each head's sink logit, read when SINKS
    alibi_ptr,          # (H,) float32, ALiBi's slopes, read when ALIBI
    qk_scale,           # softmax scale * log2(e)
    window,             # sliding window in tokens, 0 = none
    soft_cap,           # the score cap C * log2(e), read when SOFT_CAP
    stride_qt, stride_qh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt,
    group, head_size,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, STORE_LSE: tl.constexpr, SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
    ALIBI: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    tile_start = tl.program_id(1) * BLOCK_Q      # first query (relative to the request) of this tile
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    query_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile_start < query_len:
        seq_len = tl.load(seq_lens_ptr + b)
        context_len = seq_len - query_len

        # 1) rows of the tile: (token, head) pairs
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_SIZE)
        q_off = tile_start + r // group                          # (BLOCK_M,) query index in request
        heads = kvh * group + r % group
        row_mask = (r < BLOCK_Q * group) & (q_off < query_len)
        d_mask = d < head_size
        pos = context_len + q_off                                # absolute positions
        tokens = (q_start + q_off).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        kv_base = cache_ptr + kvh * stride_c_head + t[:, None] * stride_c_slot + d[None, :]

        # 2) keys the tile can see: [lo, hi], hi = its last query's position
        hi = tl.minimum(context_len + tile_start + BLOCK_Q, seq_len) - 1
        lo = tl.where(window > 0, tl.maximum(context_len + tile_start - window + 1, 0), 0)
        first = tl.where(window > 0, pos - window, -1)          # (BLOCK_M,) keys k > first are visible
        if ALIBI:              # log2-scaled like the scores
            slope = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634

        # 3) online softmax page by page; a row may see nothing in a page (window, padding)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for blk in range(lo // BLOCK_SIZE, hi // BLOCK_SIZE + 1):
            page = tl.load(block_table_ptr + b * stride_bt + blk).to(tl.int64)
            k = tl.load(kv_base + page * stride_c_block, mask=d_mask[None, :], other=0.0)
            v = tl.load(kv_base + stride_c_kv + page * stride_c_block, mask=d_mask[None, :], other=0.0)
            if FP8:                # dequantized in float32, then the dot's dtype (vLLM's Triton kernels' way)
                k = (fp8_to_float(k, FP8) * tl.load(k_scale_ptr)).to(q.dtype)
                v = (fp8_to_float(v, FP8) * tl.load(v_scale_ptr)).to(q.dtype)
            elif DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_SIZE)
            if SOFT_CAP:
                s = soft_capped(s, soft_cap)
            kpos = (blk * BLOCK_SIZE + t)[None, :]
            if ALIBI:
                s += slope[:, None] * (kpos - pos[:, None]).to(tl.float32)
            visible = row_mask[:, None] & (kpos <= pos[:, None]) & (kpos > first[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that saw nothing yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        denom = l_i
        if SINKS:              # the sink: one more softmax term with no value (log2-scaled like the scores)
            denom += tl.exp2(tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634 - m_i)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
        if STORE_LSE:          # log2-scaled running max and sum -> natural log-sum-exp
            lse = tl.where(l_i > 0, (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            tl.store(lse_ptr + tokens * stride_lt + heads, lse, mask=row_mask)


def paged_prefill_attention(
    query: torch.Tensor,            # (T, H, D)
    kv_cache: torch.Tensor,         # (2, num_blocks, block_size, KVH, D)
    query_start_loc: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,         # (B,) int32
    block_table: torch.Tensor,      # (B, max_blocks) int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    block_m: int = 64,
    k_scale: torch.Tensor | None = None,  # () float32 on the device: an fp8 cache's keys are fp8 * k_scale
    v_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,      # (T, H) float32, written when given: each row's log-sum-exp
    soft_cap: float | None = None,        # Gemma 2's: each scaled score s becomes C * tanh(s / C)
    sinks: torch.Tensor | None = None,    # (H,) float32 on the device: each head's sink logit (gpt-oss)
    alibi_slopes: torch.Tensor | None = None,  # (H,) float32 on the device: ALiBi's slopes (BLOOM)
) -> torch.Tensor:                  # (T, H, D); rows of tokens past query_start_loc[B] are zeros
    """Causal attention of every request's queries over its cached context (which must already
    hold the new keys and values). ``max_query_len`` is a host int that sizes the grid; a request
    with a longer query would have its tail left at zero, so it must be exact or larger. The
    cache is in the query's dtype or fp8 (float8_e4m3fn / float8_e5m2, dequantized as it is read).
    ``sinks``: head h's softmax has one more term e^sinks[h] with no value behind it (``lse``
    leaves it out)."""
    H, D, block_size, KVH = check_query_and_cache(query, kv_cache)
    T, dev = query.shape[0], query.device
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev)
    B = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=dev)
    check_shape("query_start_loc", query_start_loc, (B + 1,))
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), device=dev)
    check_shape("block_table", block_table, (B, None))
    check_attention_args(H, KVH, D, block_size, sliding_window)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if lse is not None:
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=dev)
        check_shape("lse", lse, (T, H))
        if lse.stride(1) != 1:
            raise ValueError("lse must have unit stride along its heads")
    for name, per_head in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if per_head is not None:
            check_tensor(name, per_head, ndim=1, dtypes=(torch.float32,), device=dev)
            check_shape(name, per_head, (H,))
    out = torch.zeros_like(query)
    if B == 0 or T == 0 or max_query_len <= 0:
        return out

    group = H // KVH
    BLOCK_M = max(block_m, next_power_of_2(group))
    BLOCK_Q = BLOCK_M // group
    grid = (B, triton.cdiv(max_query_len, BLOCK_Q), KVH)
    fmt = fp8_format(kv_cache.dtype)
    k_scale, v_scale = kv_scale_args(kv_cache, k_scale, v_scale)
    cache = kv_cache.view(torch.uint8) if fmt else kv_cache
    _paged_prefill_kernel[grid](
        query, cache, block_table, seq_lens, query_start_loc, out, out if lse is None else lse, k_scale, v_scale,
        out if sinks is None else sinks, out if alibi_slopes is None else alibi_slopes, scale * LOG2E, sliding_window or 0, (soft_cap or 1.0) * LOG2E,
        query.stride(0), query.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_table.stride(0), out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        group, D,
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q, BLOCK_D=max(16, next_power_of_2(D)),
        DOT_F32=dot_in_float32(query.dtype), DOT_PRECISION=dot_precision(query.dtype),
        FP8=fmt, STORE_LSE=lse is not None, SOFT_CAP=bool(soft_cap), SINKS=sinks is not None,
        ALIBI=alibi_slopes is not None,
    )
    return out


def paged_attention_ref(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                        sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """Per request: gather its context token by token (an fp8 cache dequantized: fp8 * scale),
    repeat K/V per query head, mask at absolute positions (causal, and p - W < k when windowed),
    softmax in float32; the scores capped first when ``soft_cap`` (C * tanh(s / C))."""
    T, H, D = query.shape
    block_size, KVH = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros_like(query)
    for b in range(seq_lens.shape[0]):
        start, end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if end == start:
            continue
        kpos = torch.arange(seq_len, device=query.device)
        pages = block_table[b, kpos // block_size].long()
        k = dequantize_kv(kv_cache[0, pages, kpos % block_size], k_scale).repeat_interleave(H // KVH, dim=1)
        v = dequantize_kv(kv_cache[1, pages, kpos % block_size], v_scale).repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("qhd,shd->hqs", query[start:end].float(), k) * scale              # (H, q, S)
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        qpos = torch.arange(seq_len - (end - start), seq_len, device=query.device)[:, None]     # (q, 1)
        hidden = kpos[None, :] > qpos
        if sliding_window is not None:
            hidden |= kpos[None, :] <= qpos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
