"""The Triton state-space recurrences (kernels/triton/ssm.py) against the mixers' torch references,
on the CPU under TRITON_INTERPRET=1 (or compiled on CUDA): Mamba's per-channel decays, Mamba-2's
per-head ones in groups, Gated DeltaNet's delta rule; a step of prompt chunks and a decode, fresh
and continued states in scattered slots."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.attention import build_attention_metadata  # noqa: E402
from kernels.cpu import ssm  # noqa: E402
from kernels.triton import fused as triton_fused  # noqa: E402
from models.config import MambaDims  # noqa: E402
from models.mamba import MambaMixer, StateSteps  # noqa: E402
from models.qwen3_next import GatedDeltaNet  # noqa: E402
from paged_cases import DEVICE  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)

DIMS = {"mamba": MambaDims(1, 24, 16, 4, dt_rank=5),
        "mamba2": MambaDims(2, 32, 16, 4, num_heads=4, head_dim=8, n_groups=2),
        "gated_deltanet": MambaDims(3, 24, 8, 4, num_heads=4, head_dim=6, n_groups=2, conv_bias=False)}


@pytest.mark.parametrize("kind", sorted(DIMS))
def test_triton_scan_gives_the_torch_references_outputs_and_states(kind, monkeypatch):
    torch.manual_seed(0)
    dims = DIMS[kind]
    mixer = GatedDeltaNet(16, dims, 1e-6, torch.float32) if kind == "gated_deltanet" else \
        MambaMixer(16, dims, torch.float32)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.rand_like(p) * 2 - 0.5 if name in ("A_log", "dt_bias") else torch.randn_like(p) * 0.4)
    mixer.to(DEVICE)
    conv = torch.randn(6, *dims.conv_state_shape, device=DEVICE)
    state = torch.randn(6, *dims.ssm_state_shape, device=DEVICE)
    lens, starts, slots = [5, 19, 1], [9, 0, 30], [4, 1, 5]
    meta = build_attention_metadata(lens, [s + n for s, n in zip(starts, lens)], [[0] * 8 for _ in lens], 16,
                                    state_slots=slots)
    decode = build_attention_metadata([1, 1], [25, 15], [[0] * 8] * 2, 16, state_slots=[1, 4])
    meta, decode = (_on_device(m) for m in (meta, decode))
    hidden = torch.randn(sum(lens), 16, device=DEVICE)
    monkeypatch.setattr(ssm, "supports", lambda *t: False)          # not the CPU's native kernels
    runs = []
    for triton_path in (True, False):
        monkeypatch.setattr(triton_fused, "ON_CPU", triton_path)
        monkeypatch.setattr(triton_fused, "ENABLED", triton_path)
        states = (conv.clone(), state.clone())
        with torch.inference_mode():
            runs.append((mixer(hidden, states, StateSteps.of(meta)),
                         mixer(hidden[:2], states, StateSteps.of(decode)), states[1]))
    (y, y2, s1), (ref, ref2, s2) = runs
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y2, ref2, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=2e-5)
    assert torch.equal(s1[[0, 2, 3]], state[[0, 2, 3]])


def _on_device(meta):
    import dataclasses
    return dataclasses.replace(meta, query_start_loc=meta.query_start_loc.to(DEVICE), seq_lens=meta.seq_lens.to(DEVICE),
                               state_slots=meta.state_slots.to(DEVICE))
