"""The grammar matchers of the scheduler's constrained requests: each step, the token bitmask rows
of those that sample; each sampled token, the matcher advances, and a matcher that reaches the
end of its grammar ends its request. Pure: no asyncio. A matcher keeps the tokens it accepted
across a preemption (the request keeps its output tokens), and can roll back (for draft tokens).

Bitmask layout, for V tokens: (rows, ceil(V / 32)) int32; bit j of word i allows token 32 i + j.

Speculative decoding: a request's draft tokens are cut to the prefix its grammar allows when they
are proposed (``allowed_drafts``), and a step verifying k drafts gets k + 1 rows, one per position
(the matcher advanced through the drafts before each, then rolled back), so the target is masked
at every position as it would be decoding those tokens one by one.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from actors.grammar.compiler import GrammarCache, grammar_key
from actors.engine.sampling_params import StructuredOutputsParams

BATCH_FILL_ROWS = 8          # from this many rows, fill the bitmask on several threads


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class StructuredOutputs:
    def __init__(self, grammars: GrammarCache, vocab_size: int) -> None:
        self.grammars = grammars
        self.words = bitmask_words(vocab_size)
        self._matchers: dict[str, Any] = {}        # request id -> xgrammar GrammarMatcher
        self._batch: Any = None                    # xgrammar BatchGrammarMatcher, for wide steps

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start(self, request_id: str, spec: StructuredOutputsParams) -> bool:
        """Give ``request_id`` a matcher if its grammar is compiled; False if it is not yet."""
        grammar = self.grammars.get(grammar_key(spec))
        if grammar is None:
            return False
        self._matchers[request_id] = _xgrammar().GrammarMatcher(grammar)
        return True

    def fill_bitmask(self, request_ids: list[str], drafts: dict[str, list[int]] | None = None) -> np.ndarray:
        """(rows, words) int32: the tokens each request's grammar allows next, one row per request;
        a request with ``drafts`` gets 1 + len(drafts) rows: next, then after each draft."""
        if drafts and any(r in drafts for r in request_ids):
            return self._fill_with_drafts(request_ids, drafts)
        bitmask = np.full((len(request_ids), self.words), -1, dtype=np.int32)
        matchers = [self._matchers[r] for r in request_ids]
        if len(matchers) >= BATCH_FILL_ROWS:
            if self._batch is None:
                self._batch = _xgrammar().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        return bitmask

    def _fill_with_drafts(self, request_ids: list[str], drafts: dict[str, list[int]]) -> np.ndarray:
        rows = sum(1 + len(drafts.get(r, ())) for r in request_ids)
        bitmask = np.full((rows, self.words), -1, dtype=np.int32)
        row = 0
        for r in request_ids:
            m, d = self._matchers[r], drafts.get(r, ())
            m.fill_next_token_bitmask(bitmask, row)
            advanced = 0
            for tok in d:       # past a draft the grammar refuses or ends on, rows stay open: never used
                if m.is_terminated() or not m.accept_token(tok):
                    break
                advanced += 1
                if not m.is_terminated():
                    m.fill_next_token_bitmask(bitmask, row + advanced)
            if advanced:
                m.rollback(advanced)
            row += 1 + len(d)
        return bitmask

    def allowed_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of ``drafts``, from the first, the request's grammar allows after its tokens
        (stopping where it is complete); the matcher is left as it was."""
        m = self._matchers[request_id]
        n = 0
        for tok in drafts:
            if m.is_terminated() or not m.accept_token(tok):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by a sampled token; True when its grammar is complete
        (the request ends). ValueError if the grammar does not allow the token."""
        m = self._matchers[request_id]
        if not m.accept_token(token_id):
            raise ValueError(f"request {request_id}: its grammar does not allow token {token_id}")
        return m.is_terminated()

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected draft tokens)."""
        self._matchers[request_id].rollback(num_tokens)

    def free(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)


def _xgrammar() -> Any:
    # xgrammar takes seconds to import: the engine loads it with the first grammar, not at start
    import xgrammar
    return xgrammar
