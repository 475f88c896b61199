"""A prefix LM's image rows (kernels/attention/prefix_lm.py) against dense attention under
transformers' mask: for two requests in shuffled pages, one with cached context before its
step, an image's positions see each other both ways and the rest causally, a sliding window
bounding what any of them sees behind (an image's own keys too), an fp8 cache read with its
scales; rows outside images are left as they were."""
from __future__ import annotations

import pytest
import torch

from helpers import shuffled_paged_metadata
from kernels.attention.fp8 import quantize_kv
from kernels.attention.prefix_lm import image_rows_attention

H, KVH, D, BS = 4, 2, 8, 4


def dense(q, k, v, positions, image, window, scale):
    """q (n, H, D) at ``positions`` over keys 0..K-1 (K, KVH, D), transformers' mask."""
    kpos = torch.arange(k.shape[0])
    qpos = torch.as_tensor(positions)[:, None]
    visible = (kpos[None] <= qpos) | ((kpos[None] >= image[0]) & (kpos[None] < image[1]) &
                                      (qpos >= image[0]) & (qpos < image[1]))
    if window is not None:
        visible &= qpos - kpos[None] < window
    kk, vv = (t.repeat_interleave(H // KVH, dim=1) for t in (k, v))
    scores = torch.einsum("nhd,thd->hnt", q, kk) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), vv)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fp8", [False, True])
def test_image_rows_see_their_image_both_ways_within_the_window(window, fp8):
    gen = torch.Generator().manual_seed(3)
    reqs = [(0, 14), (6, 10)]                      # (cached context, this step's tokens)
    meta, num_blocks = shuffled_paged_metadata(reqs, BS, gen)
    cache = torch.zeros(2, num_blocks, BS, KVH, D)
    total = [ctx + n for ctx, n in reqs]
    keys = [torch.randn(n, KVH, D, generator=gen) for n in total]
    values = [torch.randn(n, KVH, D, generator=gen) for n in total]
    for r, n in enumerate(total):
        for p in range(n):
            block = int(meta.block_table[r, p // BS])
            cache[0, block, p % BS], cache[1, block, p % BS] = keys[r][p], values[r][p]
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.03)
        cache = torch.stack([quantize_kv(cache[0], torch.float8_e4m3fn, k_scale),
                             quantize_kv(cache[1], torch.float8_e4m3fn, v_scale)])
        keys = [(quantize_kv(k, torch.float8_e4m3fn, k_scale).float() * k_scale) for k in keys]
        values = [(quantize_kv(v, torch.float8_e4m3fn, v_scale).float() * v_scale) for v in values]
    q = torch.randn(sum(n for _, n in reqs), H, D, generator=gen)
    before = torch.randn_like(q)
    out = before.clone()
    # request 0: an image at 3-11 wholly in the step; request 1: an image at 4-12 from cached position 6 on
    images = [(3, 11), (4, 12)]
    spans = ((0, 3, 3, 3, 11), (1, 14 + 0, 6, 4, 12))
    image_rows_attention(out, q, cache, meta, spans, 0.3, window, None, k_scale, v_scale)
    for (r, row, first, start, end), (ctx, _) in zip(spans, reqs):
        n = end - first
        want = dense(q[row:row + n], keys[r][:end], values[r][:end], range(first, end), images[r], window, 0.3)
        torch.testing.assert_close(out[row:row + n], want, atol=1e-5, rtol=1e-5)
    touched = torch.zeros(len(q), dtype=torch.bool)
    for _, row, first, _, end in spans:
        touched[row:row + end - first] = True
    assert torch.equal(out[~touched], before[~touched])
