"""A prefix LM's images (Gemma 3's, PaliGemma's: vLLM's ``is_mm_prefix_lm``): an image's
positions attend to each other both ways, every other position causally. The paged kernels
attend causally; the rows of a step's image positions are then attended again here, in torch,
each over its request's keys up to the image's end as the cache holds them: key k is visible to
the query at p when k <= p or both are positions of the same image, and, in a sliding layer of
window W, p - k < W (transformers' masks: OR(causal, image), AND the window). The scheduler
never ends a step inside such an image (vLLM's ``disable_chunked_mm_input``), so its keys are all
in the cache when its rows are attended."""
from __future__ import annotations

import torch

from kernels.attention.base import AttentionMetadata
from kernels.attention.fp8 import dequantize_kv


def image_rows_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         spans: tuple[tuple[int, int, int, int, int], ...], scale: float,
                         sliding_window: int | None = None, softcap: float | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``out`` (T, H, D): the causal attention of the step's queries ``q`` (T, H, D), its rows of
    image positions replaced by their attention with the image visible both ways. ``meta``: the
    layer's group's (its block table); ``spans``: the step's (``AttentionMetadata.mm_prefix_spans``)."""
    _, num_blocks, bs, KVH, D = kv_cache.shape
    H = q.shape[1]
    G = H // KVH
    keys = kv_cache[0].reshape(num_blocks * bs, KVH, D)
    values = kv_cache[1].reshape(num_blocks * bs, KVH, D)
    for request, row, first, start, end in spans:
        n = end - first                                         # the image's positions in this step
        lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
        pos = torch.arange(lo, end, device=q.device)
        blocks = meta.block_table[request].to(q.device).long()
        slots = blocks[pos // bs] * bs + pos % bs
        k = dequantize_kv(keys.index_select(0, slots), k_scale, torch.float32)     # (K, KVH, D)
        v = dequantize_kv(values.index_select(0, slots), v_scale, torch.float32)
        qpos = torch.arange(first, end, device=q.device)[:, None]                  # (n, 1)
        visible = (pos[None, :] <= qpos) | ((pos[None, :] >= start) & (pos[None, :] < end))   # (n, K)
        if sliding_window is not None:              # the window bounds the keys behind, an image's too
            visible &= qpos - pos[None, :] < sliding_window
        qs = q[row:row + n].float().view(n, KVH, G, D)
        scores = torch.einsum("nkgd,tkd->kgnt", qs, k) * scale                     # (KVH, G, n, K)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        rows = torch.einsum("kgnt,tkd->nkgd", probs, v).reshape(n, H, D)
        out[row:row + n] = rows.to(out.dtype)
