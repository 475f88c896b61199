"""The rejection sampler (models/rejection_sampler.py) on the CPU: greedy rows emit exactly the
target's greedy chain, requests without drafts sample exactly as the plain sampler, seeded rows
replay, and the emitted tokens follow the target's distribution (chi-square over 20k requests
with a draft distribution unlike the target's; two deliberately broken samplers fail the same
check, so it can fail)."""
from __future__ import annotations

import pytest
import torch

import models.rejection_sampler as rs
from models.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from models.sampler import Sampler, SamplingMetadata

V = 8
N_DRAWS = 20_000


def _argmax_chain(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """What greedy decoding emits: the argmax at each position until a draft differs from it."""
    out, row = [], 0
    for d in drafts:
        emitted = []
        for j in range(len(d) + 1):
            best = int(logits[row + j].argmax())
            emitted.append(best)
            if j == len(d) or d[j] != best:
                break
        out.append(emitted)
        row += len(d) + 1
    return out


def _greedy_drafts(logits: torch.Tensor, num_drafts: list[int], g: torch.Generator) -> list[list[int]]:
    """Drafts that follow the argmax for a random number of positions, then (maybe) differ."""
    drafts, row = [], 0
    for k in num_drafts:
        argmax = logits[row:row + k].argmax(-1).tolist()
        stop = int(torch.randint(k + 1, (1,), generator=g))
        drafts.append([t if j < stop else (t + 1) % logits.shape[1] for j, t in enumerate(argmax)])
        row += k + 1
    return drafts


def test_greedy_rows_emit_the_targets_argmax_chain():
    g = torch.Generator().manual_seed(0)
    num_drafts = [3, 0, 5, 1, 4, 2, 5, 5, 0, 3] * 3
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 50, generator=g)
    drafts = _greedy_drafts(logits, num_drafts, g)
    spec = SpecDecodeMetadata.from_lists(drafts)
    out = RejectionSampler()(logits, None, spec, SamplingMetadata.from_lists([0.0] * len(drafts)))
    assert out.shape == (len(drafts), 6)
    parsed = RejectionSampler.parse_output(out)
    assert parsed == _argmax_chain(logits, drafts)
    assert any(len(p) == k + 1 for p, k in zip(parsed, num_drafts) if k)   # some bonus tokens
    assert any(len(p) <= k for p, k in zip(parsed, num_drafts))            # some rejections


def test_greedy_rows_of_a_mixed_batch_ignore_the_random_rows():
    g = torch.Generator().manual_seed(1)
    num_drafts = [4, 3, 0, 5, 2, 4]
    greedy = [True, False, True, False, True, False]
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 40, generator=g)
    drafts = _greedy_drafts(logits, num_drafts, g)
    spec = SpecDecodeMetadata.from_lists(drafts)
    draft_probs = torch.randn(sum(num_drafts), 40, generator=g).softmax(-1)
    chain = _argmax_chain(logits, drafts)
    for temperature in (0.5, 1.5):
        meta = SamplingMetadata.from_lists([0.0 if gr else temperature for gr in greedy], top_k=[10] * 6)
        parsed = RejectionSampler.parse_output(RejectionSampler()(logits, draft_probs, spec, meta))
        for i, gr in enumerate(greedy):
            if gr:
                assert parsed[i] == chain[i]
            else:   # accepted drafts are a prefix of the drafts, then one token
                assert 1 <= len(parsed[i]) <= num_drafts[i] + 1
                assert parsed[i][:-1] == drafts[i][:len(parsed[i]) - 1]


def test_requests_without_drafts_sample_exactly_as_the_plain_sampler():
    g = torch.Generator().manual_seed(2)
    B = 12
    logits = torch.randn(B, 64, generator=g) * 3
    temperature = [0.0, 0.7, 1.0, 1.3] * 3
    seeds = [None, 5, None, 7, 11, None, 13, 17, None, None, 19, 23]
    kwargs = dict(top_k=[0, 5, 20, 0] * 3, top_p=[1.0, 0.9, 1.0, 0.8] * 3)

    def generators():
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    torch.manual_seed(3)
    plain = Sampler()(logits, SamplingMetadata.from_lists(temperature, generators=generators(), **kwargs))
    torch.manual_seed(3)
    meta = SamplingMetadata.from_lists(temperature, generators=generators(), **kwargs)
    out = RejectionSampler()(logits, None, SpecDecodeMetadata.from_lists([[]] * B), meta)
    assert out.shape == (B, 1)
    assert torch.equal(out[:, 0], plain.sampled_token_ids)


def test_seeded_rows_replay_whatever_the_global_rng_and_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(4)
    num_drafts = [3, 0, 4, 2]
    logits = torch.randn(sum(num_drafts) + 4, 30, generator=g)
    drafts = [torch.randint(30, (k,), generator=g).tolist() for k in num_drafts]
    draft_probs = torch.randn(sum(num_drafts), 30, generator=g).softmax(-1)
    spec = SpecDecodeMetadata.from_lists(drafts)

    def run(global_seed: int, other_seeds: tuple[int | None, int | None]) -> torch.Tensor:
        torch.manual_seed(global_seed)
        gens = [torch.Generator().manual_seed(42), *(None if s is None else torch.Generator().manual_seed(s)
                                                      for s in other_seeds), torch.Generator().manual_seed(43)]
        meta = SamplingMetadata.from_lists([0.9, 1.1, 0.8, 1.0], generators=gens, top_p=[0.95] * 4)
        return RejectionSampler()(logits, draft_probs, spec, meta)

    first = run(0, (None, None))
    outs = [run(s, others) for s in range(1, 8) for others in [(None, None), (1, 2)]]
    for out in outs:   # rows 0 and 3 are seeded the same every time
        assert torch.equal(out[[0, 3]], first[[0, 3]])
    assert any(not torch.equal(out[2], first[2]) for out in outs)   # row 2 follows the global RNG


def test_target_logits_of_the_wrong_height_are_refused():
    spec = SpecDecodeMetadata.from_lists([[1, 2], [3]])
    with pytest.raises(ValueError, match="target_logits"):
        RejectionSampler()(torch.randn(4, 8), None, spec, SamplingMetadata.from_lists([1.0, 1.0]))
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(torch.randn(5, 8), torch.rand(3, 7), spec, SamplingMetadata.from_lists([1.0, 1.0]))


# --- the emitted tokens follow the target's distribution ----------------------------------------

TEMPERATURE, TOP_K, TOP_P = 0.8, 6, 0.9
_g = torch.Generator().manual_seed(1234)
L1 = torch.randn(V, generator=_g) * 1.5              # the target's logits at the first position
L2 = torch.randn(V, V, generator=_g) * 1.5           # ... at the second, given the first token
L3 = torch.randn(V, V, generator=_g)                 # ... at the third, given the second
Q1 = torch.rand(V, generator=_g).pow(3).add(0.01)    # the draft's: unlike the target's, with mass
Q1 /= Q1.sum()                                       # on tokens the target truncates
Q2 = torch.rand(V, V, generator=_g).pow(3).add(0.01)
Q2 /= Q2.sum(-1, keepdim=True)


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p over what top-k kept: (..., V) probabilities."""
    probs = (logits / TEMPERATURE).softmax(-1)
    desc, order = probs.sort(-1, descending=True)
    desc[..., TOP_K:] = 0.0
    desc /= desc.sum(-1, keepdim=True)
    mass_before = desc.cumsum(-1) - desc
    desc = torch.where(mass_before < TOP_P, desc, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, desc / desc.sum(-1, keepdim=True))


def _draws(k: int, ngram: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """N_DRAWS requests with k drafts each (k = 1: the second token is the bonus; k = 2: it is
    accepted or recovered at the second draft). -> (first tokens (N,), the (N, 2) first two where
    two were emitted), and the draft's first-position distribution."""
    g = torch.Generator().manual_seed(k)
    if ngram:   # a deterministic proposer: fixed drafts, point masses
        q1 = torch.nn.functional.one_hot(torch.tensor(int(_processed(L1).argsort()[-2])), V).float()
        x1 = q1.argmax().expand(N_DRAWS)
        x2 = _processed(L2).argsort(-1)[:, -2][x1]
    else:
        q1 = Q1
        x1 = torch.multinomial(Q1, N_DRAWS, replacement=True, generator=g)
        x2 = torch.multinomial(Q2[x1], 1, generator=g).squeeze(1)
    drafts = torch.stack([x1, x2], 1)[:, :k]                                      # (N, k)
    rows = [L1.expand(N_DRAWS, V), L2[x1], L3[x2]][:k + 1]
    logits = torch.stack(rows, 1).reshape(-1, V)                                  # (N * (k+1), V)
    draft_probs = None if ngram else torch.stack([Q1.expand(N_DRAWS, V), Q2[x1]], 1)[:, :k].reshape(-1, V)
    meta = SamplingMetadata.from_lists([TEMPERATURE] * N_DRAWS, top_k=[TOP_K] * N_DRAWS, top_p=[TOP_P] * N_DRAWS)
    torch.manual_seed(k)
    out = RejectionSampler()(logits, draft_probs, SpecDecodeMetadata.from_lists(drafts.tolist()), meta)
    two = out[:, 1] != -1
    return out[:, 0], out[two, :2], q1


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit; cells expected under 5 draws are pooled; cells of mass 0 must be empty."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was emitted"
    exp = expected / expected.sum() * counts.sum()
    small = (exp < 5) & (expected > 0)
    obs = torch.cat([counts[exp >= 5], counts[small].sum().view(1)])
    exp = torch.cat([exp[exp >= 5], exp[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _p_values(k: int, ngram: bool) -> tuple[float, float]:
    """p-values of: the first token ~ the target's first distribution; and, where two tokens were
    emitted, (y1, y2) ~ P(x1 = y1 accepted) * target2(y2 | y1), with P(x1 = v accepted) =
    min(p1(v), q1(v)) up to normalisation."""
    first, pairs, q1 = _draws(k, ngram)
    p1 = _processed(L1)
    p_first = _chi_square_p(torch.bincount(first, minlength=V), p1)
    joint = torch.minimum(p1, q1)[:, None] * _processed(L2)                     # (V, V)
    pair_counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    return p_first, _chi_square_p(pair_counts, joint)


@pytest.mark.parametrize("ngram", [False, True], ids=["draft_probs", "ngram"])
@pytest.mark.parametrize("k", [1, 2])
def test_emitted_tokens_follow_the_target_distribution(k, ngram):
    p_first, p_second = _p_values(k, ngram)
    assert p_first > 0.01 and p_second > 0.01, (p_first, p_second)


def test_the_distribution_check_fails_a_sampler_that_recovers_from_the_target(monkeypatch):
    monkeypatch.setattr(rs, "residual_probs", lambda p, q: p)
    p_first, p_second = _p_values(2, ngram=False)
    assert p_first < 1e-6 and p_second < 1e-6, (p_first, p_second)


def test_the_distribution_check_fails_a_sampler_that_accepts_every_draft(monkeypatch):
    draw = rs.draw_random
    monkeypatch.setattr(rs, "draw_random", lambda *a: (draw(*a)[0], torch.zeros(a[0].draft_token_ids.shape[0])))
    p_first, p_second = _p_values(2, ngram=False)
    assert p_first < 1e-6 and p_second < 1e-6, (p_first, p_second)


def test_the_distribution_check_fails_a_coupled_sampler_that_reuses_one_race_row(monkeypatch):
    """Point-mass drafts take the coupled race, one race row per position: with one row for all
    of a request's positions, its tokens are correlated and the check sees it."""
    draw = rs.draw_position_noise

    def one_row(spec, meta, V, device):
        noise, states = draw(spec, meta, V, device)
        first = torch.repeat_interleave(spec.cu_num_draft_tokens - torch.tensor(spec.num_draft_tokens)
                                        + torch.arange(len(spec.num_draft_tokens)), spec.num_rows)
        return noise[first], states
    monkeypatch.setattr(rs, "draw_position_noise", one_row)
    p_first, p_second = _p_values(2, ngram=True)
    assert p_second < 1e-6, (p_first, p_second)


def test_a_seeded_request_with_point_mass_drafts_samples_the_plain_samplers_tokens():
    """Position by position, a seeded request's token is the plain sampler's draw from the same
    generator, whatever its drafts (right, wrong): after the step its generator stands where the
    plain sampler's stands after as many tokens, so the next step goes on from there."""
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(4, V, generator=g) * 2                   # the target's logits at positions 0..3
    kw = dict(top_k=[TOP_K], top_p=[TOP_P])
    plain_gen = torch.Generator().manual_seed(99)
    plain = [int(Sampler()(rows[j:j + 1], SamplingMetadata.from_lists([0.9], generators=[plain_gen], **kw))
                 .sampled_token_ids[0]) for j in range(4)]
    banned = int(rows[2].argsort()[0])                           # outside top-k: never the sample
    for drafts, emitted in (([plain[0], plain[1], banned], plain[:3]), ([plain[0], plain[1], plain[2]], plain)):
        gen = torch.Generator().manual_seed(99)
        meta = SamplingMetadata.from_lists([0.9], generators=[gen], **kw)
        sampler = RejectionSampler()
        out = RejectionSampler.parse_output(sampler(rows, None, SpecDecodeMetadata.from_lists([drafts]), meta))
        assert out == [emitted]
        rs.rewind_generators(sampler.generator_states, meta.generators, out)
        after = torch.Generator().manual_seed(99)
        for _ in range(len(emitted)):
            rs.draw_row_noise(torch.empty(V), after)
        assert torch.equal(gen.get_state(), after.get_state())
