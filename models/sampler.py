"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one batch (row i = logits row i)."""

    temperature: torch.Tensor                 # (B,) float32; 0 = greedy
    top_p: torch.Tensor                       # (B,) float32; 1.0 = off
    top_k: torch.Tensor                       # (B,) int64; 0 or -1 = off
    generators: dict[int, torch.Generator]    # row -> its seeded generator; other rows use the global RNG
    all_greedy: bool
    no_top_p: bool
    no_top_k: bool

    @classmethod
    def from_lists(cls, temperature: Sequence[float], top_p: Sequence[float] | None = None,
                   top_k: Sequence[int] | None = None,
                   generators: Sequence[torch.Generator | None] | None = None) -> "SamplingMetadata":
        B = len(temperature)
        top_p = [1.0] * B if top_p is None else list(top_p)
        top_k = [0] * B if top_k is None else list(top_k)
        gens = {} if generators is None else {i: g for i, g in enumerate(generators) if g is not None}
        if not (len(top_p) == len(top_k) == B):
            raise ValueError("temperature, top_p and top_k need one entry per row")
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.int64),
            generators=gens,
            all_greedy=all(t == 0 for t in temperature),
            no_top_p=all(p >= 1.0 for p in top_p),
            no_top_k=all(k <= 0 for k in top_k),
        )


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # logits (B, V) -> token ids (B,) int64
        logits = logits.float()
        greedy = logits.argmax(dim=-1)                                    # (B,)
        if meta.all_greedy:
            return greedy
        temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
        logits = logits / temperature[:, None]
        if not (meta.no_top_k and meta.no_top_p):
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)                                    # (B, V)
        sampled = (probs / exponential_noise(probs, meta.generators)).argmax(dim=-1)
        return torch.where(meta.temperature > 0, sampled, greedy)


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape; argmax(probs / q) is a draw from probs (exponential race).
    A seeded row draws its own V values from its own generator, so its tokens do not depend on
    the rest of the batch."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return q


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (smallest set with mass >= top_p) to -inf.
    logits (B, V); top_k (B,) with <= 0 meaning off; top_p (B,) with 1.0 meaning off."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)        # (B, V) ascending
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)                     # (B,)
    kth_largest = sorted_logits.gather(1, (V - k)[:, None])              # (B, 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)              # (B, V)
    drop = cum_probs <= (1.0 - top_p)[:, None]                            # the low tail outside the nucleus
    drop[:, -1] = False                                                   # always keep the top token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)
