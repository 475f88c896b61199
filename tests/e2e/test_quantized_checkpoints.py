"""The default model quantized by ``python -m tools.quantize`` to INT8 (W8A8, per channel) and FP8
(per channel) compressed-tensors checkpoints runs through the offline API, its quantization read
from config.json, and keeps most of exact mode's greedy tokens (the README's figures come from
``python -m tools.bench agreement --quantized-model`` over 20 prompts and 64 tokens; here 6 and 32)."""
from __future__ import annotations

import pytest

from tools.bench.agreement import PROMPTS, agreement, generate
from tools.quantize import quantize_checkpoint

pytestmark = pytest.mark.slow
N_PROMPTS, TOKENS = 6, 32


@pytest.fixture(scope="module")
def exact():
    return generate(None, PROMPTS[:N_PROMPTS], TOKENS, None)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_checkpoint_of_the_default_model_keeps_exact_greedy_tokens(exact, tmp_path, scheme):
    out = str(tmp_path / scheme)
    report = quantize_checkpoint(None, scheme, True, out)
    assert report["quantized_layers"] == 30 * 7
    fast = generate(None, PROMPTS[:N_PROMPTS], TOKENS, out)
    assert agreement(exact, fast) >= 0.85
