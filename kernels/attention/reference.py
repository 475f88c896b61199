"""The slow, plain paged attention every backend is tested against."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionMetadata


def reference_paged_attention(
    query: torch.Tensor,     # (T, H, D)
    key: torch.Tensor,       # (T, KVH, D)
    value: torch.Tensor,     # (T, KVH, D)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D), written in place
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:           # (T, H, D); rows of padding tokens are zero
    """Slow and plain: write token by token, then per request gather its context block by block,
    repeat K/V per query head, softmax with a causal mask (and p - W < k with a window W)."""
    bs = meta.block_size
    for t in range(query.shape[0]):
        slot = int(meta.slot_mapping[t])
        if slot >= 0:
            kv_cache[0, slot // bs, slot % bs] = key[t]
            kv_cache[1, slot // bs, slot % bs] = value[t]
    out = torch.zeros_like(query)
    group = query.shape[1] // key.shape[1]
    for i in range(meta.num_reqs):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        seq_len = int(meta.seq_lens[i])
        blocks = [int(meta.block_table[i, n // bs]) for n in range(seq_len)]
        k = torch.stack([kv_cache[0, blocks[n], n % bs] for n in range(seq_len)])   # (S, KVH, D)
        v = torch.stack([kv_cache[1, blocks[n], n % bs] for n in range(seq_len)])   # (S, KVH, D)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()               # (H, S, D)
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()               # (H, S, D)
        q = query[start:end].transpose(0, 1).float()                                # (H, q, D)
        scores = q @ k.transpose(1, 2) * scale                                      # (H, q, S)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        k_pos = torch.arange(seq_len)[None, :]                                      # (1, S)
        hidden = k_pos > q_pos[:, None]                                             # (q, S)
        if sliding_window is not None:
            hidden |= k_pos <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)   # (q, H, D)
    return out
