"""Cascade attention end to end: many requests sharing a 300+-token system prompt (served from the
prefix cache, so their first blocks are the same blocks) decode the same greedy tokens with
cascade attention on and off, and the cascade path does run when on."""
from __future__ import annotations

import pytest

from actors.api import LLM, SamplingParams
from kernels.attention import cascade
from kernels.attention.cpu import CpuAttentionBackend

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small library. Answer questions about opening hours, "
          "borrowing rules, fines, the reading room, printing, the children's corner and events. ") * 9
QUESTIONS = ["When do you open?", "How many books may I borrow?", "Is there a fine for late returns?",
             "Can I print in colour?", "Where is the reading room?", "Do you host events for children?",
             "May I renew a book online?", "Is the library open on Sunday?", "Can I bring food inside?"]


def _generate(disable: bool) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(disable_cascade_attn=disable, max_num_seqs=16) as llm:
        llm.generate(SYSTEM + "Hello.", params, use_tqdm=False)     # caches the system prompt's blocks
        return [r.token_ids for r in llm.generate([SYSTEM + q for q in QUESTIONS], params, use_tqdm=False)]


def test_greedy_output_is_the_same_with_cascade_attention_on_and_off(monkeypatch):
    # the CPU backend's own threshold (1k tokens) would leave a 300-token prompt to plain attention
    monkeypatch.setattr(CpuAttentionBackend, "cascade_min_prefix", cascade.MIN_PREFIX_TOKENS)
    calls = []
    real = CpuAttentionBackend._cascade
    monkeypatch.setattr(CpuAttentionBackend, "_cascade",
                        lambda self, *a: calls.append(a[2].common_prefix_len) or real(self, *a))
    on = _generate(disable=False)
    cascade_steps = len(calls)
    off = _generate(disable=True)
    assert cascade_steps > 0 and min(calls) >= cascade.MIN_PREFIX_TOKENS
    assert len(calls) == cascade_steps                                # none with the flag
    assert on == off and all(len(t) == 8 for t in on)
