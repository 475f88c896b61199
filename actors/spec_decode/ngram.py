"""The n-gram proposer (prompt lookup, vLLM's ``NgramProposer``): drafts the tokens that followed
an earlier occurrence of the sequence's own last few tokens, with no model.

For one sequence t of L tokens (prompt + output), n from prompt_lookup_max down to
prompt_lookup_min: the suffix t[L-n:] is looked for at the starts s < L - n (overlapping the
suffix is allowed); the first n with a match wins, and the draft is t[s+n : s+n+k], shorter when
the history ends first, and empty when nothing matches. Among matches of the winning n, the
earliest s is used, as vLLM's KMP search chooses (its comment: "the target n-gram of the earliest
position"). k is also capped so that L + k <= max_model_len.

    t = 1 2 3 4 2 3, min 2, max 3, k 4:  suffix 4 2 3 never occurred earlier; 2 3 did, at s = 1:
    draft = t[3:] = 4 2 3 (three tokens: the history ends)

Vectorised over a batch with numpy, no loop over history positions: for every candidate end e
(an occurrence t[e-n:e] whose next token t[e] exists, so e <= L-1), the length of the common
suffix of t[:e] and t[:L], capped at prompt_lookup_max, is built one d = 1..max at a time by
comparing the (B, L) token matrix shifted by d with each row's d-th last token. The winning n is
the largest length, the occurrence its first e. Cost: O(B * L * prompt_lookup_max).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from actors.spec_decode.config import SpeculativeConfig


class NgramProposals(NamedTuple):
    draft_token_ids: np.ndarray    # (B, k) int64, padded with -1
    num_draft_tokens: np.ndarray   # (B,) int64, 0..k

    def to_lists(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.draft_token_ids, self.num_draft_tokens)]


class NgramProposer:
    """Stateless but for its configuration."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int | None = None) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be > 0, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    @classmethod
    def from_config(cls, config: SpeculativeConfig, max_model_len: int | None = None) -> NgramProposer:
        if config.method != "ngram":
            raise ValueError(f"the n-gram proposer needs method ngram, got {config.method!r}")
        return cls(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                   max_model_len)

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> NgramProposals:
        """token_ids (B, M) integer, row b's sequence in its first num_tokens[b] columns (the
        worker's token matrix; what lies beyond is never read); num_tokens (B,) integer."""
        if token_ids.ndim != 2 or num_tokens.shape != (token_ids.shape[0],):
            raise ValueError(f"token_ids must be (B, M) and num_tokens (B,), got {token_ids.shape} "
                             f"and {num_tokens.shape}")
        B = token_ids.shape[0]
        L = num_tokens.astype(np.int64)                                        # (B,)
        if B and (L.min() < 0 or L.max() > token_ids.shape[1]):
            raise ValueError(f"num_tokens must lie in [0, {token_ids.shape[1]}], got {L.min()}..{L.max()}")
        M = int(L.max(initial=0))
        tokens = token_ids[:, :M]                                              # (B, M)
        end, longest = self._longest_earlier_match(tokens, L)                 # (B,), (B,)
        k = np.full(B, self.k, dtype=np.int64)
        if self.max_model_len is not None:
            k = np.minimum(k, self.max_model_len - L)
        num = np.where(longest >= self.min_n, np.clip(np.minimum(k, L - end), 0, None), 0)   # (B,)
        j = np.arange(self.k)                                                  # (k,)
        cols = np.minimum(end[:, None] + j, max(M - 1, 0))                     # (B, k)
        drafts = np.take_along_axis(tokens, cols, axis=1) if M else np.zeros((B, self.k), np.int64)
        drafts = np.where(j < num[:, None], drafts, -1).astype(np.int64)
        return NgramProposals(drafts, num)

    def propose_lists(self, sequences: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
        """One token list per request -> its draft tokens (empty: none)."""
        L = np.array([len(s) for s in sequences], dtype=np.int64)
        tokens = np.zeros((len(sequences), int(L.max(initial=0))), dtype=np.int64)
        for b, s in enumerate(sequences):
            tokens[b, :len(s)] = s
        return self.propose(tokens, L).to_lists()

    def _longest_earlier_match(self, tokens: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> per row, the end e of the earliest occurrence of the longest matched suffix n-gram
        (n <= max_n) and that n (0: none)."""
        B, M = tokens.shape
        rows = np.arange(B)
        e = np.arange(M)                                                       # candidate ends
        alive = (e >= 1) & (e[None, :] <= L[:, None] - 1)                     # (B, M) next token exists
        matched = np.zeros((B, M), dtype=np.int32)                             # common suffix length, capped
        for d in range(1, min(self.max_n, M - 1) + 1):                        # e >= d and e <= M - 1
            last = tokens[rows, np.clip(L - d, 0, None)]                       # (B,) t[L-d]
            same = np.zeros((B, M), dtype=bool)
            same[:, d:] = tokens[:, :M - d] == last[:, None]                   # t[e-d] == t[L-d]
            alive &= same & (L >= d)[:, None]
            if not alive.any():
                break
            matched += alive
        longest = matched.max(axis=1, initial=0)                               # (B,)
        end = np.argmax(matched == longest[:, None], axis=1) if M else np.zeros(B, np.int64)
        return end.astype(np.int64), longest.astype(np.int64)
