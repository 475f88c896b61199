"""vLLM's thinking_token_budget in the worker: a request reasons for at most its budget of tokens
after the reasoning's start tag (in its prompt or its output), then the reasoning's end is forced
a token a step; an end the model writes itself closes the reasoning and a later start counts
afresh; requests without a budget, or not reasoning, are left alone."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.engine.config import ReasoningConfig
from actors.engine.sampling_params import SamplingParams
from models.logits_processors import BatchUpdate, LogitsProcessors, ThinkingBudgetProcessor

V, START, END, OK = 64, 60, 61, 62


def processors(end=(END,)) -> LogitsProcessors:
    reasoning = ReasoningConfig(reasoning_parser="deepseek_r1", start_token_ids=(START,), end_token_ids=tuple(end),
                                natural_end_token_ids=(END,))
    config = SimpleNamespace(model=SimpleNamespace(reasoning=reasoning))
    return LogitsProcessors([ThinkingBudgetProcessor(config, torch.device("cpu"), False)])


def run(procs: LogitsProcessors, rows: dict[int, tuple[list[int], int | None, list[int]]], steps: int) -> dict:
    """Decode ``steps`` tokens for each slot: (prompt, budget, the model's own choices in order)."""
    for slot, (prompt, budget, _) in rows.items():
        procs.add(slot, SamplingParams(thinking_token_budget=budget), prompt, [])
    for step in range(steps):
        procs.flush()
        logits = torch.zeros(procs.batch_size, V)
        for slot, (_, _, choices) in rows.items():
            logits[slot, choices[step]] = 1.0          # what the model would pick
        for p in procs.processors:
            logits = p.apply(logits)
        slots = sorted(rows)
        procs.append_outputs(torch.tensor(slots).numpy(), [[int(logits[s].argmax())] for s in slots])
    return {slot: procs.outputs[slot] for slot in rows}


def test_the_budget_counts_from_the_prompts_open_start_tag_then_the_end_is_forced():
    out = run(processors(), {0: ([1, 2, START], 3, [5, 6, 7, 8, 9, 10])}, 6)
    assert out[0] == [5, 6, 7, END, 9, 10]


def test_a_multi_token_end_is_forced_one_token_a_step_and_budget_0_forces_at_once():
    out = run(processors(end=(OK, 63, END)), {0: ([START, 4], 2, [5] * 7), 1: ([START], 0, [5] * 7)}, 7)
    assert out[0] == [5, OK, 63, END, 5, 5, 5]          # one thinking token in the prompt already
    assert out[1] == [OK, 63, END, 5, 5, 5, 5]


def test_a_natural_end_closes_the_reasoning_and_a_later_start_counts_afresh():
    model = [5, END, 6, START, 7, 8, 9, 10, 11]
    out = run(processors(), {0: ([1, START], 4, model)}, 9)
    assert out[0] == [5, END, 6, START, 7, 8, 9, 10, END]     # 4 tokens of the second reasoning


def test_requests_without_a_budget_or_not_reasoning_are_left_alone():
    free = [5, 6, 7, 8, 9]
    out = run(processors(), {0: ([1, START], None, free), 1: ([1, 2], 1, free), 2: ([START], 1, free)}, 5)
    assert out[0] == free and out[1] == free and out[2] == [5, END, 7, 8, 9]
    p = processors().processors[0]
    assert not p.applies_to(SamplingParams()) and p.applies_to(SamplingParams(thinking_token_budget=0))


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="thinking_token_budget` must be a non-negative integer"):
        SamplingParams(thinking_token_budget=-1).check(V, 20)
