"""The slow, plain paged attention every backend is tested against."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionMetadata
from kernels.attention.fp8 import dequantize_kv, is_fp8, quantize_kv


def reference_paged_attention(
    query: torch.Tensor,     # (T, H, D)
    key: torch.Tensor,       # (T, KVH, D)
    value: torch.Tensor,     # (T, KVH, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D), written in place
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | float | None = None,   # fp8 caches: stored fp8(k / k_scale), read fp8 * k_scale
    v_scale: torch.Tensor | float | None = None,
    logits_soft_cap: float | None = None,          # scores capped: C * tanh(s / C)
    sinks: torch.Tensor | None = None,             # (H,) each head's sink logit, a softmax term with no value
    alibi_slopes: torch.Tensor | None = None,      # (H,) ALiBi: each score + slope * (key pos - query pos)
) -> torch.Tensor:           # (T, H, D); rows of padding tokens are zero
    """Slow and plain: write token by token, then per request gather its context block by block,
    repeat K/V per query head, softmax with a causal mask (and p - W < k with a window W)."""
    bs = meta.block_size
    fp8 = is_fp8(kv_cache.dtype)
    store = kv_cache.view(torch.uint8) if fp8 else kv_cache      # torch assigns fp8 only through bytes
    for t in range(query.shape[0]):
        slot = int(meta.slot_mapping[t])
        if slot >= 0:
            k, v = quantize_kv(key[t], kv_cache.dtype, k_scale), quantize_kv(value[t], kv_cache.dtype, v_scale)
            store[0, slot // bs, slot % bs] = k.view(torch.uint8) if fp8 else k
            store[1, slot // bs, slot % bs] = v.view(torch.uint8) if fp8 else v
    out = torch.zeros_like(query)
    group = query.shape[1] // key.shape[1]
    for i in range(meta.num_reqs):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        seq_len = int(meta.seq_lens[i])
        blocks = [int(meta.block_table[i, n // bs]) for n in range(seq_len)]
        k = torch.stack([kv_cache[0, blocks[n], n % bs] for n in range(seq_len)])   # (S, KVH, D)
        v = torch.stack([kv_cache[1, blocks[n], n % bs] for n in range(seq_len)])   # (S, KVH, D)
        k = dequantize_kv(k, k_scale).repeat_interleave(group, dim=1).transpose(0, 1)  # (H, S, D) float32
        v = dequantize_kv(v, v_scale).repeat_interleave(group, dim=1).transpose(0, 1)  # (H, S, D)
        q = query[start:end].transpose(0, 1).float()                                # (H, q, D)
        scores = q @ k.transpose(1, 2) * scale                                      # (H, q, S)
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        k_pos = torch.arange(seq_len)[None, :]                                      # (1, S)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * (k_pos - q_pos[:, None]).float()
        hidden = k_pos > q_pos[:, None]                                             # (q, S)
        if sliding_window is not None:
            hidden |= k_pos <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:     # one more column per head, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)                # (q, H, D)
    return out
