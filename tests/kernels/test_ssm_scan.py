"""The native state-space recurrence (kernels/cpu/ssm.c) against models/mamba.py's torch
reference: Mamba's per-channel decays and Mamba-2's per-head ones in groups, a step mixing
prompt chunks and decodes, fresh and continued states in scattered slots."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import build_attention_metadata
from kernels.cpu import native, ssm
from models.config import MambaDims
from models.mamba import MambaMixer, StateSteps

pytestmark = pytest.mark.skipif(not native.available()[0], reason="the native CPU kernels are not built here")


@pytest.mark.parametrize("dims", [MambaDims(1, 24, 16, 4, dt_rank=5),
                                  MambaDims(2, 32, 16, 4, num_heads=4, head_dim=8, n_groups=2)],
                         ids=["mamba", "mamba2"])
def test_the_native_scan_gives_the_reference_outputs_and_states(dims, monkeypatch):
    torch.manual_seed(0)
    mixer = MambaMixer(16, dims, torch.float32)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.rand_like(p) * 2 - 0.5 if name == "A_log" else torch.randn_like(p) * 0.4)
    slots_n = 6
    conv = torch.randn(slots_n, *dims.conv_state_shape)
    state = torch.randn(slots_n, *dims.ssm_state_shape)
    # request 0 continues in slot 4, 1 starts fresh in slot 1 (its old state must not leak), 2 decodes in slot 5
    lens, starts, slots = [5, 70, 1], [9, 0, 30], [4, 1, 5]
    meta = build_attention_metadata(lens, [s + n for s, n in zip(starts, lens)],
                                    [[0] * 8 for _ in lens], 16, state_slots=slots)
    hidden = torch.randn(sum(lens), 16)

    def run(native_path: bool):
        if not native_path:
            monkeypatch.setattr(ssm, "supports", lambda *t: False)
        states = (conv.clone(), state.clone())
        with torch.inference_mode():
            out = mixer(hidden, states, StateSteps.of(meta))
        monkeypatch.undo()
        return out, states

    (y, (c1, s1)), (ref, (c2, s2)) = run(True), run(False)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=2e-5)
    assert torch.equal(c1, c2)
    assert torch.equal(s1[[0, 2, 3]], state[[0, 2, 3]])          # the slots no request holds are untouched
    decode = build_attention_metadata([1, 1], [80, 15], [[0] * 8] * 2, 16, state_slots=[1, 4])
    with torch.inference_mode():
        a = mixer(hidden[:2], (c1, s1), StateSteps.of(decode))
        monkeypatch.setattr(ssm, "supports", lambda *t: False)
        b = mixer(hidden[:2], (c2, s2), StateSteps.of(decode))
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=2e-5)


def test_the_native_delta_rule_gives_the_reference_outputs_and_states(monkeypatch):
    """Gated DeltaNet (Qwen3-Next): 4 value heads over 2 query/key heads, prompts and a decode."""
    from models.qwen3_next import GatedDeltaNet
    torch.manual_seed(0)
    dims = MambaDims(3, 24, 8, 4, num_heads=4, head_dim=6, n_groups=2, conv_bias=False)
    mixer = GatedDeltaNet(16, dims, 1e-6, torch.float32)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(torch.rand_like(p) * 2 - 0.5 if name in ("A_log", "dt_bias") else torch.randn_like(p) * 0.4)
    conv = torch.randn(6, *dims.conv_state_shape)
    state = torch.randn(6, *dims.ssm_state_shape)
    lens, starts, slots = [5, 70, 1], [9, 0, 30], [4, 1, 5]
    meta = build_attention_metadata(lens, [s + n for s, n in zip(starts, lens)], [[0] * 8 for _ in lens], 16,
                                    state_slots=slots)
    hidden = torch.randn(sum(lens), 16)
    decode = build_attention_metadata([1, 1], [80, 15], [[0] * 8] * 2, 16, state_slots=[1, 4])
    outs = []
    for native_path in (True, False):
        if not native_path:
            monkeypatch.setattr(ssm, "supports", lambda *t: False)
        states = (conv.clone(), state.clone())
        with torch.inference_mode():
            y = mixer(hidden, states, StateSteps.of(meta))
            y2 = mixer(hidden[:2], states, StateSteps.of(decode))
        outs.append((y, y2, states[1]))
    (y, y2, s1), (ref, ref2, s2) = outs
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y2, ref2, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=2e-5)
    assert torch.equal(s1[[0, 2, 3]], state[[0, 2, 3]])
