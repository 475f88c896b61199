"""Sampler: each processor against a row-by-row reference, the chain order, greedy and seeded
rows in mixed batches, and log-probs. Distribution checks live in test_sampler_stats.py."""
from __future__ import annotations

import math

import pytest
import torch

from models.sampler import (LogprobsTensors, Sampler, SamplingMetadata, apply_grammar_bitmask,
                            apply_logits_processors, compute_prompt_logprobs, seeded_generator)

V = 1000
INF = float("inf")


def _logits(B: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(B, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(logits: torch.Tensor, **kw) -> torch.Tensor:
    """Run the chain through apply_logits_processors only (steps 3-8): (B, V) processed logits."""
    out = logits.clone()
    apply_logits_processors(out, SamplingMetadata.from_lists([1.0] * logits.shape[0], **kw))
    return out


def _processed_logprobs(logits: torch.Tensor, temperature: list[float], **kw) -> torch.Tensor:
    """The whole chain, read back through 'processed' log-probs over the whole vocab: (B, V)."""
    meta = SamplingMetadata.from_lists(temperature, max_num_logprobs=-1, logprobs_mode="processed_logprobs", **kw)
    lp = Sampler()(logits, meta).logprobs
    return torch.empty_like(logits).scatter_(1, lp.token_ids[:, 1:], lp.logprobs[:, 1:])


# -- row-by-row references: plain Python over one row's list of floats -------------------------------

def ref_bitmask(row, words):
    bit = lambda j: j // 32 < len(words) and (words[j // 32] & 0xFFFFFFFF) >> (j % 32) & 1
    return [x if bit(j) else -INF for j, x in enumerate(row)]


def ref_allowed(row, allowed):
    return row if allowed is None else [x if j in allowed else -INF for j, x in enumerate(row)]


def ref_bad_words(row, bad_words, output):
    row = list(row)
    for word in bad_words or []:
        *prefix, last = word
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            row[last] = -INF
    return row


def ref_min_tokens(row, n, stop_ids, eos_ids, output):
    short = len(output) < n
    return [-INF if short and (j in stop_ids or j in eos_ids) else x for j, x in enumerate(row)]


def ref_logit_bias(row, bias):
    return [x + (bias or {}).get(j, 0.0) for j, x in enumerate(row)]


def ref_penalties(row, presence, frequency, repetition, prompt, output):
    out = []
    for j, x in enumerate(row):
        if j in prompt or j in output:
            x = x / repetition if x > 0 else x * repetition
        out.append(x - frequency * output.count(j) - presence * (j in output))
    return out


def _softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    return [x / sum(e) for x in e]


def ref_min_p(row, min_p):
    probs = _softmax(row)
    return [x if p >= min_p * max(probs) else -INF for x, p in zip(row, probs)]


def ref_top_k(row, k):
    if k <= 0:
        return row
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x if x >= kth else -INF for x in row]


def ref_top_p(row, p):
    probs, keep, mass = _softmax(row), set(), 0.0
    for j in sorted(range(len(row)), key=lambda j: -row[j]):
        if mass < p:                       # smallest prefix whose mass reaches p
            keep.add(j)
        mass += probs[j]
    return [x if j in keep else -INF for j, x in enumerate(row)]


def _assert_rows(actual: torch.Tensor, expected: list[list[float]]):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-5, atol=1e-5)


# -- processors one by one ------------------------------------------------------------------------

def test_grammar_bitmask_with_a_vocab_not_a_multiple_of_32():
    vocab, B = 37, 4                                                      # W = 2 words, 27 spare bits
    logits = _logits(B, seed=1, vocab=vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, 2), generator=torch.Generator().manual_seed(2),
                            dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1                                                       # all allowed (sign bit too)
    bitmask[1, 0] = 0                                                     # only tokens 32..36 possible
    bitmask[1, 1] = 0b10100
    got = _processed(logits, grammar_bitmask=bitmask)
    _assert_rows(got, [ref_bitmask(r, w) for r, w in zip(logits.tolist(), bitmask.tolist())])
    assert torch.equal(got[0], logits[0]) and got[1].isfinite().sum() == 2
    greedy = Sampler()(logits, SamplingMetadata.from_lists([0.0] * B, grammar_bitmask=bitmask))
    assert torch.equal(greedy.sampled_token_ids, got.argmax(-1))
    assert greedy.sampled_token_ids[1] in (34, 36)


def test_grammar_bitmask_agrees_with_xgrammar_and_masks_beyond_its_width():
    xgr = pytest.importorskip("xgrammar")
    logits = _logits(3, seed=3, vocab=37)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), generator=torch.Generator().manual_seed(4),
                            dtype=torch.int64).to(torch.int32)
    ours, theirs = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    narrow = logits.clone()
    apply_grammar_bitmask(narrow, bitmask[:, :1])                       # covers tokens 0..31 only
    assert torch.equal(narrow[:, :32], ours[:, :32]) and (narrow[:, 32:] == -INF).all()


def test_allowed_token_ids():
    logits = _logits(3, seed=5, vocab=20)
    allowed = [[3, 7, 19], None, [0]]
    _assert_rows(_processed(logits, allowed_token_ids=allowed),
                 [ref_allowed(r, a) for r, a in zip(logits.tolist(), allowed)])


def test_bad_words_ban_the_token_that_would_complete_a_sequence():
    logits = _logits(4, seed=6, vocab=12)
    bad = [[[5], [1, 2, 7], [3, 9]], [[1, 2, 7]], None, [[4, 4, 4, 8]]]
    output = [[0, 1, 2], [2], [1, 2], [4, 4]]     # row 1: prefix longer than the output; row 3: too short
    got = _processed(logits, bad_words_token_ids=bad, output_token_ids=output)
    _assert_rows(got, [ref_bad_words(r, b, o) for r, b, o in zip(logits.tolist(), bad, output)])
    assert set((got[0] == -INF).nonzero().flatten().tolist()) == {5, 7}
    assert got[1:].isfinite().all()


def test_min_tokens_bans_stop_and_eos_until_reached():
    logits = _logits(3, seed=7, vocab=10)
    kw = dict(min_tokens=[3, 3, 0], stop_token_ids=[[4], [4], [4]], eos_token_ids=[[9], [9, 8], [9]],
              output_token_ids=[[1, 2], [1, 2, 3], []])
    got = _processed(logits, **kw)
    _assert_rows(got, [ref_min_tokens(r, *args) for r, *args in zip(logits.tolist(), *kw.values())])
    assert (got[0, [4, 9]] == -INF).all() and got[1:].isfinite().all()


def test_logit_bias():
    logits = _logits(3, seed=8, vocab=10)
    bias = [{2: 5.0, 7: -100.0}, None, {"0": 1.5}]                        # OpenAI sends keys as strings
    got = _processed(logits, logit_bias=bias)
    _assert_rows(got, [ref_logit_bias(r, {int(k): v for k, v in (b or {}).items()})
                       for r, b in zip(logits.tolist(), bias)])


def test_presence_frequency_and_repetition_penalties():
    logits = _logits(4, seed=9, vocab=16)
    kw = dict(presence_penalty=[0.5, 0.0, 1.0, 0.0], frequency_penalty=[0.3, 0.0, 0.0, -0.2],
              repetition_penalty=[1.0, 1.5, 2.0, 1.0],
              prompt_token_ids=[[1, 2], [3, 4, 5, 6], [0, 15], [7]],
              output_token_ids=[[2, 2, 9], [5, 6, 6, 11], [15, 15, 1], []])
    got = _processed(logits, **kw)
    expected = [ref_penalties(r, *args) for r, *args in zip(logits.tolist(), *kw.values())]
    _assert_rows(got, expected)
    assert (got[1, [3, 11]] != logits[1, [3, 11]]).all()                # prompt and output both count
    assert torch.equal(got[3], logits[3])                                  # nothing generated yet


def test_temperature_and_greedy_rows_in_processed_logprobs():
    logits = _logits(3, seed=10, vocab=50)
    got = _processed_logprobs(logits, [0.5, 0.0, 2.0], top_k=[0, 3, 0], min_p=[0.0, 0.5, 0.0])
    T = torch.tensor([0.5, 1.0, 2.0])[:, None]                  # greedy rows: temperature 1, no truncation
    torch.testing.assert_close(got, (logits / T).log_softmax(-1))


def test_min_p_top_k_top_p_against_reference():
    logits = _logits(5, seed=11, vocab=40) / 2
    min_p, top_k, top_p = [0.0, 0.1, 0.0, 0.05, 0.0], [0, 0, 5, 10, 0], [1.0, 1.0, 1.0, 0.8, 0.6]
    got = _processed_logprobs(logits, [1.0] * 5, min_p=min_p, top_k=top_k, top_p=top_p)
    expected = [ref_top_p(ref_top_k(ref_min_p(r, m), k), p)
                for r, m, k, p in zip(logits.tolist(), min_p, top_k, top_p)]
    torch.testing.assert_close(got, torch.tensor(expected).log_softmax(-1))
    only_k = _processed_logprobs(logits, [1.0] * 5, top_k=top_k)           # the top-k-only path
    torch.testing.assert_close(only_k, torch.tensor([ref_top_k(r, k) for r, k in zip(
        logits.tolist(), top_k)]).log_softmax(-1))


# -- the chain as a whole ---------------------------------------------------------------------------

def ref_chain(row, T, p, i):
    """One row through the book's order; returns (logits before temperature, final logits)."""
    row = ref_bitmask(row, p["grammar_bitmask"][i].tolist())
    row = ref_allowed(row, p["allowed_token_ids"][i])
    row = ref_bad_words(row, p["bad_words_token_ids"][i], p["output_token_ids"][i])
    row = ref_min_tokens(row, p["min_tokens"][i], p["stop_token_ids"][i], p["eos_token_ids"][i],
                         p["output_token_ids"][i])
    row = ref_logit_bias(row, p["logit_bias"][i])
    row = ref_penalties(row, p["presence_penalty"][i], p["frequency_penalty"][i],
                        p["repetition_penalty"][i], p["prompt_token_ids"][i], p["output_token_ids"][i])
    if T == 0:
        return row, row
    tempered = ref_min_p([x / T for x in row], p["min_p"][i])
    return row, ref_top_p(ref_top_k(tempered, p["top_k"][i]), p["top_p"][i])


def _chain_params(B: int = 6, vocab: int = 45) -> tuple[list[float], dict]:
    g = torch.Generator().manual_seed(12)
    bitmask = torch.full((B, 2), -1, dtype=torch.int32)
    bitmask[2] = torch.randint(-2**31, 2**31 - 1, (2,), generator=g, dtype=torch.int64).to(torch.int32)
    return [0.0, 0.8, 1.3, 0.0, 1.0, 0.6], dict(
        grammar_bitmask=bitmask, allowed_token_ids=[None, None, None, list(range(0, 45, 2)), None, None],
        bad_words_token_ids=[[[3]], None, [[1, 2]], None, [[9, 10, 11]], None],
        output_token_ids=[[1, 2], [4, 4, 4], [1], [], [9, 10], [44, 3]],
        prompt_token_ids=[[5, 6], [7], [8, 8], [0], [1], [2, 3]],
        min_tokens=[0, 5, 0, 1, 0, 0], stop_token_ids=[[], [6], [], [2], [], []],
        eos_token_ids=[[0]] * B, logit_bias=[None, {4: 2.0}, None, {2: 30.0}, None, {3: -1.0, 0: -1.0}],
        presence_penalty=[0.0, 0.7, 0.0, 0.0, 0.2, 0.0], frequency_penalty=[0.0, 0.4, 0.0, 0.0, 0.0, 0.0],
        repetition_penalty=[1.3, 1.0, 1.0, 1.0, 1.0, 2.0],
        min_p=[0.0, 0.0, 0.05, 0.0, 0.0, 0.1], top_k=[0, 10, 0, 0, 7, 0],
        top_p=[1.0, 0.9, 1.0, 1.0, 0.95, 1.0])


def test_whole_chain_matches_the_reference_in_order():
    temperature, params = _chain_params()
    logits = _logits(6, seed=13, vocab=45)
    got = _processed_logprobs(logits, temperature, **params)
    refs = [ref_chain(r, T, params, i) for i, (r, T) in enumerate(zip(logits.tolist(), temperature))]
    torch.testing.assert_close(got, torch.tensor([final for _, final in refs]).log_softmax(-1))
    sampled = Sampler()(logits, SamplingMetadata.from_lists(temperature, **params)).sampled_token_ids
    for i in (0, 3):                                                      # greedy rows: argmax of steps 3-8
        assert sampled[i] == max(range(45), key=lambda j: refs[i][0][j])
    assert sampled[3] % 2 == 0 and sampled[3] != 2      # allowed, and min_tokens' -inf beats the +30 bias
    for i in (1, 2, 4, 5):                                                # sampled rows stay in the support
        assert got[i, sampled[i]] > -INF


def test_bias_and_penalties_come_before_temperature():
    logits = _logits(1, seed=14, vocab=20)
    row, T = logits[0], 2.0
    bias = torch.zeros(20)
    bias[3] = 4.0
    got = _processed_logprobs(logits, [T], logit_bias=[{3: 4.0}])[0]
    torch.testing.assert_close(got, ((row + bias) / T).log_softmax(-1))
    assert not torch.allclose(got, (row / T + bias).log_softmax(-1))
    kw = dict(presence_penalty=[3.0], output_token_ids=[[5]])
    got = _processed_logprobs(logits, [T], **kw)[0]
    penalized = torch.tensor(ref_penalties(row.tolist(), 3.0, 0.0, 1.0, [], [5]))
    torch.testing.assert_close(got, (penalized / T).log_softmax(-1))
    assert not torch.allclose(got, torch.tensor(ref_penalties((row / T).tolist(), 3.0, 0.0, 1.0, [], [5]))
                              .log_softmax(-1))


def test_bias_comes_before_the_repetition_penalty():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    got = _processed(logits, logit_bias=[{0: 1.0, 1: 1.0}], repetition_penalty=[2.0],
                     prompt_token_ids=[[0, 1]], output_token_ids=[[]])
    torch.testing.assert_close(got, torch.tensor([[(2.0 + 1.0) / 2, (-1.0 + 1.0) * 2, 0.5]]))


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]).log()  # exact binary masses
    kept = lambda p: _processed_logprobs(logits, [1.0], top_p=[p])[0].isfinite().nonzero().flatten().tolist()
    assert kept(0.5) == [0] and kept(0.51) == [0, 1] and kept(0.75) == [0, 1] and kept(0.875) == [0, 1, 2]


def test_min_p_comes_after_temperature_and_before_top_p():
    probs = torch.tensor([0.02, 0.25, 0.05, 0.18, 0.01, 0.12, 0.08, 0.2, 0.04, 0.05])
    logits = probs.log()[None]
    kept = lambda **kw: set(_processed_logprobs(logits, kw.pop("T", [1.0]), **kw)[0]
                            .isfinite().nonzero().flatten().tolist())
    # min_p 0.3 on p keeps p >= 0.075: {1, 7, 3, 5, 6}; at T=3 the flatter distribution keeps all
    assert kept(min_p=[0.3]) == {1, 3, 5, 6, 7} and len(kept(min_p=[0.3], T=[3.0])) == 10
    # min_p first, then top_p 0.7 over the renormalized rest: {1, 7, 3}; the other way round: {1, 7, 3, 5}
    assert kept(min_p=[0.3], top_p=[0.7]) == {1, 3, 7}


# -- greedy and seeded rows in mixed batches ---------------------------------------------------------

def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = _logits(6)
    meta = SamplingMetadata.from_lists([0.0, 1.0, 0.0, 0.7, 0.0, 1.5], top_k=[0, 50, -1, 0, 5, 0],
                                       min_p=[0.5] * 6, top_p=[0.1] * 6)
    greedy = logits.argmax(-1)
    for seed in range(3):
        torch.manual_seed(seed)
        tokens = Sampler()(logits, meta).sampled_token_ids
        assert tokens.dtype == torch.int64 and tokens.shape == (6,)
        assert torch.equal(tokens[[0, 2, 4]], greedy[[0, 2, 4]])
    all_greedy = Sampler()(logits, SamplingMetadata.from_lists([0.0] * 6)).sampled_token_ids
    assert torch.equal(all_greedy, greedy)


def test_top_k_one_equals_greedy():
    logits = _logits(64, seed=1)
    meta = SamplingMetadata.from_lists([1.3] * 64, top_k=[1] * 64)
    for _ in range(3):
        assert torch.equal(Sampler()(logits, meta).sampled_token_ids, logits.argmax(-1))


def _seeded_run(row_logits: torch.Tensor, others: torch.Tensor, position: int, seed: int, steps: int = 20):
    batch = torch.cat([others[:position], row_logits[None], others[position:]])
    B = batch.shape[0]
    gens = [None] * B
    gens[position] = torch.Generator().manual_seed(seed)
    if B > 2:
        gens[(position + 1) % B] = torch.Generator().manual_seed(seed + 1)  # another seeded row
    temperature = [0.0 if i % 3 == 2 else 1.0 for i in range(B)]          # some greedy neighbours
    temperature[position] = 1.0
    meta = SamplingMetadata.from_lists(temperature, top_p=[0.95] * B, generators=gens,
                                       min_p=[0.01] * B, logit_bias=[{7: 1.0}] * B)
    return [int(Sampler()(batch, meta).sampled_token_ids[position]) for _ in range(steps)]


def test_seeded_row_is_independent_of_batch_composition():
    row = torch.randn(V) * 0.5  # flat enough that draws vary
    alone = _seeded_run(row, _logits(0), 0, seed=123)
    in_small = _seeded_run(row, _logits(1, seed=2), 1, seed=123)
    torch.manual_seed(999)  # the global RNG state must not matter either
    in_large = _seeded_run(row, _logits(7, seed=3), 4, seed=123)
    at_end = _seeded_run(row, _logits(5, seed=4), 5, seed=123)
    assert alone == in_small == in_large == at_end
    assert len(set(alone)) > 1  # the row really samples
    assert _seeded_run(row, _logits(0), 0, seed=124) != alone


def test_a_seeded_generator_resumed_after_k_tokens_continues_the_same_stream():
    row = torch.randn(V) * 0.5
    meta = lambda gen: SamplingMetadata.from_lists([0.9], generators=[gen])    # noqa: E731
    straight = seeded_generator(77, 0.9, 0, V)
    tokens = [int(Sampler()(row[None], meta(straight)).sampled_token_ids[0]) for _ in range(12)]
    resumed = seeded_generator(77, 0.9, 5, V)           # as after a preemption at 5 sampled tokens
    assert [int(Sampler()(row[None], meta(resumed)).sampled_token_ids[0]) for _ in range(7)] == tokens[5:]
    assert len(set(tokens)) > 1
    greedy = seeded_generator(77, 0.0, 5, V)            # greedy rows draw nothing: nothing to skip
    assert torch.equal(greedy.get_state(), torch.Generator().manual_seed(77).get_state())


# -- log-probs ---------------------------------------------------------------------------------------

def _ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
    return [sum(1 for x in row if x >= row[t]) for row, t in zip(logprobs.tolist(), token_ids.tolist())]


def _check_logprobs(lp: LogprobsTensors, reference: torch.Tensor, token_ids: torch.Tensor, k: int):
    N = reference.shape[0]
    assert lp.token_ids.shape == (N, k + 1) and lp.logprobs.shape == (N, k + 1) and lp.ranks.shape == (N,)
    assert lp.logprobs.dtype == torch.float32 and lp.ranks.dtype == torch.int64
    assert torch.equal(lp.token_ids[:, 0], token_ids)
    torch.testing.assert_close(lp.logprobs, reference.gather(1, lp.token_ids))
    torch.testing.assert_close(lp.logprobs[:, 1:], reference.topk(k, dim=-1).values)
    assert lp.ranks.tolist() == _ranks(reference, token_ids)


def test_raw_logprobs_are_taken_before_any_processing():
    logits = _logits(5, seed=15).to(torch.bfloat16)
    meta = SamplingMetadata.from_lists([0.0, 1.0, 0.7, 1.0, 0.0], top_k=[0, 3, 0, 0, 0],
                                       logit_bias=[{1: 9.0}] * 5, max_num_logprobs=4)
    out = Sampler()(logits, meta)
    _check_logprobs(out.logprobs, logits.float().log_softmax(-1), out.sampled_token_ids, 4)
    assert out.logprobs.ranks[0] > 1                                     # bias made greedy pick a raw non-top


def test_processed_logprobs_and_widths():
    logits = _logits(4, seed=16, vocab=30)
    temperature, kw = [0.5, 0.0, 1.0, 2.0], dict(top_k=[0, 0, 5, 0], presence_penalty=[1.0] * 4,
                                                  output_token_ids=[[1], [2], [3], [4]])
    out = Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=3,
                                                        logprobs_mode="processed_logprobs", **kw))
    reference = _processed_logprobs(logits, temperature, **kw)
    _check_logprobs(out.logprobs, reference, out.sampled_token_ids, 3)
    assert (out.logprobs.ranks[2] <= 5) and out.logprobs.ranks[1] == 1
    zero = Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=0)).logprobs
    assert zero.token_ids.shape == (4, 1)
    full = Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=-1)).logprobs
    assert full.token_ids.shape == (4, 31)
    assert Sampler()(logits, SamplingMetadata.from_lists(temperature)).logprobs is None


def test_logprob_token_ids_rows_return_those_tokens_in_place_of_their_top_ones():
    """vLLM's logprob_token_ids: a row's listed tokens' log-probs after the sampled token's, in
    their order; other rows keep their top-k; the batch is as wide as the widest row."""
    from actors.engine.sampling_params import SamplingParams
    logits = _logits(3, seed=19, vocab=30)
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logprobs=0,
                                                                          logprob_token_ids=[5, 17, 2]),
              SamplingParams(temperature=0.0)]
    meta = SamplingMetadata.from_params(params, [None] * 3, eos_token_ids=[0], output_token_ids=lambda: [[]] * 3,
                                        prompt_token_ids=lambda: [[]] * 3)
    assert meta.max_num_logprobs == 3 and meta.logprob_token_ids == {1: [5, 17, 2]}
    out = Sampler()(logits, meta).logprobs
    reference = logits.log_softmax(-1)
    assert out.token_ids[1, 1:].tolist() == [5, 17, 2]
    torch.testing.assert_close(out.logprobs[1, 1:], reference[1, [5, 17, 2]])
    assert out.token_ids[0, 1:].tolist() == reference[0].topk(3).indices.tolist()
    assert params[1].num_logprobs == 3 and params[0].num_logprobs == 1 and params[2].num_logprobs is None
    with pytest.raises(ValueError, match="logprobs must be set"):
        SamplingParams(logprob_token_ids=[1]).check(30, 20)


def test_logits_modes_return_the_values_before_the_softmax():
    logits = _logits(3, seed=18, vocab=30)
    temperature, kw = [0.0, 1.0, 0.5], dict(logit_bias=[{2: 3.0}] * 3)
    raw = Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=2,
                                                        logprobs_mode="raw_logits", **kw)).logprobs
    torch.testing.assert_close(raw.logprobs[:, 0], logits.gather(1, raw.token_ids[:, :1])[:, 0])
    processed = Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=2,
                                                              logprobs_mode="processed_logits", **kw)).logprobs
    reference = _processed_logprobs(logits, temperature, **kw)       # log-softmax of the processed logits
    want = reference.gather(1, processed.token_ids)                   # logits and log-probs differ by a
    got = processed.logprobs                                          # constant per row: compare gaps
    torch.testing.assert_close(got - got[:, :1], want - want[:, :1])


def test_prompt_logprobs():
    logits = _logits(7, seed=17, vocab=25).to(torch.float16)
    targets = torch.tensor([3, 0, 24, 7, 7, 1, 2])
    lp = compute_prompt_logprobs(logits, targets, 5)
    _check_logprobs(lp, logits.float().log_softmax(-1), targets, 5)


# -- metadata ----------------------------------------------------------------------------------------

def test_unused_processors_are_skipped_and_inputs_are_never_written():
    meta = SamplingMetadata.from_lists([0.7, 0.0], top_p=[1.0, 0.5], min_p=[0.0, 0.3])
    assert meta.no_logits_processors and meta.no_top_p and meta.no_min_p and meta.no_top_k
    assert meta.penalties is None and meta.max_num_logprobs is None
    temperature, params = _chain_params()
    logits = _logits(6, seed=18, vocab=45)
    before = logits.clone()
    Sampler()(logits, SamplingMetadata.from_lists(temperature, max_num_logprobs=2, **params))
    Sampler()(logits, SamplingMetadata.from_lists([0.0] * 6))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("kw, message", [
    (dict(top_p=[1.0]), "top_p has 1 entries"),
    (dict(min_tokens=[1, 0], stop_token_ids=[[1], []]), "needs output_token_ids"),
    (dict(repetition_penalty=[1.2, 1.0], output_token_ids=[[], []]), "needs prompt_token_ids"),
    (dict(allowed_token_ids=[[], None]), "must not be empty"),
    (dict(logprobs_mode="logits"), "logprobs_mode"),
    (dict(grammar_bitmask=torch.zeros(2, 1, dtype=torch.int64)), "int32"),
])
def test_bad_metadata_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingMetadata.from_lists([1.0, 1.0], **kw)


def test_the_sampling_mask_is_each_rows_support_after_truncation_and_holds_its_draw():
    """vLLM's --return-sampling-mask: per row, the ids a draw could pick (after bias, min-p,
    top-k and top-p), ascending; the sampled token is among them; a greedy row's is its argmax."""
    import dataclasses
    logits = _logits(4, seed=23, vocab=50)
    base = SamplingMetadata.from_lists([1.0, 0.7, 1.0, 0.0], top_k=[5, 0, 3, 0], top_p=[1.0, 0.5, 1.0, 1.0],
                                       min_p=[0.0, 0.0, 0.0, 0.0], logit_bias=[{}, {}, {7: -INF}, {}])
    for seed in range(5):
        torch.manual_seed(seed)
        out = Sampler()(logits, dataclasses.replace(base, return_supports=True))
        supports = [s.tolist() for s in out.supports]
        assert supports[0] == sorted(logits[0].topk(5).indices.tolist())
        probs = (logits[1] / 0.7).softmax(-1)
        order = probs.argsort(descending=True).tolist()
        kept = next(i for i in range(1, 51) if probs[order[:i]].sum() >= 0.5)      # the nucleus
        assert set(supports[1]) == set(order[:kept])
        row2 = logits[2].clone()
        row2[7] = -INF
        assert supports[2] == sorted(row2.topk(3).indices.tolist()) and 7 not in supports[2]
        assert supports[3] == [int(logits[3].argmax())]
        assert all(tok in s for tok, s in zip(out.sampled_token_ids.tolist(), supports))
    assert Sampler()(logits, base).supports is None
