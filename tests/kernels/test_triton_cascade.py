"""Cascade attention's Triton kernels (kernels/triton/cascade.py) against their torch references,
the prefill kernel's log-sum-exps, and the Triton backend's cascade path against its plain path
and the slow reference: on the CPU under TRITON_INTERPRET=1."""
from __future__ import annotations

import dataclasses
import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from helpers import shared_prefix_metadata  # noqa: E402
from kernels.attention import reference_paged_attention  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.triton.cascade import (merge_attn_states, merge_attn_states_ref, prefix_attention,  # noqa: E402
                                    prefix_attention_ref)
from kernels.triton.paged_prefill import paged_attention_ref, paged_prefill_attention  # noqa: E402
from paged_cases import DEVICE, TOLERANCES, assert_close, meta_on  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)

D = 16
BS = 16
DECODE = [(0, 1), (3, 1), (17, 1), (40, 1), (1, 1), (9, 1), (0, 1), (25, 1)]
MIXED = [(0, 1), (5, 9), (0, 16), (30, 1), (12, 21), (2, 1), (0, 3), (20, 1)]


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _case(reqs, prefix_blocks, heads, dtype, kv_dtype=None, seed=0, num_padding=0):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = shared_prefix_metadata(reqs, prefix_blocks, BS, gen, num_padding)
    H, KVH = heads
    T = meta.num_tokens
    q, k, v = _randn(gen, T, H, D, dtype=dtype), _randn(gen, T, KVH, D, dtype=dtype), _randn(gen, T, KVH, D, dtype=dtype)
    cache = _randn(gen, 2, num_blocks, BS, KVH, D).to(kv_dtype or dtype)
    return meta_on(meta, DEVICE), q, k, v, cache


@pytest.fixture
def backend(monkeypatch) -> TritonAttentionBackend:
    monkeypatch.setattr(TritonAttentionBackend, "devices", ("cuda", "cpu"))
    return TritonAttentionBackend()


@pytest.mark.parametrize("dtype,heads", [(torch.float32, (4, 4)), (torch.float32, (6, 2)), (torch.bfloat16, (8, 1))])
def test_prefix_kernel_matches_its_reference(dtype, heads):
    meta, q, _, _, cache = _case(DECODE, 3, heads, dtype)
    blocks = meta.block_table[0, :3]
    out, lse = prefix_attention(q, cache, blocks, D ** -0.5)
    ref_out, ref_lse = prefix_attention_ref(q, cache, blocks, D ** -0.5)
    torch.testing.assert_close(out.cpu(), ref_out.cpu(), **TOLERANCES[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), **TOLERANCES[dtype])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_prefix_kernel_reads_an_fp8_cache_times_its_scales(kv_dtype):
    meta, q, _, _, cache = _case(MIXED, 2, (6, 2), torch.float32, kv_dtype, seed=1)
    ks, vs = torch.tensor(0.4, device=DEVICE), torch.tensor(1.7, device=DEVICE)
    blocks = meta.block_table[0, :2]
    out, lse = prefix_attention(q, cache, blocks, D ** -0.5, ks, vs)
    ref_out, ref_lse = prefix_attention_ref(q, cache, blocks, D ** -0.5, ks, vs)
    torch.testing.assert_close(out.cpu(), ref_out.cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=1e-4, rtol=1e-4)


def test_merge_kernel_matches_its_reference_and_weighs_an_empty_side_nothing():
    gen = torch.Generator().manual_seed(2)
    po, so = _randn(gen, 6, 4, D), _randn(gen, 6, 4, D, dtype=torch.bfloat16)
    pl, sl = _randn(gen, 6, 4) * 3, _randn(gen, 6, 4) * 3
    sl[0] = float("-inf")
    out = merge_attn_states(torch.empty(6, 4, D, device=DEVICE), po, pl, so, sl)
    assert_close(out, merge_attn_states_ref(po, pl, so, sl))
    torch.testing.assert_close(out[0].cpu(), po[0].cpu())


def test_prefill_kernel_returns_each_rows_log_sum_exp():
    gen = torch.Generator().manual_seed(3)
    meta, q, _, _, cache = _case(MIXED, 2, (6, 2), torch.float32, seed=3)
    B = meta.num_reqs
    lse = torch.empty(q.shape[0], q.shape[1], device=DEVICE)
    out = paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens[:B], meta.block_table[:B],
                                  meta.max_query_len, D ** -0.5, lse=lse)
    assert_close(out, paged_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens[:B], meta.block_table[:B],
                                          D ** -0.5))
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for b in range(B):                                  # logsumexp over the visible keys, per row and head
        for j, t in enumerate(range(qsl[b], qsl[b + 1])):
            p = lens[b] - (qsl[b + 1] - qsl[b]) + j     # the query's position
            pos = torch.arange(p + 1)
            pages = meta.block_table[b, pos // BS].long().cpu()
            k = cache[0].cpu()[pages, pos % BS].repeat_interleave(3, dim=1).float()    # (p + 1, H, D)
            s = torch.einsum("hd,phd->hp", q[t].cpu().float(), k) * D ** -0.5
            torch.testing.assert_close(lse[t].cpu(), torch.logsumexp(s, -1), atol=1e-4, rtol=1e-4)


CASES = [(DECODE, (4, 4), torch.float32, None), (MIXED, (6, 2), torch.float32, None),
         (DECODE, (6, 2), torch.bfloat16, None), (MIXED, (8, 1), torch.bfloat16, None),
         (DECODE, (6, 2), torch.float32, torch.float8_e4m3fn), (MIXED, (6, 2), torch.float32, torch.float8_e5m2)]


@pytest.mark.parametrize("reqs,heads,dtype,kv_dtype", CASES,
                         ids=["decode-f32", "mixed-f32-gqa", "decode-bf16", "mixed-bf16-mqa", "decode-fp8e4m3",
                              "mixed-fp8e5m2"])
def test_backend_cascade_equals_its_plain_path_and_the_reference(backend, reqs, heads, dtype, kv_dtype):
    meta, q, k, v, cache = _case(reqs, 4, heads, dtype, kv_dtype, seed=4, num_padding=2)
    ks = vs = None
    if kv_dtype is not None:
        ks, vs = torch.tensor(0.6, device=DEVICE), torch.tensor(1.3, device=DEVICE)
    plain_meta = dataclasses.replace(meta, common_prefix_len=0)
    c1, c2 = cache.clone(), cache.clone()
    out = backend.forward(q, k, v, c1, meta, D ** -0.5, k_scale=ks, v_scale=vs)
    plain = backend.forward(q, k, v, c2, plain_meta, D ** -0.5, k_scale=ks, v_scale=vs)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    assert (out[-2:] == 0).all()                         # padding rows
    tol = dict(atol=1e-4, rtol=1e-4) if kv_dtype is not None else TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), plain.float().cpu(), **tol)
    ref = reference_paged_attention(q.cpu(), k.cpu(), v.cpu(), cache.cpu().clone(), meta_on(meta, "cpu"),
                                    D ** -0.5, k_scale=None if ks is None else ks.cpu(),
                                    v_scale=None if vs is None else vs.cpu())
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **tol)
