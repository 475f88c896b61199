"""SamplingParams.check: what the offline API and the Tokenizer refuse before a request can reach
the engine (where a value its tensors cannot hold would fail a whole step, and every request in
it), each error naming its field."""
from __future__ import annotations

import pytest

from actors.engine.sampling_params import SamplingParams

VOCAB, MAX_LOGPROBS = 1000, 20


@pytest.mark.parametrize("fields", [
    {}, dict(temperature=0.0), dict(temperature=7.5), dict(top_k=-1), dict(top_k=VOCAB), dict(top_p=1.0),
    dict(min_p=1.0), dict(seed=-(1 << 63)), dict(seed=(1 << 64) - 1), dict(max_tokens=None, min_tokens=5),
    dict(logprobs=MAX_LOGPROBS, prompt_logprobs=0), dict(logit_bias={VOCAB - 1: -100.0}),
    dict(allowed_token_ids=[0, VOCAB - 1]), dict(stop_token_ids=[2]), dict(truncate_prompt_tokens=-1),
    dict(repetition_penalty=10.0), dict(presence_penalty=-2.0, frequency_penalty=2.0),
])
def test_what_vllm_accepts_passes(fields):
    SamplingParams(**fields).check(VOCAB, MAX_LOGPROBS)


@pytest.mark.parametrize("fields, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=VOCAB + 1), "top_k"),
    (dict(top_k=1 << 70), "top_k"),
    (dict(min_p=-0.5), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=1 << 64), "seed"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 1e9}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1 << 40]), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_each_value_the_engine_cannot_take_is_refused_by_name(fields, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**fields).check(VOCAB, MAX_LOGPROBS)


def test_max_logprobs_minus_one_bounds_log_probs_by_the_vocabulary():
    SamplingParams(logprobs=VOCAB).check(VOCAB, -1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=VOCAB + 1).check(VOCAB, -1)
