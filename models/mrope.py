"""M-RoPE's positions (Qwen2-VL's and Qwen2.5-VL's multimodal rotary): each prompt position has
three rows (time, height, width). A text token's rows agree and count on from the position
before it; an image's tokens take its grid's coordinates, (0, row, column) of its merged patches
offset by the position it starts at, and the text after it counts on from that position plus the
longer of its grid's sides. A video's take (time, row, column), its time the temporal patch's
index times its seconds (``second_per_grid_ts``) times the model's tokens per second (Qwen2.5-VL's;
Qwen2-VL's count 1 a patch), and the text after it counts on from past its largest position
(vLLM's rule, which for an image is the one above). Qwen3-VL's video writes each temporal patch's
timestamp as text before it: each patch is then placed as an image of its own, the text between
them counting on. Tokens past the prompt continue from the prompt's last position plus
one (the request's ``delta`` added to their index), all rows alike.

Torch-free: the worker computes a request's positions once, when it joins the batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from actors.engine.messages import MultiModalFeature


def mrope_positions(num_prompt_tokens: int, features: Sequence[MultiModalFeature],
                    merge_size: int, tokens_per_second: float = 1.0) -> tuple[np.ndarray, int]:
    """(the prompt's positions (3, num_prompt_tokens) int64, the delta of the positions after it:
    position of index i >= num_prompt_tokens is i + delta) for a prompt holding ``features``
    (images with their processor's ``image_grid_thw``, videos with ``video_grid_thw``, patches
    merged ``merge_size`` per side; a video's time positions ``tokens_per_second`` a second)."""
    out = np.empty((3, num_prompt_tokens), dtype=np.int64)
    index = position = 0
    for lo, hi, times, h, w in _blocks(features, num_prompt_tokens, merge_size, tokens_per_second):
        if lo < index:
            raise ValueError(f"an image's positions {lo}..{hi} overlap another's")
        out[:, index:lo] = position + np.arange(lo - index)
        position += lo - index
        tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
        out[:, lo:hi] = position + np.stack((tt.ravel(), hh.ravel(), ww.ravel()))
        position += max(int(times[-1]) + 1, h, w)
        index = hi
    out[:, index:] = position + np.arange(num_prompt_tokens - index)
    position += num_prompt_tokens - index
    return out, position - num_prompt_tokens


def _blocks(features: Sequence[MultiModalFeature], num_prompt_tokens: int, merge_size: int,
            tokens_per_second: float) -> list[tuple[int, int, np.ndarray, int, int]]:
    """The prompt's runs of grid positions, in order: (first, end, the time rows' values, merged
    rows, merged columns). An image or a video is one run over its embeddings; a video whose
    embeddings come in one run per temporal patch (Qwen3-VL's, its timestamps' text between them)
    is that many runs of one patch each, each placed as an image."""
    out = []
    for feature in sorted(features, key=lambda f: f.offset):
        lo, hi = feature.embed_span
        if hi > num_prompt_tokens:
            raise ValueError(f"an image's positions {lo}..{hi} pass the prompt's end")
        video = feature.modality == "video"
        grid = feature.data.get("video_grid_thw" if video else "image_grid_thw")
        if grid is None:
            raise ValueError(f"an {feature.modality} for M-RoPE positions needs its grid ({feature.modality}_grid_thw)")
        t, h, w = (int(v) for v in np.asarray(grid).reshape(-1)[:3])
        h, w = h // merge_size, w // merge_size
        runs = _runs(feature)
        if len(runs) > 1:
            if len(runs) != t or any(b - a != h * w for a, b in runs):
                raise ValueError(f"an {feature.modality}'s grid {t}x{h}x{w} (merged) does not match its {len(runs)} "
                                 "runs of embeddings")
            out += [(a, b, np.zeros(1, np.int64), h, w) for a, b in runs]
            continue
        if t * h * w != hi - lo:
            raise ValueError(f"an {feature.modality}'s grid {t}x{h}x{w} (merged) does not cover its {hi - lo} positions")
        times = np.arange(t)
        if video:
            seconds = feature.data.get("second_per_grid_ts")
            factor = (1.0 if seconds is None else float(np.asarray(seconds).reshape(-1)[0])) * tokens_per_second
            if factor != 1.0:
                times = (times * factor).astype(np.int64)
        out.append((lo, hi, times, h, w))
    return out


def _runs(feature: MultiModalFeature) -> list[tuple[int, int]]:
    """The prompt positions of a feature's embeddings as runs (first, end)."""
    if feature.is_embed is None:
        return [(feature.offset, feature.end)]
    at = np.flatnonzero(feature.is_embed)
    breaks = np.flatnonzero(np.diff(at) > 1)
    starts = np.concatenate(([at[0]], at[breaks + 1]))
    ends = np.concatenate((at[breaks], [at[-1]])) + 1
    return [(feature.offset + int(a), feature.offset + int(b)) for a, b in zip(starts, ends)]
