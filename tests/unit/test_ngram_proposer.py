"""The n-gram proposer (actors/spec_decode/ngram.py) against a plain Python reference of vLLM's
prompt lookup, and SpeculativeConfig's parsing of vLLM's JSON with its defaults and errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.ngram import NgramProposer


def _reference(seq: list[int], k: int, min_n: int, max_n: int, max_model_len: int | None = None) -> list[int]:
    """The definition: longest suffix n-gram first, its earliest earlier start, what followed."""
    L = len(seq)
    if max_model_len is not None:
        k = min(k, max_model_len - L)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for s in range(L - n):
            if seq[s:s + n] == seq[L - n:]:
                return seq[s + n:s + n + k]
    return []


def test_vllm_docstring_example_truncated_at_the_end_of_history():
    # the suffix 4 2 3 never occurred earlier; 2 3 did: the draft is what followed, 3 of k = 4
    assert NgramProposer(4, 2, 3).propose_lists([[1, 2, 3, 4, 2, 3]]) == [[4, 2, 3]]


def test_no_match_proposes_nothing():
    assert NgramProposer(3, 2, 4).propose_lists([[1, 2, 3, 4, 5, 6], [7], [], [5, 5]]) == [[], [], [], []]


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # suffix 7 8 9: the 3-gram occurred at s = 0 (followed by 1); the 2-gram 8 9 also at s = 5
    seq = [7, 8, 9, 1, 2, 8, 9, 3, 4, 7, 8, 9]
    assert NgramProposer(2, 2, 3).propose_lists([seq]) == [[1, 2]]
    assert NgramProposer(2, 2, 2).propose_lists([seq]) == [[1, 2]]          # 8 9 first at s = 1
    assert NgramProposer(2, 1, 1).propose_lists([seq]) == [[1, 2]]          # 9 first at s = 2


def test_the_earliest_occurrence_of_the_winning_ngram_is_used():
    seq = [5, 6, 1, 5, 6, 2, 5, 6, 3, 5, 6]
    assert NgramProposer(1, 2, 2).propose_lists([seq]) == [[1]]


def test_an_occurrence_may_overlap_the_suffix():
    # 4 4 4 at s = 0 overlaps the suffix at s = 1; one token follows it
    assert NgramProposer(3, 1, 3).propose_lists([[4, 4, 4, 4]]) == [[4]]
    assert NgramProposer(3, 2, 2).propose_lists([[1, 2, 1, 2, 1]]) == [[2, 1]]


def test_max_model_len_caps_the_draft():
    seq = [1, 2, 3, 9, 9, 1, 2, 3]
    assert NgramProposer(4, 1, 3).propose_lists([seq]) == [[9, 9, 1, 2]]
    assert NgramProposer(4, 1, 3, max_model_len=10).propose_lists([seq]) == [[9, 9]]
    assert NgramProposer(4, 1, 3, max_model_len=8).propose_lists([seq]) == [[]]


def test_batch_of_mixed_lengths_from_the_workers_token_matrix():
    seqs = [[1, 2, 3, 1, 2], [4], [], [6, 7, 8, 6, 7, 8, 6], [9, 9, 9, 9, 9, 9, 9, 9, 9]]
    proposer = NgramProposer(3, 1, 4)
    matrix = np.full((len(seqs), 16), 12345, dtype=np.int32)   # junk beyond each length
    for b, s in enumerate(seqs):
        matrix[b, :len(s)] = s
    out = proposer.propose(matrix, np.array([len(s) for s in seqs]))
    assert out.draft_token_ids.shape == (len(seqs), 3)
    assert out.to_lists() == [_reference(s, 3, 1, 4) for s in seqs] == [[3, 1, 2], [], [], [7, 8, 6], [9, 9, 9]]
    assert (out.draft_token_ids[1] == -1).all()


@settings(max_examples=300, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=6),
       k=st.integers(1, 6), min_n=st.integers(1, 3), extra=st.integers(0, 3),
       max_model_len=st.one_of(st.none(), st.integers(0, 45)))
def test_equals_the_reference_on_random_sequences(seqs, k, min_n, extra, max_model_len):
    if max_model_len is not None:
        max_model_len = max(max_model_len, max(len(s) for s in seqs))
    proposer = NgramProposer(k, min_n, min_n + extra, max_model_len)
    assert proposer.propose_lists(seqs) == [_reference(s, k, min_n, min_n + extra, max_model_len) for s in seqs]


def test_from_config_takes_the_lookup_bounds():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    p = NgramProposer.from_config(cfg, max_model_len=100)
    assert (p.k, p.min_n, p.max_n, p.max_model_len) == (2, 2, 3, 100)


# --- SpeculativeConfig --------------------------------------------------------------------------

def test_ngram_lookup_defaults_are_vllms():
    parse = lambda **kw: SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **kw})
    both = parse()
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = parse(prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse(prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


def test_method_follows_from_model_as_in_vllm():
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    cfg = SpeculativeConfig.from_json('{"model": "SmolLM2-135M", "num_speculative_tokens": 2}')
    assert (cfg.method, cfg.model) == ("draft_model", "SmolLM2-135M")
    cfg = SpeculativeConfig.from_dict({"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 4})
    assert (cfg.method, cfg.model, cfg.quantization) == ("self_draft", None, "gguf-i8")


@pytest.mark.parametrize("raw, field", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "gguf"}, "quantization"),
    ({"method": "eagle", "num_speculative_tokens": 3, "model": "x"}, "method 'eagle' is not supported"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "m", "prompt_lookup_max": 3},
     "prompt_lookup_max only applies to method ngram"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "m", "quantization": "awq"}, "quantization"),
    ({"method": "self_draft", "num_speculative_tokens": 3}, "quantization is required"),
    ({"method": "self_draft", "num_speculative_tokens": 3, "quantization": "gguf", "model": "m"}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
     "draft_tensor_parallel_size"),
])
def test_invalid_configs_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(raw)


def test_invalid_json_is_a_value_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")
