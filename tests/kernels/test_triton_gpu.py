"""GPU-only checks (``-m gpu``): every kernel compiled for CUDA in bfloat16 at model-sized shapes
against its torch reference, and a decode micro-benchmark printing tokens/s and achieved memory
bandwidth. Skipped without CUDA, or when the Triton interpreter is on in this process."""
from __future__ import annotations

import json
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.triton import interpreting  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1: kernels would not be compiled"),
]

BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)


def _case(reqs, block_size=16, heads=(32, 8), head_size=128, seed=0):
    from paged_cases import make_case
    return make_case(reqs, block_size, *heads, head_size, BF16, seed=seed)


def test_attention_kernels_bf16_on_cuda():
    from kernels.triton.kv_store import store_kv_cache, store_kv_cache_ref
    from kernels.triton.paged_decode import default_num_splits, paged_decode_attention, paged_decode_attention_ref
    from kernels.triton.paged_prefill import paged_attention_ref, paged_prefill_attention
    case = _case([(2000, 1), (0, 1), (517, 1), (63, 1), (1500, 300), (0, 129), (31, 1)], 16)
    m = case.meta
    ours, ref = case.kv_cache.clone(), case.kv_cache.clone()
    store_kv_cache(case.key, case.value, ours, m.slot_mapping)
    store_kv_cache_ref(case.key, case.value, ref, m.slot_mapping)
    assert torch.equal(ours, ref)
    args = (case.query, ours, m.query_start_loc, m.seq_lens, m.block_table)
    for window in (None, 256):
        torch.testing.assert_close(paged_prefill_attention(*args, m.max_query_len, 0.088, window).float(),
                                   paged_attention_ref(*args, 0.088, window).float(), **TOL)
    dec = _case([(2000, 1), (0, 1), (517, 1), (4095, 1)], 32, heads=(24, 8), seed=1)
    dm = dec.meta
    dargs = (dec.query, dec.kv_cache, dm.block_table, dm.seq_lens, 0.088)
    for splits in (1, default_num_splits(4, 8, dm.max_seq_len)):
        torch.testing.assert_close(paged_decode_attention(*dargs, None, splits).float(),
                                   paged_decode_attention_ref(*dargs).float(), **TOL)


def test_pointwise_kernels_bf16_on_cuda():
    from kernels.triton.rmsnorm import rms_norm, rms_norm_ref
    from kernels.triton.rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_rows
    from kernels.triton.sampling import sample, sample_ref
    from kernels.triton.silu_mul import silu_and_mul, silu_and_mul_ref
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", dtype=BF16, generator=g)
    r = torch.randn(37, 4096, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(4096, device="cuda", dtype=BF16, generator=g)
    out, residual = rms_norm(x, w, 1e-5, r)
    ref = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(residual, ref.residual)          # one bf16 add, rounded to nearest on both sides
    torch.testing.assert_close(out, ref.out, **TOL)
    q = torch.randn(37, 32, 128, device="cuda", dtype=BF16, generator=g)
    k = torch.randn(37, 8, 128, device="cuda", dtype=BF16, generator=g)
    cache = torch.randn(4096, 128, device="cuda", generator=g)
    pos = torch.randint(0, 4096, (37,), device="cuda", generator=g)
    for got, want in zip(rotary_embedding(pos, q, k, cache, inplace=False), rotary_embedding_ref(pos, q, k, cache)):
        torch.testing.assert_close(got, want, **TOL)
    rows = cache.to(BF16)[pos]                                   # (37, 128): cos | sin per token
    cos, sin = (torch.cat([rows[:, h], rows[:, h]], -1)[:, None] for h in (slice(0, 64), slice(64, 128)))
    q_rows, k_rows = q.clone(), k.clone()
    rotary_embedding_rows(q_rows, k_rows, cos, sin)              # the layers' layout, in place
    for got, want in zip((q_rows, k_rows), rotary_embedding(pos, q, k, cache.to(BF16), inplace=False)):
        assert torch.equal(got, want)
    gu = torch.randn(37, 2 * 11008, device="cuda", dtype=BF16, generator=g)
    torch.testing.assert_close(silu_and_mul(gu), silu_and_mul_ref(gu), **TOL)
    B, V = 16, 32000
    logits = torch.randn(B, V, device="cuda", generator=g) * 4
    temperature = torch.linspace(0, 1.5, B, device="cuda")
    top_k = torch.tensor([0, 50] * (B // 2), device="cuda")
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0] * (B // 4), device="cuda")
    noise = torch.empty(B, V, device="cuda").exponential_(generator=g)
    assert torch.equal(sample(logits, temperature, top_k, top_p, noise),
                       sample_ref(logits, temperature, top_k, top_p, noise))


def test_decode_throughput_benchmark():
    """Decode attention for 64 sequences of 4096 tokens (Llama-8B-like heads): prints tokens/s
    and the bandwidth achieved reading the KV cache; the last line is one JSON object."""
    from kernels.triton.paged_decode import default_num_splits, paged_decode_attention
    B, H, KVH, D, S, bs = 64, 32, 8, 128, 4096, 16
    pages = B * S // bs
    kv_cache = torch.randn(2, pages, bs, KVH, D, device="cuda", dtype=BF16)
    block_table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(B, S // bs)
    seq_lens = torch.full((B,), S, device="cuda", dtype=torch.int32)
    query = torch.randn(B, H, D, device="cuda", dtype=BF16)
    out = torch.empty_like(query)
    splits = default_num_splits(B, KVH, S)

    def step() -> None:
        paged_decode_attention(query, kv_cache, block_table, seq_lens, D ** -0.5, None, splits, out=out)

    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 50
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    kv_bytes = 2 * B * S * KVH * D * kv_cache.element_size()
    result = {"bench": "paged_decode", "batch": B, "context": S, "num_splits": splits,
              "ms_per_step": round(seconds * 1e3, 4), "tokens_per_s": round(B / seconds),
              "kv_gb_per_s": round(kv_bytes / seconds / 1e9, 1)}
    print(f"\ndecode attention: {result['tokens_per_s']} tok/s, {result['kv_gb_per_s']} GB/s of KV read")
    print(json.dumps(result))
    assert torch.isfinite(out).all()
