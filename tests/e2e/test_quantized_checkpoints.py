"""The default model quantized by ``python -m tools.quantize`` to INT8 (W8A8, per channel) and FP8
(per channel) compressed-tensors checkpoints runs through the offline API, its quantization read
from config.json: the capital of France starts as in exact mode, and the share of exact mode's
greedy tokens kept is near the README's figures (from ``python -m tools.bench agreement
--quantized-model`` over 20 prompts and 64 tokens: int8 57%, fp8 25%; here 6 prompts and 32
tokens), far above what a wrong scale or layout keeps (a few percent)."""
from __future__ import annotations

import pytest

from tools.bench.agreement import PROMPTS, agreement, generate
from tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.slow
N_PROMPTS, TOKENS = 6, 32


@pytest.fixture(scope="module")
def exact():
    return generate(None, PROMPTS[:N_PROMPTS], TOKENS, None)


@pytest.mark.parametrize("scheme,least", [("int8", 0.4), ("fp8", 0.15)])
def test_quantized_checkpoint_of_the_default_model_keeps_exact_greedy_tokens(exact, tmp_path, scheme, least):
    out = str(tmp_path / scheme)
    report = quantize_checkpoint(None, scheme, True, out)
    assert report["quantized_layers"] == 30 * 7
    fast = generate(None, PROMPTS[:N_PROMPTS], TOKENS, out)
    assert PROMPTS[0] == "What is the capital of France?" and fast[0][:8] == exact[0][:8]
    assert agreement(exact, fast) >= least
