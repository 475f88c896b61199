"""vLLM's SamplingParams JSON, as /render writes it and /inference/v1/generate takes it."""
from __future__ import annotations

import pytest

from actors.engine.sampling_params import SamplingParams, StructuredOutputsParams
from actors.frontend.protocol import BadRequest
from actors.frontend.scale_out import sampling_params_of, vllm_sampling_params

# What vLLM 0.32's /v1/chat/completions/render writes for temperature 0, max_tokens 5, top_logprobs 2
VLLM_RENDERED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                 "temperature": 0.0, "stop": [], "stop_token_ids": [], "max_tokens": 5, "logprobs": 2,
                 "output_kind": 2, "skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False}


def test_vllms_rendered_sampling_params_are_taken_with_its_internal_fields_ignored():
    params, n, interval = sampling_params_of(VLLM_RENDERED)
    assert (params.temperature, params.max_tokens, params.logprobs, params.stop) == (0.0, 5, 2, [])
    assert (n, interval) == (1, 1)


def test_n_stop_as_a_string_nulls_and_the_stream_interval_are_read_as_vllm_means_them():
    params, n, interval = sampling_params_of({"n": 3, "stop": "END", "stop_token_ids": None, "bad_words": None,
                                              "seed": 7, "stream_interval": 4})
    assert (n, interval, params.n, params.stop, params.stop_token_ids, params.seed) == (3, 4, 1, ["END"], [], 7)


def test_a_render_round_trips_through_generate():
    given = SamplingParams(max_tokens=9, temperature=0.5, top_k=20, seed=3, stop=["\n"], logprobs=1,
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                           truncate_prompt_tokens=10)
    params, n, _ = sampling_params_of(vllm_sampling_params(given, 2))
    assert n == 2
    assert params == SamplingParams(max_tokens=9, temperature=0.5, top_k=20, seed=3, stop=["\n"], logprobs=1,
                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


@pytest.mark.parametrize("fields, param", [
    ({"no_such_field": 1}, "sampling_params.no_such_field"),
    ({"bad_words_token_ids": [[1]]}, "sampling_params.bad_words_token_ids"),     # ours, not vLLM's
    ({"prompt_logprob_token_ids": [1]}, "sampling_params"),        # rows of ids, not ids
    ({"trace_decode_token_ids": [1]}, "sampling_params.trace_decode_token_ids"),   # vLLM's, not served here
    ({"n": 0}, "sampling_params.n"),
    ({"stream_interval": 0}, "sampling_params.stream_interval"),
    ({"temperature": "hot"}, "sampling_params"),
])
def test_fields_that_cannot_be_honoured_are_a_400_naming_them(fields, param):
    with pytest.raises(BadRequest) as err:
        sampling_params_of(fields)
    assert err.value.param == param


def test_vllm_fields_at_their_off_values_are_accepted():
    params, _, _ = sampling_params_of({"watermarking": None, "thinking_token_budget": None, "flat_logprobs": False})
    assert params == SamplingParams()
    assert sampling_params_of({"thinking_token_budget": 64})[0].thinking_token_budget == 64
