"""Cascade attention (kernels/attention/cascade.py) on the CPU backend: the same outputs as plain
attention for batches whose requests share their first blocks, native and torch paths, float32,
bfloat16 and fp8 caches; the common-prefix count and the on/off decision; the runner's metadata."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helpers import shared_prefix_metadata
from kernels.attention import CpuAttentionBackend, reference_paged_attention
from kernels.attention.cascade import (MIN_PREFIX_TOKENS, MIN_REQUESTS, cascade_prefix_len, common_prefix_len,
                                       merge_attn_states, use_cascade_attention)

D = 16
BS = 16
# (tokens after the shared prefix already cached, query length) per request
DECODE = [(0, 1), (3, 1), (17, 1), (40, 1), (1, 1), (9, 1), (0, 1), (64, 1), (25, 1)]
MIXED = [(0, 1), (5, 9), (0, 16), (30, 1), (12, 33), (2, 1), (47, 1), (0, 3), (20, 1)]


def shared_prefix_case(reqs, prefix_blocks: int, num_heads: int, num_kv_heads: int, seed: int = 0,
                       kv_dtype: torch.dtype = torch.float32, num_padding: int = 0):
    """Requests sharing their first ``prefix_blocks`` pages, a random cache, q/k/v for the step.
    -> (query, key, value, cache, meta with common_prefix_len set)."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = shared_prefix_metadata(reqs, prefix_blocks, BS, gen, num_padding)
    T = meta.num_tokens
    query = torch.randn(T, num_heads, D, generator=gen)
    key = torch.randn(T, num_kv_heads, D, generator=gen)
    value = torch.randn(T, num_kv_heads, D, generator=gen)
    cache = torch.randn(2, num_blocks, BS, num_kv_heads, D, generator=gen).to(kv_dtype)
    return query, key, value, cache, meta


def cascade_and_plain(case, native=True, dtype=torch.float32, sliding_window=None, k_scale=None, v_scale=None):
    query, key, value, cache, meta = case
    plain_meta = dataclasses.replace(meta, common_prefix_len=0)
    backend = CpuAttentionBackend(native)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    cascade = backend.forward(q, k, v, cache.clone(), meta, D ** -0.5, sliding_window, k_scale, v_scale)
    plain = backend.forward(q, k, v, cache.clone(), plain_meta, D ** -0.5, sliding_window, k_scale, v_scale)
    return cascade, plain


@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_cascade_equals_plain_attention_in_float32(reqs, native, num_heads, num_kv_heads):
    case = shared_prefix_case(reqs, prefix_blocks=5, num_heads=num_heads, num_kv_heads=num_kv_heads)
    cascade, plain = cascade_and_plain(case, native)
    torch.testing.assert_close(cascade, plain, atol=2e-5, rtol=2e-5)
    query, key, value, cache, meta = case
    ref = reference_paged_attention(query, key, value, cache.clone(), meta, D ** -0.5)
    torch.testing.assert_close(cascade, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_cascade_equals_plain_attention_in_bfloat16(reqs):
    case = shared_prefix_case(reqs, prefix_blocks=4, num_heads=6, num_kv_heads=2, seed=3, kv_dtype=torch.bfloat16)
    cascade, plain = cascade_and_plain(case, dtype=torch.bfloat16)
    assert cascade.dtype == torch.bfloat16
    torch.testing.assert_close(cascade.float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("reqs", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_cascade_equals_plain_attention_over_an_fp8_cache_with_scales(kv_dtype, reqs, native):
    case = shared_prefix_case(reqs, prefix_blocks=3, num_heads=6, num_kv_heads=2, seed=4, kv_dtype=kv_dtype)
    k_scale, v_scale = torch.tensor(0.37), torch.tensor(1.9)
    cascade, plain = cascade_and_plain(case, native, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(cascade, plain, atol=1e-4, rtol=1e-4)


def test_padding_rows_stay_zero_and_the_cache_is_written_as_plainly():
    query, key, value, cache, meta = shared_prefix_case(MIXED, 2, 6, 2, seed=5, num_padding=4)
    plain_meta = dataclasses.replace(meta, common_prefix_len=0)
    c1, c2 = cache.clone(), cache.clone()
    cascade = CpuAttentionBackend().forward(query, key, value, c1, meta, D ** -0.5)
    plain = CpuAttentionBackend().forward(query, key, value, c2, plain_meta, D ** -0.5)
    torch.testing.assert_close(cascade, plain, atol=2e-5, rtol=2e-5)
    assert (cascade[-4:] == 0).all()
    assert torch.equal(c1, c2)


def test_a_layer_with_a_sliding_window_ignores_the_shared_prefix():
    case = shared_prefix_case(DECODE, prefix_blocks=4, num_heads=4, num_kv_heads=2, seed=6)
    cascade, plain = cascade_and_plain(case, sliding_window=20)
    query, key, value, cache, meta = case
    ref = reference_paged_attention(query, key, value, cache.clone(), meta, D ** -0.5, sliding_window=20)
    torch.testing.assert_close(cascade, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cascade, plain, atol=0, rtol=0)


def test_merging_two_halves_by_log_sum_exp_gives_attention_over_the_whole():
    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(5, 3, 8, generator=gen), torch.randn(12, 3, 8, generator=gen), torch.randn(12, 3, 8, generator=gen)
    s = torch.einsum("nhd,khd->nhk", q, k)                                    # (N, H, K)

    def part(sl):
        return torch.einsum("nhk,khd->nhd", s[..., sl].softmax(-1), v[sl]), torch.logsumexp(s[..., sl], -1)

    merged = merge_attn_states(*part(slice(0, 7)), *part(slice(7, 12)))
    torch.testing.assert_close(merged, torch.einsum("nhk,khd->nhd", s.softmax(-1), v), atol=1e-6, rtol=1e-5)
    empty_lse = torch.full((5, 3), float("-inf"))
    torch.testing.assert_close(merge_attn_states(*part(slice(0, 12)), torch.zeros(5, 3, 8), empty_lse),
                               part(slice(0, 12))[0])


# -- the common prefix and the decision -------------------------------------------------------

def test_common_prefix_counts_identical_leading_blocks_capped_by_the_fewest_computed_tokens():
    table = np.array([[4, 5, 6, 9, 0], [4, 5, 6, 7, 8], [4, 5, 6, 7, 3]], dtype=np.int32)
    num_blocks = np.array([4, 5, 5])
    assert common_prefix_len(table, num_blocks, np.array([60, 70, 80]), 16) == 48      # blocks 4, 5, 6
    assert common_prefix_len(table, num_blocks, np.array([60, 40, 80]), 16) == 32      # request 1 computed 40
    assert common_prefix_len(table, num_blocks, np.array([60, 15, 80]), 16) == 0
    assert common_prefix_len(table[:1], num_blocks[:1], np.array([60]), 16) == 0        # one request
    table[2, 0] = 1
    assert common_prefix_len(table, num_blocks, np.array([60, 70, 80]), 16) == 0
    # padding columns past a request's blocks (zeros everywhere) never count as shared
    pad = np.array([[2, 0, 0], [2, 0, 0]], dtype=np.int32)
    assert common_prefix_len(pad, np.array([1, 1]), np.array([100, 100]), 16) == 16


def test_cascade_is_used_for_many_decodes_over_a_long_shared_prefix_and_not_otherwise():
    decodes = np.ones(MIN_REQUESTS, dtype=np.int64)
    assert use_cascade_attention(256, decodes, 9, 3)
    assert use_cascade_attention(2048, np.ones(64, dtype=np.int64), 32, 8)
    assert not use_cascade_attention(MIN_PREFIX_TOKENS - 16, decodes, 9, 3)        # prefix too short
    assert not use_cascade_attention(4096, decodes[:MIN_REQUESTS - 1], 9, 3)       # too few requests
    assert not use_cascade_attention(4096, decodes, 9, 3, sliding_window=512)
    assert not use_cascade_attention(512, np.full(8, 512), 9, 3)                   # long prompt chunks fill their tiles
    assert use_cascade_attention(512, np.array([1] * 12 + [40]), 9, 3)             # decodes beside a chunk


def test_the_runner_hint_is_the_shared_prefix_only_when_the_decision_takes_it():
    B, P = 8, 320
    table = np.tile(np.arange(1, 1 + P // BS + 2, dtype=np.int32), (B, 1))        # (B, 22)
    table[:, -2:] = np.arange(100, 100 + 2 * B).reshape(B, 2)                       # own blocks
    num_blocks = np.full(B, table.shape[1])
    computed = np.full(B, P + 20)
    assert cascade_prefix_len(table, num_blocks, computed, np.ones(B), BS, 9, 3) == P
    assert cascade_prefix_len(table[:7], num_blocks[:7], computed[:7], np.ones(7), BS, 9, 3) == 0
    assert cascade_prefix_len(table, num_blocks, computed, np.ones(B), BS, 9, 3, sliding_window=64) == 0


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_cascade_path_reads_the_prefix_once_through_the_first_requests_blocks(native):
    """The prefix is read from request 0's table only: a request whose table (against the
    promise) points elsewhere for the prefix gets request 0's prefix, which proves the path ran."""
    query, key, value, cache, meta = shared_prefix_case(DECODE, 2, 4, 2, seed=8)
    moved = meta.block_table.clone()
    moved[1, 0] = 0                                         # block 0: none of the requests' blocks
    lying = dataclasses.replace(meta, block_table=moved)
    out = CpuAttentionBackend(native).forward(query, key, value, cache.clone(), lying, D ** -0.5)
    honest = CpuAttentionBackend(native).forward(query, key, value, cache.clone(), meta, D ** -0.5)
    torch.testing.assert_close(out, honest, atol=2e-5, rtol=2e-5)
    plain = CpuAttentionBackend(native).forward(query, key, value, cache.clone(),
                                                dataclasses.replace(lying, common_prefix_len=0), D ** -0.5)
    assert not torch.allclose(plain[1], honest[1])


def test_a_backend_may_ask_for_a_longer_shared_prefix():
    decodes = np.ones(16, dtype=np.int64)
    assert use_cascade_attention(512, decodes, 9, 3)
    assert not use_cascade_attention(512, decodes, 9, 3, min_prefix=CpuAttentionBackend.cascade_min_prefix)
    assert use_cascade_attention(2048, decodes, 9, 3, min_prefix=CpuAttentionBackend.cascade_min_prefix)


def test_disable_cascade_attn_reaches_the_model_config():
    import argparse

    from actors.engine.args import EngineArgs
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args(["--disable-cascade-attn"])).disable_cascade_attn
    assert not EngineArgs.from_cli_args(p.parse_args([])).disable_cascade_attn
