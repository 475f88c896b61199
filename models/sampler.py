"""Token sampling for a batch: the logits-processor chain, greedy and seeded random sampling,
and the log-probs of sampled and prompt tokens.

The chain, in vLLM's order (the order is the semantics: each step sees what the ones before left):

    logits (B, V) any float dtype
      1) raw snapshot                    only when log-probs are requested in a "raw_*" mode
      2) upcast to float32               one owned copy; the caller's logits are never written
      3) grammar bitmask                 structured output: the tokens the grammar allows
                                         (after the snapshot: raw log-probs ignore the grammar)
      4) allowed_token_ids               whitelist
      5) bad words                       -inf on the token that would complete a bad sequence
      6) min_tokens                      -inf on stop/EOS ids while the output is too short
      7) logit_bias                      + bias
     7b) plugins' logits processors      those that may change the argmax (models/logits_processors.py)
      8) penalties                       repetition, then frequency and presence; before
                                         temperature, so their size does not depend on it
      -- greedy = argmax here: 3-8 may change it, 9-11 may not
      9) temperature                     greedy rows divide by 1
     10) min_p                           drop p < min_p * max p
    10b) plugins' logits processors      the argmax-invariant ones (skipped when every row is greedy)
     11) top-k, top-p
     12) exponential race (seeded rows draw from their own generator); torch.where(greedy)

On CUDA, 9-12 run as one Triton kernel (kernels/triton/sampling.py: cut-offs by bisection, no
sort, no host synchronisation) when no row uses min_p and the processed log-probs are not needed;
it races the same Exp(1) noise from the same generators, so a seeded row draws the same token as
on the torch path unless two candidates tie to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import torch

from actors.engine.sampling_params import LOGPROBS_MODES, LogprobsMode
from kernels.cpu.native import apply_bitmask_ as native_apply_bitmask_
from kernels.cpu.native import argmax_rows
from kernels.triton import fused as triton_fused

if TYPE_CHECKING:
    from actors.engine.sampling_params import SamplingParams
    from models.logits_processors import BoundLogitsProcessors

_SAMPLING_EPS = 1e-5   # temperature below this is greedy



class LogprobsTensors(NamedTuple):
    token_ids: torch.Tensor   # (B, k+1) int64: the sampled (or target) token, then the top-k
    logprobs: torch.Tensor    # (B, k+1) float32
    ranks: torch.Tensor       # (B,) int64: rank of column 0 among all V tokens (1 = most likely)


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor       # (B,) int64
    logprobs: LogprobsTensors | None      # None unless max_num_logprobs is set
    # vLLM's --return-sampling-mask: per row, the token ids the draw could pick (int32, ascending)
    supports: list[np.ndarray] | None = None


class RowTokens(NamedTuple):
    """A sparse set of (row, token) cells of the (B, V) logits."""
    rows: torch.Tensor        # (N,) int64
    token_ids: torch.Tensor   # (N,) int64


class Penalties(NamedTuple):
    presence: torch.Tensor            # (B,) float32; 0 = off
    frequency: torch.Tensor           # (B,) float32; 0 = off
    repetition: torch.Tensor          # (B,) float32; 1 = off
    output_token_ids: torch.Tensor    # (B, Lo) int64, padded with -1
    prompt_token_ids: torch.Tensor | None  # (B, Lp) int64, padded with -1; None = no repetition penalty


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one batch (row i = logits row i), built once per step.
    A processor whose field is None (or whose no_* flag is set) is used by no row and skipped."""

    temperature: torch.Tensor                 # (B,) float32; < _SAMPLING_EPS = greedy
    top_p: torch.Tensor                       # (B,) float32; 1.0 = off (forced off on greedy rows)
    top_k: torch.Tensor                       # (B,) int64; <= 0 = off (forced off on greedy rows)
    min_p: torch.Tensor                       # (B,) float32; 0 = off (forced off on greedy rows)
    generators: dict[int, torch.Generator]    # random row -> its seeded generator; others: global RNG
    all_greedy: bool
    all_random: bool
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    max_top_k: int                            # max active top_k (0 if none): bounds the top-k pass
    grammar_bitmask: torch.Tensor | None      # (B, ceil(V/32)) int32; bit j of word i allows 32*i+j
    allowed_token_ids: RowTokens | None       # allowed cells of the restricted rows
    restricted_rows: torch.Tensor | None      # (R,) int64: rows with an allowed_token_ids list
    bad_words_bans: RowTokens | None          # cells banned by bad words given the output so far
    min_tokens_bans: RowTokens | None         # stop/EOS cells of rows still short of min_tokens
    logit_bias: tuple[RowTokens, torch.Tensor] | None   # cells and their (N,) float32 biases
    penalties: Penalties | None
    max_num_logprobs: int | None              # k for every row; -1 = whole vocab; None = no log-probs
    logprobs_mode: LogprobsMode               # what the returned log-probs are (LOGPROBS_MODES)
    # plugins' batch-level processors bound to this batch's rows (set by the model runner)
    logitsprocs: BoundLogitsProcessors | None = None
    # row -> the tokens whose log-probs it returns in place of its top alternatives (vLLM's logprob_token_ids)
    logprob_token_ids: dict[int, list[int]] | None = None
    # row -> its (V,) uniforms in (0, 1) from the watermark's key (--watermark-config): the row's
    # race runs on them instead of its generator's draws (which are still drawn, so a seeded
    # stream stays where it would be)
    watermark_uniforms: dict[int, torch.Tensor] | None = None
    # vLLM's --return-sampling-mask: report each row's support, the tokens left a non-zero
    # probability after temperature, min-p, top-k and top-p (the unfused path, which has them)
    return_supports: bool = False

    @property
    def no_logits_processors(self) -> bool:
        return (self.grammar_bitmask is None and self.allowed_token_ids is None
                and self.bad_words_bans is None and self.min_tokens_bans is None
                and self.logit_bias is None and self.penalties is None
                and (self.logitsprocs is None or not self.logitsprocs.changes_argmax))

    @property
    def no_argmax_invariant_processors(self) -> bool:
        return self.logitsprocs is None or not self.logitsprocs.has_argmax_invariant

    @classmethod
    def from_lists(
        cls, temperature: Sequence[float], top_p: Sequence[float] | None = None,
        top_k: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None, *,
        min_p: Sequence[float] | None = None,
        presence_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        min_tokens: Sequence[int] | None = None,
        stop_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[Sequence[int]] | None = None,
        logit_bias: Sequence[dict[int, float] | None] | None = None,
        allowed_token_ids: Sequence[Sequence[int] | None] | None = None,
        bad_words_token_ids: Sequence[Sequence[Sequence[int]] | None] | None = None,
        grammar_bitmask: torch.Tensor | None = None,
        max_num_logprobs: int | None = None,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        logprob_token_ids: Sequence[Sequence[int] | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """Every list has one entry per row; None means no row uses that parameter.
        output_token_ids (each row's generated tokens so far) is needed by penalties, bad words
        and min_tokens; prompt_token_ids by the repetition penalty. eos_token_ids is per row so
        that a caller can leave it empty for ignore_eos. max_num_logprobs -1 = the whole vocab."""
        B = len(temperature)
        row = lambda name, values: _per_row(name, values, B)
        greedy = [t < _SAMPLING_EPS for t in temperature]
        # greedy rows ignore truncation, so it cannot cost work nor distort their log-probs
        off = lambda name, values, default: [default if g else v for g, v in zip(
            greedy, row(name, values) or [default] * B)]
        top_p, top_k, min_p = off("top_p", top_p, 1.0), off("top_k", top_k, 0), off("min_p", min_p, 0.0)
        gens = row("generators", generators) or []
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        if max_num_logprobs is not None and max_num_logprobs < -1:
            raise ValueError(f"max_num_logprobs must be >= -1 or None, got {max_num_logprobs}")
        _check_bitmask(grammar_bitmask, B)
        output = row("output_token_ids", output_token_ids)
        allowed, restricted = _allowed_cells(row("allowed_token_ids", allowed_token_ids), device)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor(temperature, **f32),
            top_p=torch.tensor(top_p, **f32),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=torch.tensor(min_p, **f32),
            generators={i: g for i, g in enumerate(gens) if g is not None and not greedy[i]},
            all_greedy=all(greedy), all_random=not any(greedy),
            no_top_p=all(p >= 1.0 for p in top_p), no_top_k=all(k <= 0 for k in top_k),
            no_min_p=all(p <= 0.0 for p in min_p), max_top_k=max(top_k, default=0),
            grammar_bitmask=None if grammar_bitmask is None else grammar_bitmask.to(device),
            allowed_token_ids=allowed, restricted_rows=restricted,
            bad_words_bans=_bad_words_cells(row("bad_words_token_ids", bad_words_token_ids), output, device),
            min_tokens_bans=_min_tokens_cells(row("min_tokens", min_tokens),
                                              row("stop_token_ids", stop_token_ids),
                                              row("eos_token_ids", eos_token_ids), output, device),
            logit_bias=_logit_bias_cells(row("logit_bias", logit_bias), device),
            penalties=_penalties(row("presence_penalty", presence_penalty),
                                 row("frequency_penalty", frequency_penalty),
                                 row("repetition_penalty", repetition_penalty),
                                 row("prompt_token_ids", prompt_token_ids), output, B, device),
            max_num_logprobs=max_num_logprobs, logprobs_mode=logprobs_mode,
            logprob_token_ids={i: list(ids) for i, ids in enumerate(row("logprob_token_ids", logprob_token_ids)
                                                                   or []) if ids} or None)

    @staticmethod
    def reads_output_tokens(params: Sequence[SamplingParams]) -> bool:
        """Whether any row's processing reads the tokens it generated so far (penalties, bad
        words, min_tokens): then the metadata changes every step and cannot be reused."""
        return any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                   or p.bad_words_token_ids or p.min_tokens for p in params)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    generators: Sequence[torch.Generator | None], *,
                    eos_token_ids: Sequence[int],
                    output_token_ids: Callable[[], list[list[int]]],
                    prompt_token_ids: Callable[[], list[list[int]]],
                    logprobs_mode: LogprobsMode = "raw_logprobs",
                    device: torch.device | str = "cpu") -> SamplingMetadata:
        """The metadata of a batch whose row i samples with ``params[i]``. The token lists are
        asked for only when some row's parameters read them."""
        ps = params
        want = [p.num_logprobs for p in ps if p.logprobs is not None]   # k per row; the batch takes the max
        eos = list(eos_token_ids)
        return cls.from_lists(
            temperature=[p.temperature for p in ps], top_p=[p.top_p for p in ps],
            top_k=[p.top_k for p in ps], generators=generators, min_p=[p.min_p for p in ps],
            presence_penalty=[p.presence_penalty for p in ps],
            frequency_penalty=[p.frequency_penalty for p in ps],
            repetition_penalty=[p.repetition_penalty for p in ps],
            prompt_token_ids=prompt_token_ids() if any(p.repetition_penalty != 1.0 for p in ps) else None,
            output_token_ids=output_token_ids() if cls.reads_output_tokens(ps) else None,
            min_tokens=[p.min_tokens for p in ps], stop_token_ids=[p.stop_token_ids for p in ps],
            eos_token_ids=[[] if p.ignore_eos else eos for p in ps],
            logit_bias=[p.logit_bias for p in ps], allowed_token_ids=[p.allowed_token_ids for p in ps],
            bad_words_token_ids=[p.bad_words_token_ids or None for p in ps],
            max_num_logprobs=max(want) if want else None, logprobs_mode=logprobs_mode,
            logprob_token_ids=[p.logprob_token_ids for p in ps] if any(p.logprob_token_ids for p in ps) else None,
            device=device)


# -- metadata construction: per-row Python here, once per step, only for parameters in use ---------

def _per_row(name: str, values: Sequence | None, B: int) -> list | None:
    if values is None:
        return None
    if len(values) != B:
        raise ValueError(f"{name} has {len(values)} entries for a batch of {B} rows")
    return list(values)


def _check_bitmask(bitmask: torch.Tensor | None, B: int) -> None:
    if bitmask is not None and (bitmask.dim() != 2 or bitmask.shape[0] != B or bitmask.dtype != torch.int32):
        raise ValueError(f"grammar_bitmask must be ({B}, ceil(V/32)) int32, got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")


def _cells(pairs: list[tuple[int, int]], device: torch.device | str) -> RowTokens | None:
    if not pairs:
        return None
    t = torch.tensor(pairs, dtype=torch.int64, device=device)   # (N, 2)
    return RowTokens(t[:, 0], t[:, 1])


def _needs_output(output: list | None, what: str) -> list:
    if output is None:
        raise ValueError(f"{what} needs output_token_ids (the tokens each row generated so far)")
    return output


def _allowed_cells(allowed: list | None, device) -> tuple[RowTokens | None, torch.Tensor | None]:
    restricted = [i for i, ids in enumerate(allowed or ()) if ids is not None]
    if not restricted:
        return None, None
    if any(len(allowed[i]) == 0 for i in restricted):
        raise ValueError("allowed_token_ids of a row must not be empty (use None for no restriction)")
    cells = [(i, t) for i in restricted for t in allowed[i]]
    return _cells(cells, device), torch.tensor(restricted, dtype=torch.int64, device=device)


def _bad_words_cells(bad_words: list | None, output: list | None, device) -> RowTokens | None:
    """Ban a bad word's last token when its other tokens are the end of the output so far."""
    cells = []
    for i, words in enumerate(bad_words or ()):
        out = _needs_output(output, "bad_words_token_ids")[i] if words else ()
        for word in words or ():
            prefix = list(word[:-1])
            if not prefix or (len(out) >= len(prefix) and list(out[-len(prefix):]) == prefix):
                cells.append((i, word[-1]))
    return _cells(cells, device)


def _min_tokens_cells(min_tokens: list | None, stop_ids: list | None, eos_ids: list | None,
                      output: list | None, device) -> RowTokens | None:
    cells = []
    for i, n in enumerate(min_tokens or ()):
        if n > 0 and len(_needs_output(output, "min_tokens")[i]) < n:
            cells += [(i, t) for t in {*(stop_ids[i] if stop_ids else ()), *(eos_ids[i] if eos_ids else ())}]
    return _cells(cells, device)


def _logit_bias_cells(bias: list | None, device) -> tuple[RowTokens, torch.Tensor] | None:
    items = [(i, t, b) for i, d in enumerate(bias or ()) if d for t, b in d.items()]
    if not items:
        return None
    cells = _cells([(i, int(t)) for i, t, _ in items], device)
    return cells, torch.tensor([float(b) for _, _, b in items], dtype=torch.float32, device=device)


def _padded(token_lists: Sequence[Sequence[int]], device) -> torch.Tensor:
    rows = [torch.tensor(list(t), dtype=torch.int64) for t in token_lists]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1).to(device)


def _penalties(presence: list | None, frequency: list | None, repetition: list | None,
               prompt: list | None, output: list | None, B: int, device) -> Penalties | None:
    use_repetition = any(r != 1.0 for r in repetition or ())
    if not (use_repetition or any(presence or ()) or any(frequency or ())):
        return None
    output = _needs_output(output, "presence/frequency/repetition penalties")
    if use_repetition and prompt is None:
        raise ValueError("repetition_penalty needs prompt_token_ids, one list per row")
    f32 = dict(dtype=torch.float32, device=device)
    return Penalties(torch.tensor(presence or [0.0] * B, **f32), torch.tensor(frequency or [0.0] * B, **f32),
                     torch.tensor(repetition or [1.0] * B, **f32), _padded(output, device),
                     _padded(prompt, device) if use_repetition else None)


# -- processors: each writes into the float32 logits it is given ---------------------------------

def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits (B, V); bitmask (B, W) int32. Tokens beyond the mask's 32*W are disallowed. On
    CUDA, one Triton kernel."""
    if triton_fused.supports(logits, bitmask):
        triton_fused.apply_bitmask_(logits, bitmask)
        return
    if native_apply_bitmask_(logits, bitmask):
        return
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(B, -1)[:, :V].bool()   # (B, min(32W, V))
    logits[:, :allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
    logits[:, allowed.shape[1]:] = float("-inf")


def apply_allowed_token_ids(logits: torch.Tensor, allowed: RowTokens, restricted: torch.Tensor) -> None:
    banned = torch.zeros_like(logits, dtype=torch.bool)   # (B, V)
    banned[restricted] = True
    banned[allowed.rows, allowed.token_ids] = False
    logits.masked_fill_(banned, float("-inf"))


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """Repetition (HF/vLLM: over prompt + output, positive logits / r, negative * r), then
    frequency and presence (OpenAI: over output only, minus f * count and minus p * seen)."""
    output_counts = token_counts(p.output_token_ids, logits.shape[1])   # (B, V)
    if p.prompt_token_ids is not None:
        seen = (token_counts(p.prompt_token_ids, logits.shape[1]) + output_counts) > 0
        r = p.repetition[:, None]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    logits -= p.frequency[:, None] * output_counts
    logits -= p.presence[:, None] * (output_counts > 0)


def token_counts(token_ids: torch.Tensor, V: int) -> torch.Tensor:
    """token_ids (B, L) int64 padded with -1 -> (B, V) float32 occurrence counts."""
    B = token_ids.shape[0]
    counts = torch.zeros(B, V + 1, dtype=torch.float32, device=token_ids.device)
    ids = torch.where(token_ids < 0, V, token_ids)   # padding lands in the spare column V
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :V]


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Steps 3-8 of the chain, in place on float32 logits (B, V): the ones that can move the argmax."""
    if meta.grammar_bitmask is not None:
        apply_grammar_bitmask(logits, meta.grammar_bitmask)
    if meta.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, meta.allowed_token_ids, meta.restricted_rows)
    for bans in (meta.bad_words_bans, meta.min_tokens_bans):
        if bans is not None:
            logits[bans.rows, bans.token_ids] = float("-inf")
    if meta.logit_bias is not None:
        cells, bias = meta.logit_bias
        logits.index_put_((cells.rows, cells.token_ids), bias, accumulate=True)
    if meta.logitsprocs is not None and meta.logitsprocs.changes_argmax:
        meta.logitsprocs.apply_non_argmax_invariant(logits)
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    probs = logits.softmax(dim=-1)                                        # (B, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]        # (B, 1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Top-k without a full sort: the k-th largest of each row from one topk(max_top_k)."""
    V = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), 1)                   # (B,)
    kth_largest = logits.topk(min(max_top_k, V), dim=-1).values.gather(1, (k - 1)[:, None])  # (B, 1)
    kth_largest.masked_fill_((top_k <= 0)[:, None], float("-inf"))
    logits.masked_fill_(logits < kth_largest, float("-inf"))


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


def draw_row_noise(q_row: torch.Tensor, gen: torch.Generator) -> None:
    """A seeded row's draw: V uniforms from its own generator, once per sampled token."""
    q_row.uniform_(generator=gen)


def seeded_generator(seed: int, temperature: float, num_sampled: int, vocab_size: int,
                     device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded row's generator, moved past the draws of the ``num_sampled`` tokens the request
    sampled already (none if it is greedy): a request recomputed after a preemption resumes its
    stream where it was, so its tokens do not depend on having been preempted."""
    gen = torch.Generator(device).manual_seed(seed)
    if temperature >= _SAMPLING_EPS:
        row = torch.empty(vocab_size, dtype=torch.float32, device=device)
        for _ in range(num_sampled):
            draw_row_noise(row, gen)
    return gen


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator],
                      uniforms: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape; argmax(probs / q) is a draw from probs (exponential race).
    A seeded row draws its own V values from its own generator, so its tokens do not depend on
    the rest of the batch. q = -log(u), u ~ U[0, 1): 5x faster than exponential_() on CPU;
    u = 0 gives q = inf, a lost race, never 0/0. ``uniforms``: rows whose u is given (the
    watermark's keyed draws: the race is then Gumbel-max on the key's noise)."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.uniform_()
    for row, gen in generators.items():
        draw_row_noise(q[row], gen)
    for row, u in (uniforms or {}).items():
        q[row].copy_(u)
    return q.log_().neg_()


# -- the sampler -----------------------------------------------------------------------------------

class Sampler:
    """Stateless; everything about the batch is in SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits (B, V) in any float dtype; never written
        want_logprobs = meta.max_num_logprobs is not None
        # 1) the raw snapshot: the model's own distribution, before penalties and temperature
        raw = _values(logits, meta.logprobs_mode) if (
            want_logprobs and meta.logprobs_mode.startswith("raw")) else None
        # 2) upcast into an owned copy, unless nothing below writes
        logits = logits.to(torch.float32, copy=not (meta.all_greedy and meta.no_logits_processors))
        # 3-8) processors that may change the argmax
        apply_logits_processors(logits, meta)
        # 9-12) sample
        sampled, processed, supports = self.sample(logits, meta, want_logprobs and raw is None)
        if not want_logprobs:
            return SamplerOutput(sampled, None, supports)
        return SamplerOutput(sampled, gather_logprobs(raw if raw is not None else processed,
                                                      sampled, meta.max_num_logprobs, meta.logprob_token_ids),
                             supports)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               want_processed: bool) -> tuple[torch.Tensor, torch.Tensor | None, list[np.ndarray] | None]:
        """-> sampled (B,) int64; if asked, the log-probs (or logits, as ``logprobs_mode`` says)
        (B, V) of the distribution drawn from (greedy rows: temperature 1, no truncation); and
        with ``meta.return_supports`` each row's support (``supports_of``)."""
        if meta.all_greedy:
            sampled = argmax_rows(logits)
            supports = ([np.array([t], dtype=np.int32) for t in sampled.tolist()]    # one token each
                        if meta.return_supports else None)
            return sampled, _values(logits, meta.logprobs_mode) if want_processed else None, supports
        is_greedy = meta.temperature < _SAMPLING_EPS                      # (B,)
        if (meta.no_min_p and meta.no_argmax_invariant_processors and not want_processed
                and not meta.return_supports
                and triton_fused.supports(logits, meta.temperature)):
            # one kernel: greedy rows, then temperature, top-k, top-p and the race, no sort
            temperature = torch.where(is_greedy, 0.0, meta.temperature)
            noise = exponential_noise(logits, meta.generators, meta.watermark_uniforms)
            return triton_fused.sample(logits, temperature, meta.top_k, meta.top_p, noise), None, None
        greedy = argmax_rows(logits)                                      # (B,)
        logits.div_(torch.where(is_greedy, 1.0, meta.temperature)[:, None])
        if not meta.no_min_p:
            apply_min_p(logits, meta.min_p)
        if not meta.no_argmax_invariant_processors:
            meta.logitsprocs.apply_argmax_invariant(logits)
        if not meta.no_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        elif not meta.no_top_k:
            apply_top_k_only(logits, meta.top_k, meta.max_top_k)
        processed = _values(logits, meta.logprobs_mode) if want_processed else None
        supports = supports_of(logits, greedy, is_greedy) if meta.return_supports else None
        probs = logits.softmax(dim=-1)                                    # (B, V)
        sampled = argmax_rows(probs.div_(exponential_noise(probs, meta.generators, meta.watermark_uniforms)))
        if meta.all_random:
            return sampled, processed, supports
        return torch.where(is_greedy, greedy, sampled), processed, supports


def supports_of(logits: torch.Tensor, greedy: torch.Tensor, is_greedy: torch.Tensor) -> list[np.ndarray]:
    """Each row's support after truncation: its tokens whose logit is not -inf (a greedy row:
    its argmax alone), int32 ascending (vLLM's sampling mask)."""
    finite = torch.isfinite(logits).cpu().numpy()                      # (B, V)
    return [np.array([g], dtype=np.int32) if eager else np.flatnonzero(row).astype(np.int32)
            for row, g, eager in zip(finite, greedy.tolist(), is_greedy.tolist())]


def _values(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """(B, V) float32: the log-probs of ``logits``, or (``*_logits`` modes) a copy of them."""
    if mode.endswith("logits"):
        return logits.to(torch.float32, copy=True)
    return logits.log_softmax(-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int,
                    explicit: dict[int, list[int]] | None = None) -> LogprobsTensors:
    """logprobs (N, V) float32; token_ids (N,) -> the token's log-prob and rank, then the top-k
    (k = -1: all V, sorted); a row of ``explicit`` has its tokens' log-probs first in place of its
    top ones (k is at least as many)."""
    token_ids = token_ids.to(torch.int64)[:, None]                        # (N, 1)
    token_logprobs = logprobs.gather(1, token_ids)                        # (N, 1)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)                     # (N,) 1 = most likely
    k = logprobs.shape[1] if k == -1 else k
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)                      # (N, k)
    for row, ids in (explicit or {}).items():
        index = torch.tensor(ids, dtype=torch.int64, device=logprobs.device)
        top_ids[row, :len(ids)] = index
        top_logprobs[row, :len(ids)] = logprobs[row, index]
    return LogprobsTensors(torch.cat([token_ids, top_ids], dim=1),
                           torch.cat([token_logprobs, top_logprobs], dim=1), ranks)


def score_prompt_token_ids(logits: torch.Tensor, ids: torch.Tensor) -> np.ndarray:
    """vLLM's prompt_logprob_token_ids: logits (N, V) at prompt rows, ids (N, K) the token ids to
    score at each (-1: padding); their raw log-probs, float32 (N, K), -inf at the padding."""
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32).gather(1, ids.clamp_min(0))
    return logprobs.masked_fill(ids < 0, float("-inf")).cpu().numpy()


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Prompt log-probs: logits (N, V) at prompt positions, target_ids (N,) the next prompt tokens.
    Always raw: the model's distribution, no processors."""
    return gather_logprobs(logits.log_softmax(dim=-1, dtype=torch.float32), target_ids, k)
