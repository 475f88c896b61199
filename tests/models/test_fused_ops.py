"""The fused float32 CPU kernels (kernels/cpu/fused.py) against the plain torch path they replace:
each op on odd shapes and strided views, then whole models with the fused path on and off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import CpuAttentionBackend, allocate_kv_caches
from kernels.cpu import fused
from kernels.cpu.native import available
from models.config import ArchConfig
from models.layers import RMSNorm, RotaryEmbedding, apply_rotary, apply_rotary_qk, silu_and_mul
from models.llama import LlamaForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from helpers import run_steps

pytestmark = pytest.mark.skipif(not available()[0], reason=f"native kernels unavailable: {available()[1]}")

TOL = dict(rtol=1e-6, atol=1e-6)   # float32 summation order and exp's last bit, nothing more


@pytest.fixture
def plain(monkeypatch):
    """Forces the plain torch path while active."""
    monkeypatch.setattr(fused, "ENABLED", False)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_supports():
    x = torch.zeros(3, 8)
    assert fused.supports(x, x[:, :4])
    assert not fused.supports(x.bfloat16())
    assert not fused.supports(x.t())                 # last dimension strided
    assert not fused.supports(x, x.double())


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("N,eps", [(576, 1e-5), (33, 1e-6), (64, 0.5)])
def test_rms_norm(T, N, eps, monkeypatch):
    g = _gen(T * N)
    norm = RMSNorm(N, eps, torch.float32)
    norm.weight.data.normal_(1.0, 0.3, generator=g)
    wide = torch.randn(T, N + 5, generator=g) * 3
    x = wide[:, 2:N + 2]                              # a column slice: row stride N + 5
    residual = torch.randn(T, N, generator=g)

    out, new_res = norm(x, residual.clone())
    alone = norm(x)
    with monkeypatch.context() as m:
        m.setattr(fused, "ENABLED", False)
        ref_out, ref_res = norm(x, residual.clone())
        ref_alone = norm(x)
    assert torch.equal(new_res, ref_res)               # the add is exact
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(alone, ref_alone, **TOL)
    torch.testing.assert_close(alone, F.rms_norm(x, (N,), norm.weight, eps), **TOL)


def test_rms_norm_updates_residual_in_place():
    norm = RMSNorm(16, 1e-6, torch.float32)
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    expected = residual + x
    _, returned = norm(x, residual)
    assert returned is residual and torch.equal(residual, expected)


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 2, 18), (2, 1, 128)])
def test_rotary_on_qkv_views(T, H, KVH, D):
    g = _gen(T + D)
    rope = RotaryEmbedding(D, 4096, 10000.0)
    cos, sin = rope(torch.randint(0, 4096, (T,), generator=g), torch.float32)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)   # row stride (H + 2 KVH) D
    ref_q, ref_k, v_before = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()

    out_q, out_k = apply_rotary_qk(q, k, cos, sin)
    assert out_q.data_ptr() == qkv.data_ptr()          # rotated in place, no copy
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)   # same roundings: bit for bit
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("T", [1, 300])
def test_a_partial_rotary_turns_the_leading_dims_in_place_and_passes_the_rest(T):
    """Phi-4-mini's: 48 of 64 dims of each head turn (half-split among them), bit for bit the
    plain path's slices; the other 16 are left as they were."""
    g = _gen(T)
    cos, sin = RotaryEmbedding(48, 4096, 10000.0)(torch.randint(0, 4096, (T,), generator=g), torch.float32)
    qkv = torch.randn(T, 7 * 64, generator=g)
    q, k, _ = qkv.split([4 * 64, 64, 2 * 64], dim=-1)
    q, k = q.view(T, 4, 64), k.view(T, 1, 64)
    before_q, before_k = q.clone(), k.clone()
    out_q, out_k = apply_rotary_qk(q, k, cos, sin)
    assert out_q.data_ptr() == qkv.data_ptr()
    assert torch.equal(out_q[..., :48], apply_rotary(before_q[..., :48], cos, sin))
    assert torch.equal(out_k[..., :48], apply_rotary(before_k[..., :48], cos, sin))
    assert torch.equal(out_q[..., 48:], before_q[..., 48:]) and torch.equal(out_k[..., 48:], before_k[..., 48:])
    plain_q, _ = apply_rotary_qk(before_q.clone(), before_k.clone(), cos, sin, custom_ops=False)
    assert torch.equal(plain_q, out_q)


def test_plain_rotary_returns_new_tensors(plain):
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = RotaryEmbedding(16, 64, 10000.0)(torch.arange(5), torch.float32)
    q0 = q.clone()
    out_q, _ = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(q, q0) and torch.equal(out_q, apply_rotary(q0, cos, sin))


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("I", [1536, 37])
def test_silu_and_mul(T, I, monkeypatch):
    g = _gen(T * I)
    gate_up = torch.randn(T, 2 * I + 3, generator=g)[:, :2 * I] * 6      # row stride 2I + 3
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -87.5, -1e-4, 0.0, 1e-4, 90.0, 200.0])
    out = silu_and_mul(gate_up)
    with monkeypatch.context() as m:
        m.setattr(fused, "ENABLED", False)
        ref = silu_and_mul(gate_up)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out, F.silu(gate_up[:, :I]) * gate_up[:, I:], **TOL)


def _exact_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    import math
    x = x.double()
    if act == "gelu":
        return x * 0.5 * (1 + torch.special.erf(x / math.sqrt(2)))
    if act == "gelu_tanh":
        return x * 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if act == "relu2":
        return F.relu(x) ** 2
    return F.silu(x) if act == "silu" else F.relu(x)


@pytest.mark.parametrize("act,tol", [("gelu", 1.5e-6), ("gelu_tanh", 1e-6), ("silu", 1e-6), ("relu", 0.0),
                                     ("relu2", 2e-5)])   # x * x rounded once: 6e-8 of x^2, up to 200 |x|
def test_native_activations_are_within_a_few_float32_steps_of_the_exact_values(act, tol):
    """Over [-12, 12] (and far out: +-200, where GELU is x or 0), alone and gating a second half;
    as close as torch's own CPU kernels (its erf GELU is within 1.2e-6), with a row stride."""
    x = torch.cat([torch.linspace(-12, 12, 240_000), torch.tensor([-200.0, -90.0, -1e-4, 0.0, 1e-4, 90.0, 200.0]),
                   torch.zeros(3)]).view(-1, 10)
    got = fused.activation(x, act)
    assert ((got.double() - _exact_activation(x, act)).abs() <= tol * x.abs().clamp(min=1)).all()
    wide = torch.cat([x, torch.randn(x.shape[0], 10) * 3, torch.zeros(x.shape[0], 5)], 1)[:, :20]   # stride 25
    gated = fused.gated_activation(wide, act)
    assert torch.equal(gated, fused.activation(x, act) * wide[:, 10:])
    plain = F.gelu(x, approximate="tanh" if act == "gelu_tanh" else "none") if act.startswith("gelu") else \
        (F.silu(x) if act == "silu" else F.relu(x) ** (2 if act == "relu2" else 1))
    torch.testing.assert_close(got, plain, rtol=0, atol=3e-6)


def test_other_dtypes_take_the_plain_path():
    norm = RMSNorm(32, 1e-6, torch.bfloat16)
    x, residual = torch.randn(3, 32, dtype=torch.bfloat16), torch.randn(3, 32, dtype=torch.bfloat16)
    out, new_res = norm(x, residual)
    assert new_res is not residual and torch.equal(new_res, residual + x)
    assert torch.equal(out, norm(residual + x))
    gu = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(silu_and_mul(gu), F.silu(gu[:, :8]) * gu[:, 8:])


# --- whole models -------------------------------------------------------------------------------

BLOCK_SIZE = 4


def _model(cls, **overrides):
    config = ArchConfig(architecture=cls.__name__, vocab_size=96, hidden_size=72, intermediate_size=100,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_size=18, max_model_len=256,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_ids=(), **overrides)
    model = cls(config, CpuAttentionBackend()).eval()
    g = _gen(1)
    for name, p in model.named_parameters():
        p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15, generator=g)
    return model, config


def _prefill_then_decode(model, config) -> torch.Tensor:
    """Logits of a 37- and a 5-token prompt prefilled together, then two decode steps of both."""
    caches = allocate_kv_caches(config, 64, BLOCK_SIZE, torch.float32)
    tables = [list(range(1, 12)), list(range(12, 20))]
    prompts = [torch.randint(0, 96, (37,), generator=_gen(2)), torch.randint(0, 96, (5,), generator=_gen(3))]
    steps = [prompts] + [[torch.tensor([7 + s]), torch.tensor([11 + s])] for s in range(2)]
    return run_steps(model, caches, tables, steps, BLOCK_SIZE)


@pytest.mark.parametrize("cls,overrides", [(LlamaForCausalLM, {}), (LlamaForCausalLM, {"qkv_bias": True}),
                                           (Qwen3ForCausalLM, {})], ids=["llama", "qkv_bias", "qwen3"])
def test_model_fused_equals_plain(cls, overrides, monkeypatch):
    model, config = _model(cls, **overrides)
    calls = {"rms_norm": 0, "rotary_": 0, "gated_activation": 0}
    for name in calls:
        def counted(*args, _f=getattr(fused, name), _n=name):
            calls[_n] += 1
            return _f(*args)
        monkeypatch.setattr(fused, name, counted)
    ours = _prefill_then_decode(model, config)
    assert all(calls.values()), f"the fused kernels did not all run: {calls}"
    monkeypatch.setattr(fused, "ENABLED", False)
    ref = _prefill_then_decode(model, config)
    assert ref.std() > 0.5, "reference logits too flat for the comparison to mean anything"
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
