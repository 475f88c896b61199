"""The rejection-sampling kernel against its per-request reference and the vectorised torch path
(models/rejection_sampler.py): the same probabilities and random numbers give the same tokens.
On the CPU under TRITON_INTERPRET=1, or compiled on CUDA when a GPU is present."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.triton.rejection_sample import rejection_sample, rejection_sample_ref  # noqa: E402
from models.rejection_sampler import rejection_sample as rejection_sample_torch  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] != "0" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


def _case(num_drafts: list[int], V: int, *, seed: int, with_draft_probs: bool, greedy: list[bool],
          accept_bias: float = 0.7, sharpness: float = 2.0) -> tuple:
    """Random probabilities, with drafts biased towards the target's likely tokens so that walks
    run past a few positions and every branch (accept, reject, bonus) is taken."""
    g = torch.Generator().manual_seed(seed)
    B, N = len(num_drafts), sum(num_drafts)
    T = N + B
    target = (torch.randn(T, V, generator=g) * sharpness).softmax(-1)
    target[torch.rand(T, V, generator=g) < 0.2] = 0.0                        # truncated tokens
    target[torch.arange(T), target.argmax(-1)] += 0.1                         # keep every row non-empty
    target /= target.sum(-1, keepdim=True)
    argmax = target.argmax(-1)
    cu = torch.tensor(num_drafts, dtype=torch.int64).cumsum(0)
    req = torch.repeat_interleave(torch.arange(B), torch.tensor(num_drafts), output_size=N)
    row = torch.arange(N) + req
    likely = torch.multinomial(target[row], 1, generator=g).squeeze(1) if N else argmax[:0]
    drafts = torch.where(torch.rand(N, generator=g) < accept_bias, likely, torch.randint(V, (N,), generator=g))
    draft_probs = (torch.randn(N, V, generator=g) * 2).softmax(-1) if with_draft_probs else None
    uniforms = torch.rand(N, generator=g)
    noise = -torch.rand(B, V, generator=g).log()
    args = (drafts, cu, max(num_drafts, default=0), draft_probs, target, argmax,
            torch.tensor(greedy), uniforms, noise)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def _all_three(args: tuple) -> torch.Tensor:
    ref = rejection_sample_ref(*args)
    assert torch.equal(rejection_sample(*args), ref)
    assert torch.equal(rejection_sample_torch(*args), ref)
    return ref


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
@pytest.mark.parametrize("V", [37, 1500])   # one block, then several blocks of the vocabulary
def test_kernel_equals_reference_and_torch_path_on_mixed_batches(with_draft_probs, V):
    num_drafts = [3, 0, 5, 1, 4, 0, 2, 5]
    greedy = [False, True, False, True, False, False, True, False]
    for seed in range(3):
        out = _all_three(_case(num_drafts, V, seed=seed, with_draft_probs=with_draft_probs, greedy=greedy))
        emitted = (out != -1).sum(1)
        assert (emitted >= 1).all() and (emitted <= torch.tensor(num_drafts, device=out.device) + 1).all()


def test_walks_cover_rejections_and_bonus_tokens():
    """The cases above are not vacuous: some rows stop early, some take the bonus."""
    num_drafts = [4] * 16
    out = _all_three(_case(num_drafts, 64, seed=5, with_draft_probs=False, greedy=[False] * 16,
                           accept_bias=0.9, sharpness=6.0))
    emitted = (out != -1).sum(1)
    assert (emitted == 5).any() and (emitted < 5).any()


def test_all_requests_without_drafts_draw_from_their_bonus_rows():
    args = _case([0, 0, 0], 50, seed=1, with_draft_probs=True, greedy=[False, True, False])
    out = _all_three(args)
    assert out.shape == (3, 1)
    target, argmax, noise = args[4], args[5], args[8]
    assert out[1, 0] == argmax[1]
    assert torch.equal(out[[0, 2], 0], (target[[0, 2]] / noise[[0, 2]]).argmax(-1))


def test_all_zero_residual_falls_back_to_the_target():
    """q = 2p rejects half the time, and max(0, p - q) is all zero: the draw comes from p."""
    args = list(_case([1] * 8, 20, seed=2, with_draft_probs=True, greedy=[False] * 8))
    target = args[4]
    args[3] = (target[torch.arange(8) + torch.arange(8)] * 2).contiguous()   # each request's draft row
    args[7] = torch.full((8,), 0.75, device=DEVICE)                           # u = 0.75 > p/q = 0.5
    out = _all_three(tuple(args))
    stop_rows = torch.arange(8, device=DEVICE) * 2
    assert torch.equal(out[:, 0], (target[stop_rows] / args[8]).argmax(-1))
    assert (out[:, 1] == -1).all()


def test_launcher_names_the_wrong_argument():
    args = list(_case([2, 1], 16, seed=0, with_draft_probs=True, greedy=[False, False]))
    args[7] = args[7].double()
    with pytest.raises(ValueError, match="uniforms"):
        rejection_sample(*args)
    args = list(_case([2, 1], 16, seed=0, with_draft_probs=True, greedy=[False, False]))
    args[3] = args[3][:, :8]
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(*args)


@pytest.mark.skipif(DEVICE != "cpu", reason="routes CPU tensors through the interpreter")
@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "ngram"])
def test_rejection_sampler_draws_the_same_tokens_through_the_kernel(monkeypatch, with_draft_probs):
    """The whole sampler, seeded rows and the global RNG alike: the Triton path (CPU tensors under
    the interpreter) against the torch path."""
    from kernels.triton import fused
    from models.rejection_sampler import RejectionSampler, SpecDecodeMetadata
    from models.sampler import SamplingMetadata

    g = torch.Generator().manual_seed(9)
    num_drafts = [3, 0, 4, 2, 5, 1]
    spec = SpecDecodeMetadata.from_lists([torch.randint(40, (k,), generator=g).tolist() for k in num_drafts])
    logits = torch.randn(sum(num_drafts) + 6, 40, generator=g) * 3
    draft_probs = torch.randn(sum(num_drafts), 40, generator=g).softmax(-1) if with_draft_probs else None

    def run(on_kernel: bool) -> torch.Tensor:
        monkeypatch.setattr(fused, "ON_CPU", on_kernel)
        torch.manual_seed(0)
        gens = [torch.Generator().manual_seed(s) if s else None for s in (0, 3, 0, 4, 0, 5)]
        meta = SamplingMetadata.from_lists([0.0, 0.8, 1.0, 0.0, 1.2, 0.7], generators=gens,
                                           top_k=[0, 10, 0, 0, 20, 5], top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.95])
        return RejectionSampler()(logits, draft_probs, spec, meta)

    assert torch.equal(run(True), run(False))
