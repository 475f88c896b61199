"""Sampler distributions: chi-square tests over 20k draws from a fixed 10-token distribution.
The global RNG is seeded, so each test is deterministic; the p-value bound catches a wrong
distribution, the zero counts catch a leaky filter."""
from __future__ import annotations

import torch

from models.sampler import Sampler, SamplingMetadata

N = 20_000
PROBS = torch.tensor([0.02, 0.25, 0.05, 0.18, 0.01, 0.12, 0.08, 0.2, 0.04, 0.05])


def _counts(temperature: float = 1.0, seeded: bool = False, **params) -> torch.Tensor:
    logits = PROBS.log().expand(N, -1).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(N)] if seeded else None
    meta = SamplingMetadata.from_lists([temperature] * N, generators=gens,
                                       **{k: [v] * N for k, v in params.items()})
    torch.manual_seed(0)
    return torch.bincount(Sampler()(logits, meta).sampled_token_ids, minlength=len(PROBS)).double()


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Goodness of fit over the tokens with expected mass > 0; excluded tokens must not appear."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"excluded tokens drawn: {counts.tolist()}"
    obs, exp = counts[support], expected[support].double() / expected.sum() * counts.sum()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _keep(*tokens: int) -> torch.Tensor:
    return torch.where(torch.isin(torch.arange(len(PROBS)), torch.tensor(tokens)), PROBS, 0.0)


def test_the_chi_square_check_can_fail():
    assert _chi_square_p(_counts(), PROBS.flip(0) + 0.01) < 1e-6


def test_plain_sampling_follows_softmax_of_logits_over_temperature():
    assert _chi_square_p(_counts(), PROBS) > 1e-3
    for T in (0.5, 1.7):
        assert _chi_square_p(_counts(T), (PROBS.log() / T).softmax(0)) > 1e-3


def test_seeded_rows_follow_the_distribution_too():
    assert _chi_square_p(_counts(0.8, seeded=True), (PROBS.log() / 0.8).softmax(0)) > 1e-3


def test_top_k():
    assert _chi_square_p(_counts(top_k=3), _keep(1, 7, 3)) > 1e-3


def test_top_p():
    # descending 0.25, 0.2, 0.18, 0.12 reach 0.75 >= 0.7: the nucleus is {1, 7, 3, 5}
    assert _chi_square_p(_counts(top_p=0.7), _keep(1, 7, 3, 5)) > 1e-3


def test_min_p():
    # threshold 0.3 * 0.25 = 0.075 keeps {1, 7, 3, 5, 6}
    assert _chi_square_p(_counts(min_p=0.3), _keep(1, 7, 3, 5, 6)) > 1e-3


def test_top_k_with_top_p_and_temperature():
    # T = 2 flattens to p ~ sqrt(PROBS); top_k 6 keeps {1, 7, 3, 5, 6, 2 or 9 (tie)}... avoid the
    # tie with top_k 5: {1, 7, 3, 5, 6}; renormalized sqrt masses 0.227, 0.203, 0.192, 0.157, 0.128:
    # top_p 0.6 keeps {1, 7, 3} (0.622 >= 0.6 after three)
    flat = (PROBS.log() / 2).softmax(0)
    kept = torch.tensor([1, 7, 3, 5, 6])
    renorm = flat[kept] / flat[kept].sum()
    assert renorm.cumsum(0)[1] < 0.6 <= renorm.cumsum(0)[2]
    assert _chi_square_p(_counts(2.0, top_k=5, top_p=0.6), torch.where(
        torch.isin(torch.arange(10), torch.tensor([1, 7, 3])), flat, 0.0)) > 1e-3
