"""The CPU backend's pure-torch attention paths, for the steps and tensors the native kernels do not take."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.fp8 import dequantize_kv, is_fp8


def attend(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           starts: torch.Tensor, query_lens: torch.Tensor, max_query_len: int, scale: float,
           sliding_window: int | None, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None, with_lse: bool = False,
           logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Attention for b requests whose queries are query[starts[i] : starts[i] + query_lens[i]],
    the last query_lens[i] of their seq_lens[i] (int64) tokens, in one SDPA call with every
    request's queries padded to max_query_len. Returns (outputs (n, H, D), their token indices
    (n,)), n = sum(query_lens), and with ``with_lse`` also each output row's log-sum-exp of its
    scaled scores (n, H) float32. An fp8 cache is read as fp8 * k_scale / v_scale. With
    ``logits_soft_cap`` C the scores are capped (C * tanh(s / C)) before the softmax, in plain
    torch (SDPA takes no cap); with ``alibi_slopes`` (H,) each score gains its head's slope times
    (key position - query position), likewise.

    Keys are gathered from a window of nb blocks per request starting at first_block[i]: block 0
    without a sliding window; with one, the block of the oldest key the first query can see, so
    a decode reads about W / block_size blocks however long its context:

        positions  0 ........................ seq_len
        blocks     | 0 | 1 | 2 | 3 | 4 | 5 | 6 |
                           ^first_block    ^ queries (p - W < k <= p)
    """
    _, _, block_size, KVH, D = kv_cache.shape
    b, Q, H = block_table.shape[0], max_query_len, query.shape[1]
    G = H // KVH

    # 1) queries padded to Q per request, heads of a KV group stacked: (b, KVH, G*Q, D)
    j = torch.arange(Q)
    valid = j < query_lens[:, None]                                      # (b, Q)
    tokens = (starts[:, None] + j).masked_fill(~valid, 0)                # (b, Q)
    q = query[tokens].view(b, Q, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(b, KVH, G * Q, D)

    # 2) keys/values of blocks first_block[i] .. + nb through the block table: (b, KVH, L, D)
    first_pos = seq_lens - query_lens                                    # (b,) position of the first query
    if sliding_window is None:
        first_block = torch.zeros_like(seq_lens)
    else:
        first_block = (first_pos - sliding_window + 1).clamp(min=0) // block_size
    nb = int(((seq_lens - 1) // block_size - first_block).max()) + 1
    L = nb * block_size
    block_idx = (first_block[:, None] + torch.arange(nb)).clamp(max=block_table.shape[1] - 1)  # (b, nb)
    blocks = block_table.gather(1, block_idx).reshape(-1).long()          # (b * nb,)
    kv = kv_cache.view(2, kv_cache.shape[1], -1).index_select(1, blocks)  # (2, b * nb, bs * KVH * D)
    if is_fp8(kv.dtype):
        kv = torch.stack([dequantize_kv(kv[0], k_scale), dequantize_kv(kv[1], v_scale)])
    k, v = kv.to(query.dtype).view(2, b, L, KVH, D).transpose(2, 3).unbind(0)  # (b, KVH, L, D) each

    # 3) causal (and window) mask at absolute positions; padded queries take the last position
    pos = torch.minimum(first_pos[:, None] + j, seq_lens[:, None] - 1)   # (b, Q)
    key_pos = first_block[:, None] * block_size + torch.arange(L)        # (b, L)
    mask = key_pos[:, None, :] <= pos[:, :, None]                        # (b, Q, L)
    if sliding_window is not None:
        mask &= key_pos[:, None, :] > pos[:, :, None] - sliding_window
    mask = mask[:, None].expand(b, G, Q, L).reshape(b, 1, G * Q, L)

    if logits_soft_cap or alibi_slopes is not None:
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale                # (b, KVH, G*Q, L)
        if logits_soft_cap:
            scores = torch.tanh_(scores.div_(logits_soft_cap)).mul_(logits_soft_cap)
        if alibi_slopes is not None:
            rel = (key_pos[:, None, :] - pos[:, :, None]).float()                  # (b, Q, L)
            bias = alibi_slopes.float().view(1, KVH, G, 1, 1) * rel[:, None, None]  # (b, KVH, G, Q, L)
            scores += bias.reshape(b, KVH, G * Q, L)
        scores.masked_fill_(~mask, float("-inf"))
        o = (torch.softmax(scores, dim=-1) @ v.float()).to(query.dtype)            # (b, KVH, G*Q, D)
        o = o.view(b, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(b, Q, H, D)
        if not with_lse:
            return o[valid], tokens[valid]
        lse = torch.logsumexp(scores, dim=-1)                                      # (b, KVH, G*Q)
        lse = lse.view(b, KVH, G, Q).permute(0, 3, 1, 2).reshape(b, Q, H)
        return o[valid], tokens[valid], lse[valid]
    if not with_lse:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (b, KVH, G*Q, D)
        o = o.view(b, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(b, Q, H, D)
        return o[valid], tokens[valid]
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))   # (b, 1, G*Q, L)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o, lse = flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)    # (b, KVH, G*Q, D), (b, KVH, G*Q)
    o = o.view(b, KVH, G, Q, D).permute(0, 3, 1, 2, 4).reshape(b, Q, H, D)
    lse = lse.view(b, KVH, G, Q).permute(0, 3, 1, 2).reshape(b, Q, H)
    return o[valid], tokens[valid], lse[valid]


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (L, H, D), k and v (L, KVH, D) of one request with no earlier context -> (L, H, D)."""
    H = q.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0)                                    # (1, H, L, D)
    o = F.scaled_dot_product_attention(q4, _per_query_head(k, H), _per_query_head(v, H),
                                       is_causal=True, scale=scale)       # (1, H, L, D)
    return o[0].transpose(0, 1)                                             # (L, H, D)


def gather_context(kv_cache: torch.Tensor, blocks: torch.Tensor,
                   length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached keys and values (length, KVH, D) of one request's first ``length`` positions,
    in the cache's dtype; ``blocks`` is its row of the block table."""
    _, num_blocks, block_size, KVH, D = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, KVH, D)
    pos = torch.arange(length)
    slots = blocks[pos // block_size].long() * block_size + pos % block_size
    return flat[0].index_select(0, slots), flat[1].index_select(0, slots)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ctx: torch.Tensor,
                    v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk after cached context: q (L, H, D), its own k/v (L, KVH, D), the context's
    (C, KVH, D) -> (L, H, D). Every query sees the whole context and, causally, the chunk; the
    two softmaxes are computed apart (no mask to build, the chunk's masked half skipped) and
    merged by their log-sum-exps."""
    H = q.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0)                                    # (1, H, L, D)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q4, _per_query_head(k_ctx, H), _per_query_head(v_ctx, H), 0.0, False, scale=scale)
    o2, lse2 = flash(q4, _per_query_head(k, H), _per_query_head(v, H), 0.0, True, scale=scale)
    m = torch.maximum(lse1, lse2)                                          # (1, H, L)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    o = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
    return o[0].transpose(0, 1)                                             # (L, H, D)


def _per_query_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Keys or values (N, KVH, D) repeated for each query head of their group -> (1, H, N, D)."""
    return t.transpose(0, 1).repeat_interleave(num_heads // t.shape[1], dim=0).unsqueeze(0)
