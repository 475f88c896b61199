"""The torch custom ops wrapping the Triton launchers: fake (meta) implementations give the real
shapes and dtypes, torch.library.opcheck accepts the registrations, and the ops compute what
the launchers compute."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import kernels.triton.ops  # noqa: E402,F401  registers torch.ops.troupe.*
from kernels.triton.rmsnorm import rms_norm_ref  # noqa: E402
from paged_cases import DEVICE, assert_close, make_case  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)

ops = torch.ops.troupe


def _inputs():
    """One small set of real inputs for every op: (name, args)."""
    case = make_case([(5, 3), (17, 1)], 16, 6, 2, 16, torch.bfloat16)
    m = case.meta
    T = m.num_tokens
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, 24, generator=g).to(DEVICE)
    logits = torch.randn(2, 40, generator=g).to(DEVICE)
    codes = torch.randint(-127, 128, (16, 24), generator=g, dtype=torch.int8).to(DEVICE)
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (32 // 8, 16), generator=g, dtype=torch.int32).to(DEVICE)
    return case, {
        "store_kv_cache": (case.key, case.value, case.kv_cache.clone(), m.slot_mapping),
        "paged_decode_attention": (case.query[:2], case.kv_cache, m.block_table, m.seq_lens, 0.25, 8, 2),
        "paged_prefill_attention": (case.query, case.kv_cache, m.query_start_loc, m.seq_lens, m.block_table,
                                    m.max_query_len, 0.25, None),
        "rms_norm": (x, torch.ones(24, device=DEVICE), 1e-6),
        "fused_add_rms_norm": (x, x * 2, torch.ones(24, device=DEVICE), 1e-6),
        "rotary_embedding": (torch.arange(T, device=DEVICE), case.query.float(), case.key.float(),
                             torch.randn(32, 16, generator=g).to(DEVICE)),
        "rotary_embedding_": (torch.arange(T, device=DEVICE), case.query.float(), case.key.float(),
                              torch.randn(32, 8, generator=g).to(DEVICE)),
        "rotary_embedding_rows_": (case.query.float(), case.key.float(),
                                   *(torch.randn(T, 1, 16, generator=g).to(DEVICE) for _ in range(2))),
        "silu_and_mul": (x,),
        "sample": (logits, torch.tensor([0.0, 0.8], device=DEVICE), torch.tensor([0, 5], device=DEVICE),
                   torch.tensor([1.0, 0.9], device=DEVICE), torch.ones_like(logits)),
        "per_token_quant": (x, 1),
        "scaled_mm": (codes[:T], codes, torch.rand(T, device=DEVICE), torch.rand(16, device=DEVICE), 0,
                      torch.bfloat16, None, 2),
        "int4_linear": (x[:, :16].repeat(1, 2), packed, torch.full((1, 16), 8, dtype=torch.int8, device=DEVICE),
                        torch.full((1, 16), 0.01, dtype=torch.float16, device=DEVICE),
                        torch.zeros(32, dtype=torch.int32, device=DEVICE), 32, torch.float32, None),
    }


def test_fake_implementations_give_real_shapes_and_dtypes():
    _, inputs = _inputs()
    real = {name: getattr(ops, name)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            for name, args in inputs.items()}
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        for name, args in inputs.items():
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = getattr(ops, name)(*fake_args)
            expected = real[name]
            if expected is None:
                assert fake is None, name
                continue
            fakes = fake if isinstance(fake, (tuple, list)) else [fake]
            reals = expected if isinstance(expected, (tuple, list)) else [expected]
            assert [(f.shape, f.dtype) for f in fakes] == [(r.shape, r.dtype) for r in reals], name


@pytest.mark.parametrize("name", ["store_kv_cache", "paged_decode_attention", "paged_prefill_attention",
                                  "rms_norm", "fused_add_rms_norm", "rotary_embedding", "rotary_embedding_",
                                  "rotary_embedding_rows_", "silu_and_mul", "sample", "per_token_quant",
                                  "scaled_mm", "int4_linear"])
def test_opcheck(name):
    _, inputs = _inputs()
    torch.library.opcheck(getattr(ops, name).default, inputs[name])  # schema, autograd, fake, aot_dispatch


def test_torch_compile_traces_through_the_ops():
    def block(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(ops.silu_and_mul(gate_up) * 2, weight, 1e-6)

    gate_up = torch.randn(5, 48, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weight = torch.ones(24, device=DEVICE)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(gate_up, weight), block(gate_up, weight))


def test_ops_compute_what_the_launchers_compute():
    case, inputs = _inputs()
    x, weight, eps = inputs["rms_norm"]
    assert_close(ops.rms_norm(x, weight, eps), rms_norm_ref(x, weight, eps).out)
    out, residual = ops.fused_add_rms_norm(*inputs["fused_add_rms_norm"])
    ref = rms_norm_ref(x, weight, eps, x * 2)
    assert_close(out, ref.out)
    assert_close(residual, ref.residual)
    positions, q, k, cache = inputs["rotary_embedding_"]
    q_out, k_out = ops.rotary_embedding(positions, q, k, cache)
    assert ops.rotary_embedding_(positions, q, k, cache) is None
    assert torch.equal(q, q_out) and torch.equal(k, k_out)
    q, k, cos, sin = inputs["rotary_embedding_rows_"]
    q_rows, k_rows = q.clone(), k.clone()
    assert ops.rotary_embedding_rows_(q_rows, k_rows, cos, sin) is None
    from kernels.triton.rotary import rotary_embedding_rows
    want = rotary_embedding_rows(q, k, cos, sin, inplace=False)
    assert torch.equal(q_rows, want.query) and torch.equal(k_rows, want.key) and not torch.equal(q_rows, q)
    key, value, kv_cache, slots = inputs["store_kv_cache"]
    ops.store_kv_cache(key, value, kv_cache, slots)
    assert not torch.equal(kv_cache, case.kv_cache)
