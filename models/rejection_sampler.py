"""Rejection sampling for speculative decoding: which of a request's k draft tokens the target
accepts, and the one token it adds (recovered at the first rejection, bonus when all k pass), so
that the emitted tokens are distributed exactly as the target's own sampling would draw them
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; vLLM's
``RejectionSampler``). Vocabulary:

    accepted   draft tokens the target keeps
    recovered  the token drawn from the residual normalize(max(0, p - q)) at the first rejection
    bonus      the token drawn from the target at position k when every draft is accepted

Layout (vLLM's): B requests, request i with k_i >= 0 drafts, N = sum k_i, K = max k_i:

    draft_token_ids      (N,)       request 0's drafts, then request 1's, ...
    cu_num_draft_tokens  (B,)       inclusive cumulative sum of k_i
    draft_probs          (N, V)     the draft's distribution at each draft; None (n-gram): a point
                                    mass on the draft token, as vLLM treats n-gram drafts
    target_logits        (N + B, V) request i's k_i + 1 rows: each draft position, then the bonus
                                    position; already through the processors that may move the
                                    argmax (steps 3-8 of models/sampler.py's chain, per position)
    output               (B, K + 1) int64: accepted drafts, then the recovered or bonus token,
                                    then PLACEHOLDER_TOKEN_ID (-1)

Per request, positions j = 0 .. k_i - 1 in order, stopping at the first rejection:
  greedy row: accept x_j iff x_j == argmax target_j; emit the argmax where it stopped (the bonus
              argmax at position k_i when all pass): exactly the target's greedy chain
  random row: accept x_j iff u_j < p_j(x_j) / q_j(x_j), u_j ~ U[0, 1); at the first rejection
              emit a draw from normalize(max(0, p_j - q_j)); when all pass, a draw from p_k
p is the target's distribution after temperature, min_p, top-k and top-p, computed as
``models.sampler.Sampler`` computes it. Draws are the sampler's exponential race, argmax(p / e),
with one Exp(1) row e per request: only one of a request's candidate distributions is drawn from.

Random numbers: a seeded request draws from its own generator, first its race row (the V values
the plain sampler draws for one token), then its k_i acceptance uniforms. A request with no
drafts therefore draws its token exactly as the plain sampler would.

Point-mass drafts (``draft_probs`` None: n-gram lookup, a draft model's greedy drafts) take the
coupled form instead: every position j draws its own race row e_j, the token the target samples
there is x*_j = argmax(p_j / e_j), a draft is accepted iff it equals x*_j, and the token emitted
where the walk stops is x*_j. Accepting with probability p_j(x_j) and otherwise drawing from p_j
without x_j is exactly the standard rule for q = a point mass, so the output distribution is the
same; and since a seeded request's race rows come from its own generator one per position, in
order, as the plain sampler draws them, and ``rewind_generators`` then puts the generator back
after the rows of the tokens emitted, a seeded request samples exactly the tokens it samples
without speculation, whatever drafts it got, and resumes after a preemption where it was.

On CUDA the acceptance walk and the draw run as one Triton kernel
(kernels/triton/rejection_sample.py), fed the same probabilities and random numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from kernels.cpu.native import argmax_rows
from kernels.triton import fused as triton_fused
from models.sampler import (_SAMPLING_EPS, SamplingMetadata, apply_min_p, apply_top_k_only,
                            apply_top_k_top_p, draw_row_noise, exponential_noise)

PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class SpecDecodeMetadata:
    """The draft tokens of one batch (row i = request i), flattened."""

    draft_token_ids: torch.Tensor        # (N,) int64
    num_draft_tokens: list[int]          # (B,) k_i, on the host
    cu_num_draft_tokens: torch.Tensor    # (B,) int64, inclusive cumulative sum of k_i
    max_spec_len: int                    # K = max k_i (0 for none)

    @classmethod
    def from_lists(cls, draft_token_ids: Sequence[Sequence[int]],
                   device: torch.device | str = "cpu") -> SpecDecodeMetadata:
        """One list of draft tokens per request (empty: none)."""
        num = [len(d) for d in draft_token_ids]
        flat = [int(t) for d in draft_token_ids for t in d]
        cu = torch.tensor(num, dtype=torch.int64).cumsum(0)
        return cls(torch.tensor(flat, dtype=torch.int64, device=device), num, cu.to(device),
                   max(num, default=0))

    @property
    def num_rows(self) -> torch.Tensor:
        """(B,) int64: each request's target rows, k_i + 1."""
        cu = self.cu_num_draft_tokens
        return torch.diff(cu, prepend=cu.new_zeros(1)) + 1


class RejectionSampler:
    """The batch is in SpecDecodeMetadata and SamplingMetadata (one row per request); the only
    state kept is ``generator_states`` of the last call (point-mass drafts): for each seeded
    request, its generator's state before each of its race rows and after the last, which
    ``rewind_generators`` uses once the emitted tokens are known."""

    def __init__(self) -> None:
        self.generator_states: dict[int, list[torch.Tensor]] = {}

    def __call__(self, target_logits: torch.Tensor, draft_probs: torch.Tensor | None,
                 spec: SpecDecodeMetadata, meta: SamplingMetadata) -> torch.Tensor:
        """target_logits (N + B, V) any float dtype, never written; draft_probs (N, V) float32 or
        None. Returns the (B, K + 1) int64 output described in the module docstring."""
        N, B = spec.draft_token_ids.shape[0], len(spec.num_draft_tokens)
        if target_logits.dim() != 2 or target_logits.shape[0] != N + B:
            raise ValueError(f"target_logits must be ({N} drafts + {B} requests, V), "
                             f"got {tuple(target_logits.shape)}")
        if draft_probs is not None and draft_probs.shape != (N, target_logits.shape[1]):
            raise ValueError(f"draft_probs must be ({N}, {target_logits.shape[1]}), got {tuple(draft_probs.shape)}")
        logits = target_logits.to(torch.float32, copy=True)                  # (T, V) owned
        target_argmax = argmax_rows(logits)                                    # (T,)
        is_greedy = meta.temperature < _SAMPLING_EPS                          # (B,)
        self.generator_states = {}
        if meta.all_greedy:
            probs, uniforms, noise = logits, logits.new_empty(N), logits.new_empty(B, logits.shape[1])
        elif draft_probs is None:      # the coupled race: each position's sample, then the greedy walk
            probs = target_probs(logits, spec, meta)                           # (T, V)
            race, self.generator_states = draw_position_noise(spec, meta, logits.shape[1], logits.device)
            greedy_row = torch.repeat_interleave(is_greedy, spec.num_rows, output_size=logits.shape[0])
            target_argmax = torch.where(greedy_row, target_argmax, argmax_rows(probs / race))
            is_greedy = torch.ones_like(is_greedy)
            uniforms, noise = logits.new_empty(N), logits.new_ones(B, logits.shape[1])
        else:
            probs = target_probs(logits, spec, meta)                           # (T, V)
            noise, uniforms = draw_random(spec, meta, logits.shape[1], logits.device)
        draft_probs = None if draft_probs is None else draft_probs.to(torch.float32).contiguous()
        args = (spec.draft_token_ids, spec.cu_num_draft_tokens, spec.max_spec_len, draft_probs,
                probs, target_argmax, is_greedy, uniforms, noise)
        if triton_fused.supports(probs, *(t for t in args if isinstance(t, torch.Tensor))):
            from kernels.triton.rejection_sample import rejection_sample as launch
            return launch(*args)
        return rejection_sample(*args)

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor) -> list[list[int]]:
        """(B, K + 1) -> each request's emitted tokens (one host synchronisation)."""
        return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in output_token_ids.tolist()]


def target_probs(logits: torch.Tensor, spec: SpecDecodeMetadata, meta: SamplingMetadata) -> torch.Tensor:
    """logits (T, V) float32, owned -> (T, V) probabilities: temperature, min_p, top-k, top-p of
    each request applied to all its rows, as ``Sampler.sample`` applies them (greedy rows:
    temperature 1, no truncation; they only read the argmax)."""
    rows = spec.num_rows                                                       # (B,)
    T = logits.shape[0]
    per_row = lambda x: torch.repeat_interleave(x, rows, output_size=T)      # (B,) -> (T,)
    logits.div_(per_row(torch.where(meta.temperature < _SAMPLING_EPS, 1.0, meta.temperature))[:, None])
    if not meta.no_min_p:
        apply_min_p(logits, per_row(meta.min_p))
    if not meta.no_top_p:
        logits = apply_top_k_top_p(logits, per_row(meta.top_k), per_row(meta.top_p))
    elif not meta.no_top_k:
        apply_top_k_only(logits, per_row(meta.top_k), meta.max_top_k)
    return logits.softmax(dim=-1)


def draw_random(spec: SpecDecodeMetadata, meta: SamplingMetadata, V: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the race noise (B, V) float32 Exp(1) and the acceptance uniforms (N,) float32. A seeded
    request draws its race row, then its k_i uniforms, from its own generator."""
    B, N = len(spec.num_draft_tokens), spec.draft_token_ids.shape[0]
    noise = exponential_noise(torch.empty(B, V, dtype=torch.float32, device=device), meta.generators)
    uniforms = torch.rand(N, dtype=torch.float32, device=device)
    if meta.generators:
        cu = [0, *accumulate(spec.num_draft_tokens)]                         # on the host: no sync
        for i, gen in meta.generators.items():
            if cu[i + 1] > cu[i]:
                uniforms[cu[i]:cu[i + 1]].uniform_(generator=gen)
    return noise, uniforms


def draw_position_noise(spec: SpecDecodeMetadata, meta: SamplingMetadata, V: int, device: torch.device
                        ) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """-> the race noise (N + B, V) float32 Exp(1), one row per verified position, and for each
    seeded request the states of its generator around its rows (k_i + 2 of them): its rows come
    from its own generator, in order, one per position, as the plain sampler draws a token's."""
    T = spec.draft_token_ids.shape[0] + len(spec.num_draft_tokens)
    u = torch.empty(T, V, dtype=torch.float32, device=device)
    if len(meta.generators) < len(spec.num_draft_tokens):
        u.uniform_()
    cu = [0, *accumulate(k + 1 for k in spec.num_draft_tokens)]
    states: dict[int, list[torch.Tensor]] = {}
    for i, gen in meta.generators.items():
        states[i] = [gen.get_state()]
        for row in range(cu[i], cu[i + 1]):
            draw_row_noise(u[row], gen)
            states[i].append(gen.get_state())
    return u.log_().neg_(), states


def rewind_generators(states: dict[int, list[torch.Tensor]], generators: dict[int, torch.Generator],
                      emitted: list[list[int]]) -> None:
    """Each seeded request's generator back to just after the race rows of the tokens it emitted
    (the rows of rejected positions are drawn again when those positions are)."""
    for i, st in states.items():
        generators[i].set_state(st[len(emitted[i])])


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(R, V) -> max(0, p - q), unnormalised (the race needs no normalisation); p itself on a row
    where that is all zero (rounding only: a rejection implies p(x) < q(x) somewhere)."""
    residual = (p - q).clamp_min_(0.0)
    return torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p)


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_spec_len: int,
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     target_argmax: torch.Tensor, is_greedy: torch.Tensor, uniforms: torch.Tensor,
                     exp_noise: torch.Tensor) -> torch.Tensor:
    """Vectorised torch: the arguments and result of ``kernels.triton.rejection_sample``'s
    launcher, one loop-free pass over the N drafts, then over B rows of V."""
    N, B, K, V = draft_token_ids.shape[0], cu_num_draft_tokens.shape[0], max_spec_len, target_probs.shape[1]
    dev = target_probs.device
    x = draft_token_ids                                                        # (N,)
    k = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))   # (B,)
    first = cu_num_draft_tokens - k                                            # (B,) flat index of draft 0
    req = torch.repeat_interleave(torch.arange(B, device=dev), k, output_size=N)    # (N,) request of each draft
    row = torch.arange(N, device=dev) + req                                    # (N,) target row of each draft

    # 1) every draft's verdict, as if the walk reached it
    p_x = target_probs[row, x]                                                 # (N,)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[torch.arange(N, device=dev), x]
    ratio = p_x / torch.where(q_x > 0, q_x, 1.0)                              # (N,) q = 0 rejects
    accept = torch.where(is_greedy[req], x == target_argmax[row], (q_x > 0) & (uniforms < ratio))

    # 2) the leading run of accepted drafts
    j = torch.arange(K, device=dev)                                            # (K,)
    in_row = j < k[:, None]                                                    # (B, K)
    flat = (first[:, None] + j).clamp_(max=max(N - 1, 0))                     # (B, K)
    drafts = torch.where(in_row, x[flat], PLACEHOLDER_TOKEN_ID) if N else flat.new_full((B, K), -1)
    passed = (accept[flat] & in_row) if N else in_row
    num_accepted = passed.to(torch.int64).cumprod(dim=1).sum(dim=1)           # (B,)

    # 3) the emitted token: where the walk stopped, target row first + b + num_accepted
    rejected = num_accepted < k                                                # (B,)
    stop_row = first + torch.arange(B, device=dev) + num_accepted             # (B,)
    p = target_probs[stop_row]                                                 # (B, V)
    if N:
        stop_draft = (first + num_accepted).clamp_(max=N - 1)                 # (B,)
        q = (torch.nn.functional.one_hot(x[stop_draft], V).to(p.dtype) if draft_probs is None
             else draft_probs[stop_draft])
        p = torch.where(rejected[:, None], residual_probs(p, q), p)
    drawn = argmax_rows(p / exp_noise)                                         # (B,)
    emitted = torch.where(is_greedy, target_argmax[stop_row], drawn)

    # 4) accepted drafts, the emitted token, placeholders
    pos = torch.arange(K + 1, device=dev)                                      # (K+1,)
    drafts = torch.cat([drafts, drafts.new_full((B, 1), -1)], dim=1)          # (B, K+1)
    n = num_accepted[:, None]
    return torch.where(pos < n, drafts, torch.where(pos == n, emitted[:, None], PLACEHOLDER_TOKEN_ID))
