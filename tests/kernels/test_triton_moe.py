"""The Triton fused MoE (grouped GEMM over blocks of pairs sorted by expert) against the torch
reference loop of models/moe.py, on the CPU under TRITON_INTERPRET=1 (or compiled on CUDA):
float32 and bfloat16, every expert held or only some (expert parallelism), and the block
alignment itself."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.triton.moe import fused_experts, moe_align_block_size  # noqa: E402
from models.moe import fused_experts_ref, select_experts  # noqa: E402
from paged_cases import DEVICE  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


@pytest.mark.parametrize("dtype, start, held, atol", [(torch.float32, 0, 6, 1e-5), (torch.bfloat16, 0, 6, 3e-2),
                                                      (torch.float32, 2, 3, 1e-5)])
def test_triton_fused_moe_matches_the_torch_reference_loop(dtype, start, held, atol):
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 11, 48, 40, 6, 2
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    weights, ids = select_experts(torch.randn(T, E, generator=g), k, renormalize=True)
    x, w13, w2 = x.to(dtype), w13[start:start + held].to(dtype), w2[start:start + held].to(dtype)
    want = fused_experts_ref(x, w13, w2, weights, ids, start).float()
    got = fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), start).float().cpu()
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, rtol=atol, atol=atol)


@pytest.mark.parametrize("dtype, start, held, atol", [(torch.float32, 0, 6, 1e-5), (torch.bfloat16, 2, 3, 5e-2)])
def test_triton_fused_moe_with_biases_and_swigluoai_matches_the_reference_loop(dtype, start, held, atol):
    from models.moe import ExpertActivation
    g = torch.Generator().manual_seed(2)
    T, H, I, E, k = 11, 48, 40, 6, 2
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.5, torch.randn(E, H, I, generator=g) * 0.2
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), k, renormalize=True)
    x, w13, w2 = x.to(dtype), w13[start:start + held].to(dtype), w2[start:start + held].to(dtype)
    b13, b2 = b13[start:start + held].contiguous(), b2[start:start + held].contiguous()
    act = ExpertActivation("swigluoai", 1.702, 3.0)
    want = fused_experts_ref(x, w13, w2, weights, ids, start, b13, b2, act).float()
    got = fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), start, b13.to(DEVICE), b2.to(DEVICE),
                        *act).float().cpu()
    assert (want - fused_experts_ref(x, w13, w2, weights, ids, start).float()).abs().max() > 0.5
    torch.testing.assert_close(got, want, rtol=atol, atol=atol)


def test_pairs_are_grouped_by_expert_in_blocks_padded_with_the_sentinel():
    ids = torch.tensor([[0, 2], [3, 2], [1, 0], [2, 3]])        # pairs 0..7; experts 1 and 2 held here
    sorted_ids, expert_ids, padded = moe_align_block_size(ids, 4, 2, expert_start=1)
    n = int(padded)
    assert n == 8 and sorted_ids[:n].tolist() == [4, 8, 8, 8, 1, 3, 6, 8]    # expert 1: pair 4; expert 2: 1, 3, 6
    assert expert_ids.tolist()[:2] == [0, 1] and set(expert_ids.tolist()[2:]) == {-1}
    assert len(sorted_ids) == 8 + 2 * 3


def test_the_moe_layer_routes_cuda_tensors_to_the_triton_kernel(monkeypatch):
    """FusedMoE on tensors the Triton ops take (CPU tensors under the interpreter stand for CUDA
    ones) runs the Triton kernel, with the reference loop's result."""
    import kernels.triton.moe as triton_moe
    from kernels.cpu import fused as cpu_fused
    from kernels.triton import fused as triton_fused
    from kernels.triton import interpreting
    from models.moe import FusedMoE
    if not interpreting():
        pytest.skip("runs the Triton kernel on CPU tensors")
    g = torch.Generator().manual_seed(1)
    layer = FusedMoE(32, 4, 2, 24, renormalize=False, dtype=torch.float32)
    for p in layer.parameters():
        p.data.normal_(0.0, 0.3, generator=g)
    x = torch.randn(5, 32, generator=g)
    monkeypatch.setattr(cpu_fused, "ENABLED", False)                    # not the native CPU kernel
    want = layer(x)                                                      # the torch reference loop
    calls = []
    real = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(triton_fused, "ON_CPU", True)
    got = layer(x)
    assert calls == [1] and want.abs().max() > 0.3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
