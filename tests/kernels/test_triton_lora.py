"""The Triton LoRA shrink/expand against the torch version, on the CPU under TRITON_INTERPRET=1
(or compiled on CUDA): a fused three-slice layer and a plain one, tokens of several slots (one of
a lower rank) beside tokens without an adapter, which stay untouched."""
from __future__ import annotations

import os

import numpy as np
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.cpu.lora import lora_shrink_expand_ref, token_segments  # noqa: E402
from kernels.triton.lora import lora_shrink_expand  # noqa: E402
from paged_cases import DEVICE  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("sizes, dtype", [([24, 8, 8], torch.float32), ([40], torch.bfloat16)])
def test_triton_shrink_expand_matches_the_torch_version(sizes, dtype):
    g = torch.Generator().manual_seed(0)
    S, R, inp = 3, 8, 72
    out = sum(sizes)
    a = torch.randn(S, inp, len(sizes) * R, generator=g)
    b = torch.randn(S, R, out, generator=g)
    ranks = [8, 5, 0]
    for j in range(len(sizes)):                      # slot 1: a rank-5 adapter, zeros past it
        a[1, :, j * R + 5:(j + 1) * R] = 0
    b[1, 5:] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    slots = np.array([0, -1, 1, 1, 0, -1, 2, 0, 1, -1, 0])
    x = torch.randn(len(slots), inp, generator=g).to(dtype)
    y0 = torch.randn(len(slots), out, generator=g).to(dtype)
    ref = y0.clone()
    lora_shrink_expand_ref(ref, x, a, b, token_segments(slots), ranks, offsets)
    got = y0.clone().to(DEVICE)
    lora_shrink_expand(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), torch.from_numpy(slots).to(DEVICE),
                       torch.tensor(ranks, device=DEVICE), torch.tensor(offsets, device=DEVICE))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(got.cpu()[slots < 0], y0[slots < 0])
    assert not torch.allclose(got.cpu()[slots == 1].float(), y0[slots == 1].float())
