"""Cascade attention: when every request of a step shares its first blocks (a common system
prompt served from the prefix cache), attention over those blocks is computed once for all the
step's queries, and each request's attention over the rest of its context is merged into it.

    positions   0 ............ P ................ seq_len[i]
                | shared prefix | request i's suffix (its queries are in here)
                  one pass,       the backend's usual paged attention, from block P / block_size
                  every query     on (causal at positions shifted by P, unchanged relations)
                  of the step
                        \\____ merged by log-sum-exp (merge_attn_states) ____/

The prefix needs no causal mask: P is capped so that every query sits at a position >= P. This
module owns the decision (``common_prefix_len``, ``use_cascade_attention``) and the torch pieces
the backends share (``prefix_attention``, ``merge_attn_states``, ``suffix_view``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from kernels.attention.base import AttentionMetadata
from kernels.attention.fp8 import dequantize_kv

MIN_PREFIX_TOKENS = 256    # shorter shared prefixes are not worth a second pass (vLLM's threshold)
MIN_REQUESTS = 8           # fewer requests read the prefix too few times to gain (vLLM's threshold)
QUERY_TILE = 64            # query rows (tokens x query heads of one KV head) one pass over keys serves
MERGE_COST = 3.0           # merging one query row, in key reads: two partial rows read, one written
FIXED_COST = 256.0         # the extra launches and passes of a cascade step, in key reads


def common_prefix_len(block_table: np.ndarray, num_blocks: np.ndarray, num_computed_tokens: np.ndarray,
                      block_size: int) -> int:
    """Tokens at the head of every request's context stored in the very same blocks.

    block_table (B, M) int32 of the step's requests, num_blocks (B,) of them in use, and
    num_computed_tokens (B,) tokens already in the cache before this step. The count is capped
    at the fewest computed tokens, so that every query lies after the prefix, and rounded down
    to whole blocks; 0 when the batch has fewer than two requests."""
    B = block_table.shape[0]
    if B < 2:
        return 0
    n = int(num_blocks.min())
    same = (block_table[:, :n] == block_table[:1, :n]).all(axis=0)          # (n,)
    shared = n if same.all() else int(np.argmin(same))                      # first column that differs
    tokens = min(shared * block_size, int(num_computed_tokens.min()))
    return tokens // block_size * block_size


def use_cascade_attention(prefix_len: int, query_lens: np.ndarray, num_heads: int, num_kv_heads: int,
                          sliding_window: int | None = None, min_prefix: int = MIN_PREFIX_TOKENS) -> bool:
    """Whether cascade attention should beat plain attention for a step whose B requests (query
    lengths ``query_lens``) share ``prefix_len`` tokens.

    Refused outright for a prefix under ``min_prefix`` tokens (MIN_PREFIX_TOKENS, or more for a
    backend whose plain path is cheaper: ``AttentionBackend.cascade_min_prefix``), under
    MIN_REQUESTS requests, or a sliding window. Otherwise a rough cost model, in key reads (one prefix position's K and V
    read by one pass, per KV head; both paths do the same multiply-adds, what differs is how
    often the prefix is read and the merge):

        a pass over the keys serves QUERY_TILE query rows (G = num_heads / num_kv_heads
        rows per token), so request i's plain attention reads the prefix ceil(q_i G / TILE)
        times, and the cascade's single batched pass reads it ceil(T G / TILE) times:

        plain   = P * sum_i ceil(q_i G / TILE)
        cascade = P * ceil(T G / TILE) + MERGE_COST * T * G + FIXED_COST

    Decode steps (q_i = 1) gain about B-fold on the prefix; long prompt chunks fill their tiles
    already, so there cascade only adds the merge and is refused."""
    B = len(query_lens)
    if prefix_len < max(min_prefix, MIN_PREFIX_TOKENS) or B < MIN_REQUESTS or sliding_window is not None:
        return False
    G = num_heads // num_kv_heads
    q = np.asarray(query_lens, dtype=np.int64)
    T = int(q.sum())
    plain = prefix_len * int(((q * G + QUERY_TILE - 1) // QUERY_TILE).sum())
    cascade = prefix_len * math.ceil(T * G / QUERY_TILE) + MERGE_COST * T * G + FIXED_COST
    return cascade < plain


def cascade_prefix_len(block_table: np.ndarray, num_blocks: np.ndarray, num_computed_tokens: np.ndarray,
                       query_lens: np.ndarray, block_size: int, num_heads: int, num_kv_heads: int,
                       sliding_window: int | None = None, min_prefix: int = MIN_PREFIX_TOKENS) -> int:
    """The step's ``AttentionMetadata.common_prefix_len``: the shared prefix
    (``common_prefix_len``) when ``use_cascade_attention`` takes it, else 0."""
    if len(query_lens) < MIN_REQUESTS or sliding_window is not None:
        return 0
    P = common_prefix_len(block_table, num_blocks, num_computed_tokens, block_size)
    return P if use_cascade_attention(P, query_lens, num_heads, num_kv_heads, sliding_window, min_prefix) else 0


class SuffixView(NamedTuple):
    """The step's requests seen from the end of the shared prefix on."""
    block_table: torch.Tensor   # (B, max_blocks - P / block_size) int32, a view of the step's table
    seq_lens: torch.Tensor      # (B,) int32, seq_lens - P


def suffix_view(meta: AttentionMetadata) -> SuffixView:
    """Request i's blocks and length past the prefix: attention over these with the step's
    query_start_loc is causal attention over the suffix, every position shifted by P (relative
    order, hence the mask, unchanged)."""
    B, P = meta.num_reqs, meta.common_prefix_len
    return SuffixView(meta.block_table[:B, P // meta.block_size:], meta.seq_lens[:B] - P)


def gather_prefix(kv_cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix's keys and values (P, KVH, D) in ``dtype``, read once from the first
    request's blocks (an fp8 cache dequantized: fp8 * scale)."""
    _, _, bs, KVH, D = kv_cache.shape
    P = meta.common_prefix_len
    blocks = meta.block_table[0, :P // bs]                                  # (P / bs,)
    first = int(blocks[0])
    if kv_cache.device.type == "cpu" and bool((blocks == first + torch.arange(len(blocks))).all()):
        kv = kv_cache[:, first:first + len(blocks)]                        # consecutive blocks: a view
    else:
        kv = kv_cache.index_select(1, blocks.long())                       # (2, P / bs, bs, KVH, D)
    k = dequantize_kv(kv[0].reshape(P, KVH, D), k_scale, dtype)
    v = dequantize_kv(kv[1].reshape(P, KVH, D), v_scale, dtype)
    return k, v


def prefix_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query (T, H, D) against the same keys and values (P, KVH, D), no mask: per KV
    head one (T * G, D) x (D, P) product, G = H / KVH. Returns (out (T, H, D) in the query's
    dtype, lse (T, H) float32, the log-sum-exp of each row's scaled scores)."""
    T, H, D = query.shape
    KVH = k.shape[1]
    G = H // KVH
    q = query.view(T, KVH, G, D).permute(1, 0, 2, 3).reshape(1, KVH, T * G, D)   # (1, KVH, T*G, D)
    kk, vv = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)      # (1, KVH, P, D)
    if query.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o, lse = flash(q, kk, vv, 0.0, False, scale=scale)          # (1, KVH, T*G, D), (1, KVH, T*G)
    else:
        s = (q.float() @ kk.float().transpose(-1, -2)) * scale       # (1, KVH, T*G, P)
        lse = torch.logsumexp(s, -1)
        o = ((s - lse.unsqueeze(-1)).exp() @ vv.float()).to(query.dtype)
    out = o.view(KVH, T, G, D).permute(1, 0, 2, 3).reshape(T, H, D)
    return out, lse.view(KVH, T, G).permute(1, 0, 2).reshape(T, H).float()


def merge_attn_states(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, suffix_out: torch.Tensor,
                      suffix_lse: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the union of two key sets from attention over each: outputs (N, H, D),
    their log-sum-exps (N, H) float32. Weighted by exp(lse - max); a side with lse -inf (no
    keys) weighs 0. Written into ``out`` (N, H, D) when given, else a new tensor in the
    outputs' dtype."""
    m = torch.maximum(prefix_lse, suffix_lse)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)                 # (N, H)
    wp, ws = (prefix_lse - m).exp(), (suffix_lse - m).exp()                 # (N, H)
    total = (wp + ws).clamp(min=torch.finfo(torch.float32).tiny)
    merged = (prefix_out.float() * (wp / total).unsqueeze(-1)
              + suffix_out.float() * (ws / total).unsqueeze(-1))            # (N, H, D)
    if out is None:
        return merged.to(prefix_out.dtype)
    out.copy_(merged)
    return out
