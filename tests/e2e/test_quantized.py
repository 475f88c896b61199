"""The quantized modes (and the fastest configuration, gguf-i8 with a float16 KV cache) on the
real model keep at least 95% of exact mode's greedy tokens over the first 64 tokens of 20
prompts (the figures the README reports)."""
from __future__ import annotations

import pytest

from kernels.cpu.panels import int8_available
from tools.bench.agreement import PROMPTS, agreement, generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exact():
    return generate(None, PROMPTS, 64, None)


def test_gguf_mode_keeps_95_percent_of_exact_greedy_tokens(exact):
    assert agreement(exact, generate("gguf", PROMPTS, 64, None)) >= 0.95


@pytest.mark.skipif(not int8_available(), reason="the gguf-i8 mode needs AVX512-VNNI")
def test_gguf_i8_mode_keeps_95_percent_of_exact_greedy_tokens(exact):
    assert agreement(exact, generate("gguf-i8", PROMPTS, 64, None)) >= 0.95


@pytest.mark.skipif(not int8_available(), reason="the gguf-i8 mode needs AVX512-VNNI")
def test_gguf_i8_with_a_float16_kv_cache_keeps_95_percent_of_exact_greedy_tokens(exact):
    assert agreement(exact, generate("gguf-i8", PROMPTS, 64, None, kv_cache_dtype="float16")) >= 0.95
