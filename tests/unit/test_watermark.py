"""The watermark (vLLM's --watermark-config): its PRF is Philox4x32-10 (Random123's known
answers), the race on the key's uniforms still draws from the sampling distribution, text
sampled with the key is detected and text sampled without it (or with another key) is not,
repeated contexts are left unwatermarked as the scopes say, and bad settings are refused."""
from __future__ import annotations

import random

import msgspec
import pytest
import torch

from models.sampler import Sampler, SamplingMetadata
from models.watermark import (PhiloxPRF, WatermarkConfig, Watermarker, contexts_of, create_detector, philox)


def _t(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int64)


@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_gives_random123s_known_answers(counter, key, expected):
    out = philox(tuple(map(_t, counter)), tuple(map(_t, key)))
    assert tuple(int(o) for o in out) == expected


def test_the_uniforms_are_a_keyed_function_of_the_context_and_look_uniform():
    prf = PhiloxPRF(2 ** 64 - 1)
    ctx = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [-1, -1, 7, 8]])
    u = prf.uniform(ctx, torch.arange(20000))
    assert torch.equal(u, prf.uniform(ctx, torch.arange(20000)))           # deterministic
    assert not torch.equal(u[0], u[1]) and not torch.equal(u, PhiloxPRF(7).uniform(ctx, torch.arange(20000)))
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u.flatten().float(), bins=10, min=0, max=1)
    assert float((counts - 6000).abs().max()) < 400                          # ~5 standard deviations
    assert torch.equal(prf.uniform(ctx[1:2], torch.tensor([5, 9])), u[1:2, [5, 9]])


def test_the_race_on_the_keys_uniforms_still_draws_from_the_sampling_distribution():
    """Over many contexts, a watermarked row's tokens follow softmax(logits / T), as unwatermarked
    sampling does (the watermark only decides which draw each context gets)."""
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    wm = Watermarker(WatermarkConfig(key=99))
    rng = random.Random(0)
    contexts = torch.tensor([[rng.randrange(50000) for _ in range(4)] for _ in range(4000)])
    uniforms = wm.uniforms(contexts, 4)
    meta = SamplingMetadata.from_lists([1.0] * 4000)
    meta.watermark_uniforms = dict(enumerate(uniforms))
    tokens = Sampler()(logits.expand(4000, 4).clone(), meta).sampled_token_ids
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64), atol=0.03), freq
    again = Sampler()(logits.expand(4000, 4).clone(), meta).sampled_token_ids
    assert torch.equal(tokens, again)                                         # the key decides, not the RNG


def _generate(wm: Watermarker | None, steps: int, seed: int, vocab: int = 500) -> list[int]:
    """Tokens sampled one at a time from random logits, each with the watermark of ``wm``
    (None: the random generator), its context the tokens before it."""
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=gen) * 2
        meta = SamplingMetadata.from_lists([1.0], generators=[torch.Generator().manual_seed(seed + len(tokens))])
        if wm is not None:
            ctx = torch.tensor(contexts_of(tokens, [len(tokens)], wm.s.context_width))
            meta.watermark_uniforms = {0: wm.uniforms(ctx, vocab)[0]}
        tokens.append(int(Sampler()(logits, meta).sampled_token_ids[0]))
    return tokens


@pytest.mark.parametrize("algorithm", ["gumbel", "dual_key_gumbel"])
def test_text_sampled_with_the_key_is_detected_and_text_without_it_or_another_key_is_not(algorithm):
    config = WatermarkConfig(key=31337, algorithm=algorithm, alpha=0.3)
    marked = _generate(Watermarker(config), 120, seed=1)
    plain = _generate(None, 120, seed=1)
    detector = create_detector(msgspec.to_builtins(config))
    hit = detector.detect(marked)
    assert hit.is_watermarked and hit.p_value < 1e-6 and hit.num_scored_tokens == len(set(
        contexts_of(marked, range(len(marked)), 4)))
    assert not detector.detect(plain).is_watermarked
    assert not create_detector({"key": 31338, "algorithm": algorithm, "alpha": 0.3}).detect(marked).is_watermarked
    assert detector.detect([]).p_value == 1.0


def test_a_repeated_context_is_sampled_without_the_watermark_as_each_scope_says():
    prompt, width = [5, 6, 7, 8, 9], 2
    text = prompt + [1, 2, 3, 1, 2]            # position 10's context (1, 2) was position 7's
    single = Watermarker(WatermarkConfig(key=1, context_width=width))
    assert [single.skips("r", text, p, len(prompt)) for p in range(5, 11)] == [False] * 5 + [True]
    everything = Watermarker(WatermarkConfig(key=1, context_width=width, deduplicate_contexts="all"))
    assert [everything.skips("r", text, p, len(prompt)) for p in range(5, 11)] == [True, True, False, False,
                                                                                      False, True]
    prompt_repeat = [1, 2, 9] + [1, 2]         # scope "all": the prompt's (1, 2) counts; single_turn's does not
    assert Watermarker(WatermarkConfig(key=1, context_width=width, deduplicate_contexts="all")).skips(
        "r", prompt_repeat + [4, 4, 1, 2], 9, 3)
    fresh = Watermarker(WatermarkConfig(key=1, context_width=width))
    assert not fresh.skips("r", prompt_repeat, 5, 3)
    short = Watermarker(WatermarkConfig(key=1, context_width=width, deduplicate_contexts_max_history=2))
    assert [short.skips("r", text, p, len(prompt)) for p in range(5, 11)] == [False] * 6   # (1, 2) aged out
    none = Watermarker(WatermarkConfig(key=1, context_width=width, deduplicate_contexts="none"))
    assert not any(none.skips("r", text, p, len(prompt)) for p in range(5, 11))
    single.forget(["r"])
    assert "r" not in single.history


@pytest.mark.parametrize("raw, words", [
    ({}, "needs a key"), ({"key": -1}, "key must be an integer"), ({"key": 2 ** 64}, "key must be an integer"),
    ({"key": 1, "algorithm": "kgw"}, "algorithm must be one of"), ({"key": 1, "alpha": 1.5}, "alpha must be in"),
    ({"key": 1, "context_width": 0}, "context_width must be a positive"),
    ({"key": 1, "deduplicate_contexts": "some"}, "deduplicate_contexts must be one of"),
    ({"key": 1, "deduplicate_contexts_max_history": 0}, "max_history must be a positive"),
    ({"key": 1, "prf": "aes"}, "prf must be one of"), ({"key": 1, "salt": 2}, "unsupported --watermark-config field.s. salt"),
])
def test_bad_watermark_configs_are_refused_naming_the_field(raw, words):
    with pytest.raises(ValueError, match=words):
        WatermarkConfig.of(raw)


def test_the_key_stays_out_of_the_configs_text_and_the_servers_flags_take_it(capsys):
    from actors.engine.args import EngineArgs
    from tools import serve
    config = WatermarkConfig(key=123456789)
    assert "123456789" not in repr(config) and "key=<redacted>" in repr(config)
    args = serve.parse_args(["--watermark-config", '{"key": 123456789, "deduplicate_contexts": "none"}'])
    engine = EngineArgs.from_cli_args(args).create_engine_config()
    assert engine.watermark.key == 123456789 and "123456789" not in repr(engine)
    with pytest.raises(ValueError, match="with speculative decoding"):
        EngineArgs.from_cli_args(serve.parse_args(["--watermark-config", '{"key": 1}', "--speculative-config",
                                                   '{"method": "ngram", "num_speculative_tokens": 2}'])
                                 ).create_engine_config()
