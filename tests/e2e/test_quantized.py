"""The quantized mode on the real model keeps at least 95% of exact mode's greedy tokens over
the first 64 tokens of 20 prompts (the figure the README reports)."""
from __future__ import annotations

import pytest

from tools.bench.agreement import PROMPTS, agreement, generate

pytestmark = pytest.mark.slow


def test_gguf_mode_keeps_95_percent_of_exact_greedy_tokens():
    exact = generate(None, PROMPTS, 64, None)
    fast = generate("gguf", PROMPTS, 64, None)
    assert agreement(exact, fast) >= 0.95
