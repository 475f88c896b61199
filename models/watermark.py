"""Text watermarking (vLLM's ``--watermark-config``): Gumbel-max sampling whose noise is a keyed
pseudorandom function of the ``context_width`` tokens before the sampled one (Aaronson's
watermark). A watermarked token is still a draw from the request's sampling distribution (the
exponential race the sampler runs anyway, its uniforms taken from the key instead of the random
generator), yet whoever holds the key can tell the text apart: token t after context c scores
-log(1 - u(c, t)), which is Exp(1) for text the key did not choose and larger for text it did,
so a text's total over its n distinct contexts is Gamma(n, 1) without the watermark.

  gumbel            one key
  dual_key_gumbel   two keys derived from the key: key B for a share ``alpha`` of the contexts (the
                    choice itself keyed by the context), key A for the rest; detection weighs both

The PRF is Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC'11) in int64 tensor arithmetic, on
whatever device the logits are: a context's digest chains Philox blocks over its tokens, and each
vocabulary entry's uniform is one Philox block of (token id, digest). The construction is Troupe's
own: text watermarked by Troupe is detected with Troupe's detector (``create_detector``)."""
from __future__ import annotations

import hashlib
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from actors.engine.watermark import WatermarkConfig

MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57            # Philox4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85            # and its Weyl key increments
_CONTEXT = 0x54524354                          # domain words: context digests,
_TOKEN = 0x54524B4E                            # token uniforms,
_ROUTE = 0x54525254                            # dual-key routing


def _mulhilo(multiplier: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of ``multiplier * x`` (x: int64 holding uint32 values), in
    16-bit halves so that no product leaves a signed 64-bit integer."""
    xl, xh = x & 0xFFFF, x >> 16
    ml, mh = multiplier & 0xFFFF, multiplier >> 16
    mid = xl * mh + xh * ml
    low = xl * ml + ((mid & 0xFFFF) << 16)
    high = xh * mh + (mid >> 16) + (low >> 32)
    return high & MASK, low & MASK


def philox(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10: four uint32 words (int64 tensors of one shape, or broadcastable) under a
    two-word key. On the CPU in numpy's uint64, whose products of two 32-bit words are exact
    (four times faster than the 16-bit halves torch's signed int64 needs)."""
    if all(t.device.type == "cpu" for t in (*counter, *key)):
        out = _philox_uint64([t.numpy() for t in counter], [t.numpy() for t in key])
        return tuple(torch.from_numpy(o.astype(np.int64)) for o in out)
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = (hi1 ^ c1 ^ k0) & MASK, lo1, (hi0 ^ c3 ^ k1) & MASK, lo0
        if r < 9:
            k0, k1 = (k0 + _W0) & MASK, (k1 + _W1) & MASK
    return c0, c1, c2, c3


def _philox_uint64(counter: list[np.ndarray], key: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    c0, c1, c2, c3 = (np.asarray(c).astype(np.uint64) for c in counter)
    k0, k1 = (np.asarray(k).astype(np.uint64) for k in key)
    m0, m1, mask, s32 = np.uint64(_M0), np.uint64(_M1), np.uint64(MASK), np.uint64(32)
    w0, w1 = np.uint64(_W0), np.uint64(_W1)
    for r in range(10):
        p0, p1 = c0 * m0, c2 * m1                 # < 2**64: exact
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & mask, (p0 >> s32) ^ c3 ^ k1, p0 & mask
        if r < 9:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
    return c0, c1, c2, c3


def derive_key(key: int, domain: bytes) -> int:
    """A 64-bit key of its own for ``domain`` (dual_key_gumbel's A and B)."""
    return int.from_bytes(hashlib.blake2b(key.to_bytes(8, "big"), digest_size=8, person=domain).digest(), "big")


class PhiloxPRF:
    """u(context, token) in (0, 1) under a 64-bit key."""

    def __init__(self, key: int) -> None:
        if not 0 <= key <= 2 ** 64 - 1:
            raise ValueError("a watermark key is an integer in [0, 2**64)")
        self.key = key

    def _key(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full_like(like, self.key & MASK), torch.full_like(like, self.key >> 32))

    def digest(self, contexts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(N, W) int64 token ids (-1: before the text) -> four (N,) words naming each context."""
        ctx = contexts.to(torch.int64) & MASK
        n, width = ctx.shape
        zero = torch.zeros(n, dtype=torch.int64, device=ctx.device)
        k0, k1 = self._key(zero)
        state = (zero + _CONTEXT, zero + width, zero, zero)
        for b, start in enumerate(range(0, width, 4)):
            words = [ctx[:, start + j] if start + j < width else zero + (MASK - j) for j in range(4)]
            out = philox(tuple(words), (((k0 ^ state[0] ^ state[2]) + b) & MASK, (k1 ^ state[1] ^ state[3]) & MASK))
            state = tuple(o ^ s for o, s in zip(out, state))
        return state

    def uniform(self, contexts: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """contexts (N, W), token_ids (N, T) or (T,) -> (N, T) float64 uniforms in (0, 1)."""
        d0, d1, d2, d3 = (w[:, None] for w in self.digest(contexts))
        tokens = torch.broadcast_to(token_ids.to(torch.int64).to(contexts.device) & MASK,
                                    (contexts.shape[0], token_ids.shape[-1]))
        k0, k1 = self._key(d0)
        out = philox((tokens, d0.expand_as(tokens), d1.expand_as(tokens), d2.expand_as(tokens)),
                     ((k0 ^ d3).expand_as(tokens), (k1 ^ _TOKEN).expand_as(tokens)))
        return (out[0].to(torch.float64) + 0.5) * 2.0 ** -32

    def route(self, contexts: torch.Tensor) -> torch.Tensor:
        """(N, W) -> (N,) float64 uniforms: dual_key_gumbel's keyed choice of key per context."""
        d = self.digest(contexts)
        k0, k1 = self._key(d[0])
        out = philox(d, (k0 ^ _ROUTE, k1))
        return (out[0].to(torch.float64) + 0.5) * 2.0 ** -32


def contexts_of(token_ids: Any, positions: Iterable[int], width: int) -> list[tuple[int, ...]]:
    """The ``width`` tokens before each position (-1 where the text had not begun); ``token_ids``
    a list or a 1-D array."""
    pad = [-1] * width
    out = []
    for p in positions:
        before = token_ids[max(0, p - width):p]
        out.append(tuple((pad + (before.tolist() if hasattr(before, "tolist") else list(before)))[-width:]))
    return out


class _History:
    """The contexts a request has sampled in (or, scope "all", every position of its text): a
    token whose context is among them is sampled without the watermark (its noise would repeat)."""
    __slots__ = ("seen", "order", "upto")

    def __init__(self) -> None:
        self.seen: Counter = Counter()
        self.order: deque = deque()
        self.upto = -1                          # positions below this are in

    def add(self, contexts: list[tuple[int, ...]], limit: int | None) -> None:
        for c in contexts:
            self.seen[c] += 1
            self.order.append(c)
        while limit is not None and len(self.order) > limit:
            old = self.order.popleft()
            self.seen[old] -= 1
            if not self.seen[old]:
                del self.seen[old]


class Watermarker:
    """The worker's side: per step, the keyed uniforms of each row to watermark (its other rows
    draw from the random generator as always)."""

    def __init__(self, settings: WatermarkConfig) -> None:
        self.s = settings
        if settings.algorithm == "dual_key_gumbel":
            self.prfs = (PhiloxPRF(derive_key(settings.key, b"troupe-wm-key-a")),
                         PhiloxPRF(derive_key(settings.key, b"troupe-wm-key-b")))
            self.router = PhiloxPRF(settings.key)
        else:
            self.prfs = (PhiloxPRF(settings.key),)
            self.router = None
        self.history: dict[str, _History] = {}

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.history.pop(rid, None)

    def skips(self, rid: str, token_ids: Any, p: int, num_prompt: int) -> bool:
        """Whether the token at position ``p`` (after ``token_ids[:p]``, of which ``num_prompt``
        are the prompt) is sampled without the watermark: its context was seen
        (deduplicate_contexts), or (scope "all") it is among the first context_width generated."""
        s, width = self.s, self.s.context_width
        if s.deduplicate_contexts == "none":
            return False
        if s.deduplicate_contexts == "all" and p - num_prompt < width:
            return True
        h = self.history.get(rid)
        if h is None:
            h = self.history[rid] = _History()
        first = num_prompt if s.deduplicate_contexts == "single_turn" else 1
        limit = s.deduplicate_contexts_max_history
        start = max(h.upto, first, 0 if limit is None else p - limit)
        if start < p:
            h.add(contexts_of(token_ids, range(start, p), width), limit)
        h.upto = p
        return contexts_of(token_ids, [p], width)[0] in h.seen

    def uniforms(self, contexts: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(N, W) contexts -> (N, vocab_size) float32 uniforms, each row under its key."""
        vocab = torch.arange(vocab_size, device=contexts.device)
        if self.router is None:
            u = self.prfs[0].uniform(contexts, vocab)
        else:
            use_b = self.router.route(contexts) < self.s.alpha
            u = torch.empty(contexts.shape[0], vocab_size, dtype=torch.float64, device=contexts.device)
            for prf, rows in ((self.prfs[0], ~use_b), (self.prfs[1], use_b)):
                if bool(rows.any()):
                    u[rows] = prf.uniform(contexts[rows], vocab)
        # float32 without reaching 0 or 1 (the race takes -log u)
        return u.to(torch.float32).clamp_(torch.finfo(torch.float32).tiny, 1.0 - 2.0 ** -24)


@dataclass(frozen=True)
class WatermarkDetection:
    score: float
    p_value: float
    num_scored_tokens: int
    is_watermarked: bool


class WatermarkDetector:
    """Whether a text (its token ids, as the model's tokenizer reads it) carries the watermark of
    ``settings``' key: each distinct context's token scores -log(1 - u); the p-value is the chance
    that text the key did not choose scores as much (Gamma(n, 1); dual_key_gumbel weighs its two
    keys' scores by 1 - alpha and alpha and matches the moments of their sum)."""

    def __init__(self, settings: WatermarkConfig, p_value_threshold: float = 0.01) -> None:
        if not 0.0 < p_value_threshold < 1.0:
            raise ValueError("p_value_threshold must be between 0 and 1")
        self.s = settings
        self.threshold = p_value_threshold
        self.marker = Watermarker(settings)

    def detect(self, token_ids: list[int]) -> WatermarkDetection:
        width = self.s.context_width
        contexts, targets, seen = [], [], set()
        for p, c in enumerate(contexts_of(list(token_ids), range(len(token_ids)), width)):
            if c not in seen:               # a repeated context repeats its noise: no new evidence
                seen.add(c)
                contexts.append(c)
                targets.append(token_ids[p])
        n = len(targets)
        if n == 0:
            return WatermarkDetection(0.0, 1.0, 0, False)
        ctx = torch.tensor(contexts, dtype=torch.int64).reshape(n, width)
        tgt = torch.tensor(targets, dtype=torch.int64)[:, None]
        scores = [-torch.log1p(-prf.uniform(ctx, tgt)[:, 0]) for prf in self.marker.prfs]
        if len(scores) == 1:
            score = float(scores[0].sum())
            p_value = _gamma_survival(float(n), score)
        else:
            a = self.s.alpha
            score = float(((1 - a) * scores[0] + a * scores[1]).sum())
            v = (1 - a) ** 2 + a ** 2          # each token's weighted score: mean 1, variance v
            p_value = _gamma_survival(n / v, score / v)
        return WatermarkDetection(score, p_value, n, p_value <= self.threshold)


def _gamma_survival(shape: float, x: float) -> float:
    """P(X > x) for X ~ Gamma(shape, 1)."""
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(shape, dtype=torch.float64),
                                         torch.tensor(x, dtype=torch.float64)))


def create_detector(config: WatermarkConfig | dict[str, Any], p_value_threshold: float = 0.01) -> WatermarkDetector:
    """A detector for the watermark of ``config`` (the server's --watermark-config object)."""
    settings = config if isinstance(config, WatermarkConfig) else WatermarkConfig.of(config)
    return WatermarkDetector(settings, p_value_threshold)
