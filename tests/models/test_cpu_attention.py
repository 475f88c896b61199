"""CpuAttentionBackend against the slow reference on random paged caches."""
from __future__ import annotations

import pytest
import torch

from helpers import shuffled_paged_metadata
from kernels.attention import CpuAttentionBackend, build_attention_metadata, reference_paged_attention

HEAD_SIZE = 16
# Each scenario: one (cached context length, query length) per request.
SCENARIOS = {
    "pure_decode": [(0, 1), (16, 1), (39, 1), (4, 1), (70, 1)],
    "pure_prefill": [(0, 7), (0, 33), (0, 16)],
    "chunked_prefill": [(20, 13), (48, 5), (32, 32)],
    "mixed": [(0, 9), (30, 1), (15, 1), (7, 6), (64, 1)],
}


def _run_case(reqs, block_size, num_heads, num_kv_heads, num_padding=0, seed=0, sliding_window=None,
              kv_dtype=torch.float32, native=True, logits_soft_cap=None, sinks=None, alibi_slopes=None):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = shuffled_paged_metadata(reqs, block_size, gen, num_padding)
    T = meta.num_tokens
    query = torch.randn(T, num_heads, HEAD_SIZE, generator=gen)
    key = torch.randn(T, num_kv_heads, HEAD_SIZE, generator=gen)
    value = torch.randn(T, num_kv_heads, HEAD_SIZE, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_SIZE, generator=gen).to(kv_dtype)  # the cached prefix
    ours_cache, ref_cache = cache.clone(), cache.clone()
    scale = HEAD_SIZE ** -0.5
    cap = {} if logits_soft_cap is None else {"logits_soft_cap": logits_soft_cap}
    if sinks is not None:
        cap["sinks"] = sinks
    if alibi_slopes is not None:
        cap["alibi_slopes"] = alibi_slopes
    ours = CpuAttentionBackend(native).forward(query, key, value, ours_cache, meta, scale, sliding_window=sliding_window,
                                               **cap)
    ref = reference_paged_attention(query, key, value, ref_cache, meta, scale, sliding_window=sliding_window, **cap)
    return ours, ref, ours_cache, ref_cache, cache, meta


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_backend_matches_reference(scenario, block_size, num_heads, num_kv_heads):
    ours, ref, ours_cache, ref_cache, _, _ = _run_case(SCENARIOS[scenario], block_size, num_heads, num_kv_heads)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize("scenario", ["pure_decode", "mixed"])
def test_padding_slots_are_not_written(scenario):
    ours, ref, ours_cache, ref_cache, before, meta = _run_case(SCENARIOS[scenario], 16, 9, 3, num_padding=5, seed=1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache, ref_cache, atol=0, rtol=0)
    n_real = int(meta.query_start_loc[-1])
    assert (ours[n_real:] == 0).all()
    written = torch.zeros(ours_cache.shape[1] * ours_cache.shape[2], dtype=torch.bool)
    written[meta.slot_mapping[:n_real]] = True
    flat_before = before.view(2, -1, 3, HEAD_SIZE)
    flat_after = ours_cache.view(2, -1, 3, HEAD_SIZE)
    assert torch.equal(flat_after[:, ~written], flat_before[:, ~written])  # block 0 (padding's target) included
    assert not torch.equal(flat_after[:, written], flat_before[:, written])


def test_decode_sees_only_its_own_context():
    """Changing a cache entry beyond a request's seq_len, or in another request's block,
    must not change its output."""
    reqs = [(10, 1), (20, 1)]
    ours, _, cache, _, _, meta = _run_case(reqs, 16, 4, 2, seed=2)
    other_block = int(meta.block_table[1, 0])
    tail_slot = 12  # position 12 > seq_len 11 of request 0, same first block
    cache2 = cache.clone()
    cache2[:, other_block] += 100.0
    cache2[:, int(meta.block_table[0, 0]), tail_slot] += 100.0
    q = torch.randn(2, 4, HEAD_SIZE)
    k = torch.randn(2, 2, HEAD_SIZE)
    v = torch.randn(2, 2, HEAD_SIZE)
    out1 = CpuAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.25)
    out2 = CpuAttentionBackend().forward(q, k, v, cache2, meta, 0.25)
    torch.testing.assert_close(out1[0], out2[0])
    assert not torch.allclose(out1[1], out2[1])


# ---- sliding window: key k visible from query p iff p - W < k <= p -----------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_matches_reference(scenario, block_size, window):
    ours, ref, ours_cache, ref_cache, _, _ = _run_case(SCENARIOS[scenario], block_size, 6, 2, num_padding=3,
                                                       seed=3, sliding_window=window)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache, ref_cache, atol=0, rtol=0)


def test_sliding_window_wider_than_context_is_full_attention():
    reqs = SCENARIOS["mixed"]
    full, *_ = _run_case(reqs, 16, 4, 2, seed=4)
    wide, *_ = _run_case(reqs, 16, 4, 2, seed=4, sliding_window=1000)
    torch.testing.assert_close(wide, full, atol=1e-6, rtol=1e-6)


def test_reference_window_semantics():
    """One request, one query at position p = 9, W = 3: only keys 7, 8, 9 count. Values are
    one-hot positions and all scores equal, so the output is the mean of the visible one-hots."""
    S, D, W = 10, 16, 3
    meta = build_attention_metadata([1], [S], [[1]], 16)
    cache = torch.zeros(2, 2, 16, 1, D)
    cache[1, 1, :S, 0, :S] = torch.eye(S)
    q, k, v = torch.zeros(1, 1, D), torch.zeros(1, 1, D), torch.zeros(1, 1, D)
    v[0, 0, S - 1] = 1.0
    for attend in (reference_paged_attention, CpuAttentionBackend().forward):
        out = attend(q, k, v, cache.clone(), meta, 1.0, sliding_window=W)
        expected = torch.zeros(D)
        expected[S - W:S] = 1.0 / W
        torch.testing.assert_close(out[0, 0], expected)


def test_decode_ignores_keys_outside_the_window():
    """Keys at positions <= p - W (here whole blocks far behind) must not change a decode."""
    reqs = [(70, 1), (33, 1)]
    W = 8
    _, _, cache, _, _, meta = _run_case(reqs, 4, 4, 2, seed=5, sliding_window=W)
    cache2 = cache.clone()
    for i, (ctx, _) in enumerate(reqs):
        for pos in range(ctx + 1 - W):                     # everything before the window
            block = int(meta.block_table[i, pos // 4])
            cache2[:, block, pos % 4] += 100.0
    q, k, v = torch.randn(2, 4, HEAD_SIZE), torch.randn(2, 2, HEAD_SIZE), torch.randn(2, 2, HEAD_SIZE)
    out1 = CpuAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.25, sliding_window=W)
    out2 = CpuAttentionBackend().forward(q, k, v, cache2, meta, 0.25, sliding_window=W)
    torch.testing.assert_close(out1, out2)
    out3 = CpuAttentionBackend().forward(q, k, v, cache2.clone(), meta, 0.25)
    assert not torch.allclose(out1, out3)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_attention_sinks_match_the_reference_and_matter(scenario, window, native):
    """gpt-oss's sinks (one more softmax term per head, with no value) on every path: decodes,
    fresh prompts, chunks after cached context, with and without a window, padding rows zero."""
    sinks = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0])
    ours, ref, ours_cache, ref_cache, _, meta = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=5,
                                                          sliding_window=window, native=native, sinks=sinks)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache, ref_cache, atol=0, rtol=0)
    assert torch.equal(ours[-3:], torch.zeros_like(ours[-3:]))
    plain, *_ = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=5, sliding_window=window, native=native)
    # a sink only takes weight away: each head's output shrinks, the larger the sink the more
    ratio = ours[:-3].norm(dim=-1) / plain[:-3].norm(dim=-1)                   # (N, H)
    assert (ratio < 1).all() and (ratio[:, -1] < ratio[:, 0]).all()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "fp8"])
def test_alibi_matches_the_reference_and_matters(scenario, window, kv_dtype):
    """ALiBi's biases (each score + slope * (key position - query position)) on every path."""
    from models.layers import alibi_slopes
    slopes = alibi_slopes(6)
    ours, ref, ours_cache, ref_cache, _, _ = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=7,
                                                       sliding_window=window, kv_dtype=kv_dtype, alibi_slopes=slopes)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache.float(), ref_cache.float(), atol=0, rtol=0)
    assert torch.equal(ours[-3:], torch.zeros_like(ours[-3:]))
    plain, *_ = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=7, sliding_window=window,
                          kv_dtype=kv_dtype)
    assert (ours - plain).abs().max() > 1e-2


def test_alibi_slopes_are_blooms():
    """transformers' BLOOM slopes, for a power of two and for the heads past one."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from models.layers import alibi_slopes
    for heads in (8, 12, 6):
        theirs = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32).view(heads, 2)[:, 1]   # slope * 1
        torch.testing.assert_close(alibi_slopes(heads), theirs, atol=1e-7, rtol=1e-6)


# ---- backend selection ---------------------------------------------------------------------

@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["f32", "bf16", "fp8"])
def test_logit_softcapping_matches_the_reference_and_matters(scenario, window, kv_dtype):
    """Gemma 2's capped scores (C * tanh(s / C)) on every path: decodes, prompts, chunks after
    cached context, with and without a window, over 32-bit, 16-bit and fp8 caches."""
    ours, ref, ours_cache, ref_cache, _, _ = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=4,
                                                       sliding_window=window, kv_dtype=kv_dtype, logits_soft_cap=0.5)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_cache.float(), ref_cache.float(), atol=0, rtol=0)
    uncapped, *_ = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=3, seed=4, sliding_window=window,
                             kv_dtype=kv_dtype)
    assert (ours - uncapped).abs().max() > 1e-2


def test_selection_names_every_refusal():
    from kernels.attention.base import AttentionRequirements
    from kernels.attention.selector import BACKENDS, select_backend
    ok = AttentionRequirements(torch.float32, torch.float32, 64, 16, sliding_window=512, device="cpu")
    assert isinstance(select_backend(ok), CpuAttentionBackend)
    impossible = AttentionRequirements(torch.float64, torch.float64, 64, 16, sliding_window=None, device="tpu")
    with pytest.raises(ValueError, match="no attention backend") as info:
        select_backend(impossible)
    for name in BACKENDS:
        assert f"{name}:" in str(info.value)
    assert "cpu: runs on cpu, not tpu" in str(info.value)
    capped = AttentionRequirements(torch.bfloat16, torch.bfloat16, 64, 16, sliding_window=None, device="cuda",
                                   logits_soft_cap=True)
    assert select_backend(capped, ["triton"]).supports_logits_soft_cap       # both backends cap scores


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("gqa", [1, 3])
def test_native_decode_matches_the_gather_path_and_the_reference(window, gqa):
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    torch.manual_seed(gqa)
    B, KVH, D, BS = 7, 2, 32, 16
    H = KVH * gqa
    lens = [1, 15, 16, 17, 60, 3, 33]
    blocks = (torch.randperm(40)[:sum(-(-n // BS) for n in lens)] + 1).tolist()
    tables, i = [], 0
    for n in lens:
        k = -(-n // BS)
        tables.append(blocks[i:i + k])
        i += k
    meta = build_attention_metadata([1] * B, lens, tables, BS)
    cache = torch.randn(2, 41, BS, KVH, D)
    q, k, v = torch.randn(B, H, D), torch.randn(B, KVH, D), torch.randn(B, KVH, D)
    native = CpuAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.2, window)
    gather = CpuAttentionBackend(native=False).forward(q, k, v, cache.clone(), meta, 0.2, window)
    ref = reference_paged_attention(q, k, v, cache.clone(), meta, 0.2, sliding_window=window)
    assert torch.allclose(native, ref, atol=2e-6) and torch.allclose(gather, ref, atol=2e-6)


# ---- the native flag, and the torch paths it leaves -------------------------------------------

def test_the_native_flag_is_decided_once_at_construction(monkeypatch):
    """``native`` becomes "asked for and available()" in __init__; forward never probes again nor
    changes it, and a CPU without the kernels gets the torch paths from its first step."""
    import kernels.attention.cpu as cpu_mod
    real = cpu_mod.available()
    _run_case(SCENARIOS["mixed"], 16, 6, 2)             # the module's once-per-process kernel lookups done
    probes = []
    monkeypatch.setattr(cpu_mod, "available", lambda: probes.append(1) or real)
    asked, declined = CpuAttentionBackend(), CpuAttentionBackend(native=False)
    assert (asked.native, declined.native, len(probes)) == (real[0], False, 1)
    gen = torch.Generator().manual_seed(7)
    for reqs in SCENARIOS.values():
        meta, num_blocks = shuffled_paged_metadata(reqs, 16, gen, num_padding=2)
        T = meta.num_tokens
        q, k, v = torch.randn(T, 6, HEAD_SIZE), torch.randn(T, 2, HEAD_SIZE), torch.randn(T, 2, HEAD_SIZE)
        cache = torch.randn(2, num_blocks, 16, 2, HEAD_SIZE)
        for backend in (asked, declined):
            for window in (None, 5):
                backend.forward(q, k, v, cache.clone(), meta, 0.25, window)
    assert (asked.native, declined.native, len(probes)) == (real[0], False, 1)

    monkeypatch.setattr(cpu_mod, "available", lambda: (False, "no kernels on this CPU"))
    unavailable = CpuAttentionBackend()
    assert unavailable.native is False
    reqs = SCENARIOS["mixed"]
    meta, num_blocks = shuffled_paged_metadata(reqs, 16, gen)
    T = meta.num_tokens
    q, k, v = torch.randn(T, 6, HEAD_SIZE), torch.randn(T, 2, HEAD_SIZE), torch.randn(T, 2, HEAD_SIZE)
    cache = torch.randn(2, num_blocks, 16, 2, HEAD_SIZE)
    assert torch.equal(unavailable.forward(q, k, v, cache.clone(), meta, 0.25),
                       declined.forward(q, k, v, cache.clone(), meta, 0.25))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_padding", [0, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_torch_paths_match_the_reference(scenario, window, num_padding, kv_dtype):
    """native=False: decodes by the batched attend, fresh prompts by SDPA per request, chunks after
    cached context by SDPA per request (by the batched attend with a window), padding rows zero."""
    ours, ref, ours_cache, ref_cache, _, meta = _run_case(SCENARIOS[scenario], 16, 6, 2, num_padding=num_padding,
                                                          seed=11, sliding_window=window, kv_dtype=kv_dtype,
                                                          native=False)
    assert torch.equal(ours_cache, ref_cache)
    tol = 1e-5 if kv_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    assert (ours[int(meta.query_start_loc[-1]):] == 0).all()


# ---- the native kernel alone, against a float64 reference ---------------------------------------

def _native_case(lens, H, KVH, D, BS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BS) for n in lens]
    N = sum(counts) + 2
    perm = (torch.randperm(N - 1, generator=gen) + 1).tolist()  # shuffled blocks, 0 unused
    table = torch.zeros(len(lens), max(max(counts), 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        table[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    cache = torch.randn(2, N, BS, KVH, D, generator=gen)
    q = torch.randn(len(lens), H, D, generator=gen) * 2                   # peaky softmaxes too
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def _reference_decode(q, cache, table, lens, scale, window=None):
    B, H, D = q.shape
    BS, KVH = cache.shape[2], cache.shape[3]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n)
        blocks = table[b, pos // BS].long()
        k = cache[0, blocks, pos % BS].double().repeat_interleave(H // KVH, 1).transpose(0, 1)  # (H, n, D)
        v = cache[1, blocks, pos % BS].double().repeat_interleave(H // KVH, 1).transpose(0, 1)
        s = torch.einsum("hd,hnd->hn", q[b].double(), k) * scale
        if window is not None:
            s[:, pos <= n - 1 - window] = float("-inf")
        out[b] = torch.einsum("hn,hnd->hd", s.softmax(-1), v)
    return out


def _with_omp_threads(n):
    """Run the native kernels with n OpenMP threads (so a 2-core machine also takes the split
    path of many chunks), restoring the count after."""
    import contextlib
    import ctypes

    from kernels.cpu.native import library
    lib = library()
    try:
        get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
    except AttributeError:
        return contextlib.nullcontext()
    put.argtypes = [ctypes.c_int]

    @contextlib.contextmanager
    def ctx():
        before = get()
        put(n)
        try:
            yield
        finally:
            put(before)
    return ctx()


NATIVE_LENS = {
    "odd": [1, 2, 15, 17, 31, 33, 47, 95, 130, 7],
    "block_edges": [16, 32, 48, 64, 160, 15, 17],
    "long_batch1": [1000],                    # cut into chunks merged by log-sum-exp
    "long_and_short": [700, 3, 1, 257],
}


@pytest.mark.parametrize("lens", sorted(NATIVE_LENS))
@pytest.mark.parametrize("H,KVH", [(4, 4), (9, 3), (8, 1), (12, 2), (5, 1)])   # GQA 1, 3, 8, 6, 5
@pytest.mark.parametrize("window", [None, 1, 9, 16, 100])
def test_native_decode_kernel(lens, H, KVH, window):
    from kernels.cpu.native import available, paged_decode
    if not available()[0]:
        pytest.skip(available()[1])
    q, cache, table, lt = _native_case(NATIVE_LENS[lens], H, KVH, 64, 16, seed=H * 7 + KVH)
    ref = _reference_decode(q, cache, table, lt, 0.125, window)
    for threads in (1, 2, 5):
        with _with_omp_threads(threads):
            out = paged_decode(q, cache, table, lt, 0.125, window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D", [16, 20, 24, 48, 64, 128, 256])   # 20: the portable tile; 24: AVX2 only
@pytest.mark.parametrize("BS", [1, 5, 16, 32])
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_kernel_shapes(D, BS, window):
    from kernels.cpu.native import available, paged_decode
    if not available()[0]:
        pytest.skip(available()[1])
    lens = [1, 5, 16, 33, 300, 64]
    q, cache, table, lt = _native_case(lens, 6, 2, D, BS, seed=D + BS)
    ref = _reference_decode(q, cache, table, lt, D ** -0.5, window)
    for threads in (1, 3):
        with _with_omp_threads(threads):
            out = paged_decode(q, cache, table, lt, D ** -0.5, window)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_native_decode_ignores_positions_past_seq_len():
    from kernels.cpu.native import available, paged_decode
    if not available()[0]:
        pytest.skip(available()[1])
    q, cache, table, lt = _native_case([21, 300], 9, 3, 64, 16, seed=9)
    out = paged_decode(q, cache, table, lt, 0.125)
    cache2 = cache.clone()
    cache2[:, int(table[0, 1]), 5:] = 1e4                 # request 0's block 1 past position 20
    cache2[:, int(table[1, 18]), 12:] = float("nan")      # request 1's last block past position 299
    with _with_omp_threads(4):
        torch.testing.assert_close(paged_decode(q, cache2, table, lt, 0.125), out, atol=1e-6, rtol=1e-6)


# ---- a 16-bit KV cache (--kv-cache-dtype float16 / bfloat16) ---------------------------------------

@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [20, 24, 64, 128])                          # 20: the portable tile; 24: AVX2 only
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_reads_a_16_bit_cache_exactly_as_its_float32_widening(kv_dtype, D, window):
    from kernels.cpu.native import available, paged_decode
    if not available()[0]:
        pytest.skip(available()[1])
    q, cache, table, lt = _native_case([1, 17, 300, 64, 1000], 9, 3, D, 16, seed=D)
    half = cache.to(kv_dtype)
    for threads in (1, 3):
        with _with_omp_threads(threads):
            out = paged_decode(q, half, table, lt, D ** -0.5, window)
            assert torch.equal(out, paged_decode(q, half.float(), table, lt, D ** -0.5, window))
    ref = _reference_decode(q, half.float(), table, lt, D ** -0.5, window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_kv_store_into_a_16_bit_cache_rounds_as_torch_does(kv_dtype):
    import kernels.attention.cpu as cpu_mod
    T, KVH, D = 9, 2, 48
    qkv = torch.randn(T, (4 + 2 * KVH) * D) * 3
    specials = torch.tensor([0.0, -0.0, 1e-8, -6e-6, 65504.0, 65520.0, 1e6, float("inf"), float("-inf"),
                             float("nan"), 1.0009765625, 1.00048828125, 3.0517578125e-05])
    qkv[2, 4 * D:4 * D + len(specials)] = specials                      # token 2's first key row
    k = qkv[:, 4 * D:(4 + KVH) * D].view(T, KVH, D)
    v = qkv[:, (4 + KVH) * D:].view(T, KVH, D)
    slots = torch.tensor([5, -1, 0, 17, 31, -1, 8, 30, 2])
    got = torch.zeros(2, 4, 8, KVH, D, dtype=kv_dtype)
    cpu_mod.write_kv_cache(k, v, got, slots)
    ref = torch.zeros(2, 4, 8, KVH, D, dtype=kv_dtype)
    keep = slots >= 0
    ref.view(2, 32, KVH, D)[0][slots[keep]] = k[keep].to(kv_dtype)
    ref.view(2, 32, KVH, D)[1][slots[keep]] = v[keep].to(kv_dtype)
    assert torch.equal(got.isnan(), ref.isnan())                         # NaN stays NaN (any payload)
    assert torch.equal(got.nan_to_num().view(torch.int16), ref.nan_to_num().view(torch.int16))  # bit for bit


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 24])
def test_backend_with_a_16_bit_cache_matches_the_reference(kv_dtype, scenario, window):
    """Every path (native decode, fresh prompts, chunks after cached context, the batched torch
    path with a window) reads the rounded cache; fresh prompts attend to the step's own float32
    keys, hence the tolerance of one 16-bit rounding."""
    ours, ref, ours_cache, ref_cache, _, _ = _run_case(SCENARIOS[scenario], 16, 6, 2, seed=3,
                                                       sliding_window=window, kv_dtype=kv_dtype)
    assert ours.dtype == torch.float32
    assert torch.equal(ours_cache, ref_cache)
    tol = 2e-3 if kv_dtype == torch.float16 else 2e-2
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


# ---- the native causal prefill kernel (fresh prompts, no cached context) -------------------------

def _fused_qkv(T, H, KVH, D, gen):
    """q (T, H, D), k and v (T, KVH, D) as strided views into one fused projection output."""
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen) * 1.5
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
    return q, k, v


def _reference_causal(q, k, v, scale):
    """float64 causal attention of one request, q (L, H, D), k/v (L, KVH, D) -> (L, H, D)."""
    L, H, _ = q.shape
    G = H // k.shape[1]
    kk = k.double().repeat_interleave(G, 1).transpose(0, 1)                 # (H, L, D)
    vv = v.double().repeat_interleave(G, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale             # (H, L, L)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ vv).transpose(0, 1)


def _packed(lens: list[int], first: int) -> tuple[list[int], int]:
    """Requests of ``lens`` rows back to back from row ``first``: their first rows, and the row after."""
    starts = []
    for n in lens:
        starts.append(first)
        first += n
    return starts, first


@pytest.mark.parametrize("H,KVH", [(4, 4), (9, 3), (8, 1), (16, 2)])     # GQA 1, 3, 8, 8
@pytest.mark.parametrize("D", [20, 24, 32, 48, 64, 128])                 # 20: the portable path; 24: AVX2 only
def test_native_causal_prefill_kernel(H, KVH, D):
    from kernels.attention.cpu import causal_prefill
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(H * 131 + KVH * 7 + D)
    lens = [1, 15, 16, 17, 100, 300, 33]
    starts, a = _packed(lens, 3)            # rows 0..2 and the tail belong to no request
    T = a + 4
    q, k, v = _fused_qkv(T, H, KVH, D, gen)
    scale = D ** -0.5
    for threads in (1, 3):
        out = torch.full((T, H, D), 7.0)
        with _with_omp_threads(threads):
            assert causal_prefill(q, k, v, out, torch.tensor(starts), torch.tensor(lens), scale)
        for s, n in zip(starts, lens):
            torch.testing.assert_close(out[s:s + n].double(), _reference_causal(q[s:s + n], k[s:s + n], v[s:s + n], scale),
                                       atol=1e-5, rtol=1e-5)
        assert (out[:3] == 7).all() and (out[a:] == 7).all()


@pytest.mark.parametrize("H,KVH", [(4, 4), (12, 12), (8, 1)])
@pytest.mark.parametrize("D", [20, 24, 32, 64, 128])                      # 20: the portable path; 24: AVX2 only
@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 40])
def test_native_bidirectional_prefill_kernel(H, KVH, D, window):
    """An encoder's attention (``bidirectional``): every query of a prompt sees all of the
    prompt's keys (with a ``window`` W, those fewer than W positions away on either side), prompts
    on and off the 16-position tiles, against the float64 reference; rows of no request untouched,
    and cached context refused."""
    from kernels.attention.cpu import causal_prefill
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(H * 29 + KVH * 5 + D)
    lens = [1, 15, 16, 17, 100, 33]
    starts, a = _packed(lens, 2)
    T = a + 3
    q, k, v = _fused_qkv(T, H, KVH, D, gen)
    scale = D ** -0.5
    G = H // KVH
    for threads in (1, 3):
        out = torch.full((T, H, D), 7.0)
        with _with_omp_threads(threads):
            assert causal_prefill(q, k, v, out, torch.tensor(starts), torch.tensor(lens), scale, bidirectional=True,
                                  window=window)
        for s, n in zip(starts, lens):
            kk, vv = (t[s:s + n].double().repeat_interleave(G, 1).transpose(0, 1) for t in (k, v))
            scores = q[s:s + n].double().transpose(0, 1) @ kk.transpose(1, 2) * scale
            if window is not None:
                pos = torch.arange(n)
                scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() >= window, float("-inf"))
            ref = (scores.softmax(-1) @ vv).transpose(0, 1)
            torch.testing.assert_close(out[s:s + n].double(), ref, atol=1e-5, rtol=1e-5)
        assert (out[:2] == 7).all() and (out[a:] == 7).all()
    assert not causal_prefill(q, k, v, out, torch.tensor(starts[:1]), torch.tensor(lens[:1]), scale,
                              torch.tensor(starts[:1]), torch.tensor([4]), bidirectional=True)


@pytest.mark.parametrize("H,KVH", [(12, 12), (8, 2)])
@pytest.mark.parametrize("D", [16, 32, 64, 96, 128])                     # 16: not a multiple of 32, float32
@pytest.mark.parametrize("window", [None, 5, 17])
def test_bfloat16_bidirectional_prefill_multiplies_bfloat16_values_with_float32_sums(H, KVH, D, window):
    """``bfloat16=True`` (an encoder under the CPU's --dtype bfloat16): where the CPU has AVX512-BF16
    and D is a multiple of 32, the queries (scaled), keys, values and the softmax's numerators are
    rounded to bfloat16 and everything else stays float32: the float64 reference of those rounded
    values with float32 softmax: each output within the bound that rounding each probability to
    bfloat16 allows (2^-9 of it, relative, taken twice over: the kernel rounds them tile by tile
    against a running maximum, so no reference rounds the same ones), with the queries, keys and
    values as bfloat16; elsewhere the float32 kernel's own result, bit for bit."""
    from kernels.attention.cpu import causal_prefill
    from kernels.cpu.native import available
    from kernels.cpu.panels import bf16_available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(H * 31 + KVH * 3 + D)
    lens = [1, 2, 15, 16, 17, 100, 33]
    starts, a = _packed(lens, 2)
    T = a + 3
    q, k, v = _fused_qkv(T, H, KVH, D, gen)
    scale = D ** -0.5
    G = H // KVH
    out = torch.full((T, H, D), 7.0)
    assert causal_prefill(q, k, v, out, torch.tensor(starts), torch.tensor(lens), scale, bidirectional=True,
                          window=window, bfloat16=True)
    assert (out[:2] == 7).all() and (out[a:] == 7).all()
    plain = torch.full((T, H, D), 7.0)
    assert causal_prefill(q, k, v, plain, torch.tensor(starts), torch.tensor(lens), scale, bidirectional=True,
                          window=window)
    if not (bf16_available() and D % 32 == 0):
        assert torch.equal(out, plain)
        return
    assert (out - plain).abs().max() > 1e-4            # bfloat16 products, not float32 ones
    bf = lambda t: t.to(torch.bfloat16).double()                             # noqa: E731
    for s, n in zip(starts, lens):
        kk, vv = (bf(t[s:s + n]).repeat_interleave(G, 1).transpose(0, 1) for t in (k, v))
        scores = bf(q[s:s + n] * scale).transpose(0, 1) @ kk.transpose(1, 2)
        if window is not None:
            pos = torch.arange(n)
            scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() >= window, float("-inf"))
        p = scores.softmax(-1)
        ref, bound = (p @ vv).transpose(0, 1), (p @ vv.abs()).transpose(0, 1) * 2.0 ** -8 + 1e-5
        assert ((out[s:s + n].double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("H,KVH", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("D", [20, 24, 64, 128])                          # 20: the portable path; 24: AVX2 only
def test_native_prefill_of_chunks_after_cached_context(H, KVH, D):
    """Queries that are the last lens[i] of ctx[i] + lens[i] positions (keys rows kstarts[i]..),
    context lengths on and off the 16-position tiles, against the float64 reference."""
    from kernels.attention.cpu import causal_prefill
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(H * 17 + KVH + D)
    cases = [(0, 5), (3, 1), (16, 16), (17, 40), (100, 3), (31, 33), (250, 70)]    # (ctx, lens)
    starts, kstarts, a, b = [], [], 2, 1
    for c, n in cases:
        starts.append(a)
        kstarts.append(b)
        a, b = a + n, b + c + n
    T, S = a + 3, b + 2
    q = torch.randn(T, H, D, generator=gen) * 1.5
    kv = torch.randn(2, S, KVH, D, generator=gen) * 1.5
    scale = D ** -0.5
    for threads in (1, 3):
        out = torch.full((T, H, D), 7.0)
        with _with_omp_threads(threads):
            assert causal_prefill(q, kv[0], kv[1], out, torch.tensor(starts), torch.tensor([n for _, n in cases]),
                                  scale, torch.tensor(kstarts), torch.tensor([c for c, _ in cases]))
        for (c, n), s, ks in zip(cases, starts, kstarts):
            k, v = kv[0, ks:ks + c + n].double(), kv[1, ks:ks + c + n].double()
            G = H // KVH
            sc = q[s:s + n].double().transpose(0, 1) @ k.repeat_interleave(G, 1).permute(1, 2, 0) * scale
            hidden = torch.arange(c + n)[None, :] > torch.arange(c, c + n)[:, None]     # (n, c + n)
            ref = (sc.masked_fill(hidden, float("-inf")).softmax(-1) @ v.repeat_interleave(G, 1).transpose(0, 1))
            torch.testing.assert_close(out[s:s + n].double(), ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert (out[:2] == 7).all() and (out[a:] == 7).all()


@pytest.mark.parametrize("D", [64, 40])
def test_native_causal_prefill_long(D):
    from kernels.attention.cpu import causal_prefill
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(D)
    lens = [4096, 5, 250]
    q, k, v = _fused_qkv(sum(lens), 2, 1, D, gen)
    out = torch.zeros(q.shape)
    starts = [0, 4096, 4101]
    assert causal_prefill(q, k, v, out, torch.tensor(starts), torch.tensor(lens), 0.3)
    from kernels.attention.cpu_torch import causal_self_attention
    for s, n in zip(starts, lens):
        ref = _reference_causal(q[s:s + n], k[s:s + n], v[s:s + n], 0.3)
        # 4096 keys: float32 rounding reaches ~1e-5 (SDPA's own error is as large); no worse than SDPA
        sdpa_err = (causal_self_attention(q[s:s + n], k[s:s + n], v[s:s + n], 0.3).double() - ref).abs().max()
        assert (out[s:s + n].double() - ref).abs().max() <= max(1.5 * sdpa_err, 1e-5)


@pytest.mark.parametrize("H,KVH", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("D", [64, 128])
def test_backend_native_prefill_in_mixed_batches(H, KVH, D):
    """Decode rows, fresh prompts of odd lengths and a chunk after cached context in one step, with
    q/k/v strided views of a fused projection: the native path agrees with SDPA's and the reference."""
    from kernels.attention.cpu_torch import causal_self_attention
    from kernels.cpu.native import available
    if not available()[0]:
        pytest.skip(available()[1])
    gen = torch.Generator().manual_seed(H + D)
    reqs = [(0, 1), (0, 15), (40, 1), (0, 16), (0, 17), (20, 13), (0, 100), (9, 1), (0, 300)]  # (context, query)
    BS = 16
    meta, N = shuffled_paged_metadata(reqs, BS, gen, num_padding=3, spare_blocks=2)
    q, k, v = _fused_qkv(meta.num_tokens, H, KVH, D, gen)
    cache = torch.randn(2, N, BS, KVH, D, generator=gen)
    scale = D ** -0.5
    native = CpuAttentionBackend().forward(q, k, v, cache.clone(), meta, scale)
    sdpa = CpuAttentionBackend(native=False).forward(q, k, v, cache.clone(), meta, scale)
    ref = reference_paged_attention(q, k, v, cache.clone(), meta, scale)
    torch.testing.assert_close(native, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native, sdpa, atol=1e-5, rtol=1e-5)
    a = 0
    for c, n in reqs:                        # the fresh prompts' rows against SDPA per request
        if c == 0 and n > 1:
            torch.testing.assert_close(native[a:a + n], causal_self_attention(q[a:a + n], k[a:a + n], v[a:a + n], scale),
                                       atol=1e-5, rtol=1e-5)
        a += n
    assert (native[a:] == 0).all()


def test_native_kv_store_equals_index_copy_and_refuses_slots_past_the_cache():
    import kernels.attention.cpu as cpu_mod
    qkv = torch.randn(7, (4 + 2 * 2) * 16)                      # fused projection rows
    k = qkv[:, 64:96].view(7, 2, 16)
    v = qkv[:, 96:].view(7, 2, 16)
    slots = torch.tensor([5, -1, 0, 17, 31, -1, 8])
    ref = torch.zeros(2, 4, 8, 2, 16)
    flat = ref.view(2, 32, 2, 16)
    keep = slots >= 0
    flat[0][slots[keep]] = k[keep]
    flat[1][slots[keep]] = v[keep]
    got = torch.zeros(2, 4, 8, 2, 16)
    cpu_mod.write_kv_cache(k, v, got, slots)
    assert torch.equal(got, ref)
    with pytest.raises(IndexError, match="past the KV cache"):
        cpu_mod.write_kv_cache(k, v, got, torch.tensor([1, 2, 32, 0, 0, 0, 0]))


# ---- an fp8 KV cache (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): stored fp8(x / scale), read fp8 * scale --

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_id(dtype):
    return str(dtype).removeprefix("torch.float8_")


def _fp8_values(dtype, n=1 << 16, seed=0):
    """Random float32 values over every binade of the format (subnormals, around 1, near the
    largest finite value), exact ties between neighbours, and the edges: zeros, the largest
    finite value and just past it, the smallest subnormal and half of it."""
    import math

    from kernels.attention.fp8 import FP8_MAX
    mx = FP8_MAX[dtype]
    gen = torch.Generator().manual_seed(seed)
    tiny = 2.0 ** (-9 if dtype == torch.float8_e4m3fn else -16)         # the smallest subnormal
    mags = torch.exp2(torch.empty(n).uniform_(math.log2(tiny / 4), math.log2(mx), generator=gen))
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = codes[codes.isfinite() & (codes >= 0)].sort().values
    ties = (finite[1:] + finite[:-1]) / 2                                  # round half to even
    edges = torch.tensor([0.0, -0.0, mx, -mx, tiny, -tiny, tiny / 2, tiny * 1.5, tiny / 2 * 1.0001])
    return torch.cat([mags * signs, ties, -ties, finite, -finite, edges])


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
@pytest.mark.parametrize("scale", [1.0, 0.0371, 3.5])
def test_fp8_kv_store_rounds_bit_for_bit_as_torch_does(dtype, scale):
    """kv_store (the AVX-512 16-lane rows and the scalar tail) stores fp8(x / scale) with exactly
    torch's bytes for every value torch keeps finite (subnormals, ties to even, values near the
    largest), over many random values and every tie between neighbouring codes."""
    import kernels.attention.cpu as cpu_mod
    from kernels.attention.fp8 import quantize_kv
    x = _fp8_values(dtype) * scale
    D = 24                                                   # rows of 24: one 16-lane vector and 8 scalars
    x = torch.cat([x, torch.zeros(-len(x) % D)])
    T = len(x) // D
    k = x.view(T, 1, D)
    v = -x.flip(0).view(T, 1, D)
    got = torch.zeros(2, T, 1, 1, D, dtype=dtype)
    s = torch.tensor(scale)
    cpu_mod.write_kv_cache(k, v, got, torch.arange(T), s, s)
    want = torch.stack([quantize_kv(k, dtype, s), quantize_kv(v, dtype, s)]).view(2, T, 1, 1, D)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    plain = (x / scale).to(dtype)                            # torch's own .to(), where it is finite
    kept = plain.float().isfinite()
    assert kept.float().mean() > 0.99
    assert torch.equal(got[0].reshape(-1)[kept].view(torch.uint8), plain[kept].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
def test_fp8_kv_store_saturates_at_the_largest_finite_value(dtype):
    """Past the largest finite value (torch's e5m2 rounds to inf there) the byte is the largest
    finite one, infinities included; NaN stays NaN; the torch fallback path does the same."""
    import kernels.attention.cpu as cpu_mod
    from kernels.attention.fp8 import FP8_MAX
    mx = FP8_MAX[dtype]
    row = torch.tensor([mx * 1.07, -mx * 1.2, 1e30, float("inf"), float("-inf"), float("nan"), mx, -mx] * 2)
    for native in (True, False):
        got = torch.zeros(2, 1, 1, 1, 16, dtype=dtype)
        k = row.view(1, 1, 16)
        if native:
            cpu_mod.write_kv_cache(k, k, got, torch.tensor([0]))
        else:                                                # a strided key: the torch path
            wide = torch.stack([k, k], -1)[..., 0]
            cpu_mod.write_kv_cache(wide, wide, got, torch.tensor([0]))
        vals = got[0].float().view(-1)
        assert torch.equal(vals[[0, 2, 3, 6]], torch.full((4,), mx))
        assert torch.equal(vals[[1, 4, 7]], torch.full((3,), -mx))
        assert vals[5].isnan()


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
def test_fp8_cache_bytes_are_read_back_exactly(dtype):
    """kv_gather (the gather for chunks after cached context) reads every one of the 256 bytes as
    torch's float32 value times the scale, the same float32 product."""
    from kernels.attention.cpu import _kv_gather_kernel
    from kernels.cpu.native import KV_TYPES, available
    if not available()[0]:
        pytest.skip(available()[1])
    cache = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8).view(dtype).view(2, 16, 16)
    slots = torch.tensor([3, 0, 15, 7, 7])
    k, v = torch.empty(5, 16), torch.empty(5, 16)
    ks, vs = torch.tensor(0.37), torch.tensor(2.5)
    assert _kv_gather_kernel()(cache.data_ptr(), KV_TYPES[dtype], 16, 16, slots.data_ptr(), 5, ks.data_ptr(),
                               vs.data_ptr(), k.data_ptr(), v.data_ptr()) == -1
    for got, half, s in ((k, cache[0], ks), (v, cache[1], vs)):
        want = half[slots].float() * s
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


def _fp8_cache(cache, dtype, scale):
    """cache (float32 values) stored as fp8 with ``scale``."""
    from kernels.attention.fp8 import quantize_kv
    return torch.stack([quantize_kv(cache[0], dtype, scale[0]), quantize_kv(cache[1], dtype, scale[1])])


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
@pytest.mark.parametrize("D", [20, 24, 64, 128])                          # 20: the portable tile; 24: AVX2 only
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_reads_an_fp8_cache_as_its_dequantized_values(dtype, D, window):
    """The kernel's only error is the fp8 storage: against the float64 reference over the same
    dequantized values (fp8 * scale) it is within float32 rounding, for one thread and several
    (requests cut into chunks merged by log-sum-exp)."""
    from kernels.attention.fp8 import dequantize_kv
    from kernels.cpu.native import available, paged_decode
    if not available()[0]:
        pytest.skip(available()[1])
    q, cache, table, lt = _native_case([1, 17, 300, 64, 1000], 9, 3, D, 16, seed=D)
    scales = (torch.tensor(0.0213), torch.tensor(0.0087))     # keys up to ~4.5 / 0.0213: e4m3's whole range
    fp8 = _fp8_cache(cache, dtype, scales)
    deq = torch.stack([dequantize_kv(fp8[0], scales[0]), dequantize_kv(fp8[1], scales[1])])
    ref = _reference_decode(q, deq, table, lt, D ** -0.5, window)
    for threads in (1, 3):
        with _with_omp_threads(threads):
            out = paged_decode(q, fp8, table, lt, D ** -0.5, window, *scales)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), _reference_decode(q, cache, table, lt, D ** -0.5, window), atol=1e-3)


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_backend_with_an_fp8_cache_matches_the_reference(dtype, scenario, window, native):
    """Every path writes the reference's bytes and reads fp8 * scale: decodes and chunks after
    cached context (native: kv_gather then causal_prefill; torch: SDPA, the chunk's own keys as
    the cache holds them) agree with the reference over the fp8 cache to float32 rounding; fresh
    prompts attend to the step's own float32 keys, so they agree with the reference over a
    float32 cache."""
    gen = torch.Generator().manual_seed(5)
    reqs = SCENARIOS[scenario]
    meta, num_blocks = shuffled_paged_metadata(reqs, 16, gen, num_padding=2)
    T, H, KVH = meta.num_tokens, 6, 2
    query, key, value = (torch.randn(T, n, HEAD_SIZE, generator=gen) * 3 for n in (H, KVH, KVH))
    scales = (torch.tensor(0.021), torch.tensor(0.013))
    cache = _fp8_cache(torch.randn(2, num_blocks, 16, KVH, HEAD_SIZE, generator=gen) * 3, dtype, scales)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    kw = dict(sliding_window=window, k_scale=scales[0], v_scale=scales[1])
    ours = CpuAttentionBackend(native).forward(query, key, value, ours_cache, meta, HEAD_SIZE ** -0.5, **kw)
    ref = reference_paged_attention(query, key, value, ref_cache, meta, HEAD_SIZE ** -0.5, **kw)
    assert torch.equal(ours_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    exact = reference_paged_attention(query, key, value, torch.zeros(cache.shape), meta, HEAD_SIZE ** -0.5,
                                      sliding_window=window)                  # float32 keys everywhere
    a = 0
    for ctx, n in reqs:
        fresh = ctx == 0 and n > 1 and window is None
        torch.testing.assert_close(ours[a:a + n], (exact if fresh else ref)[a:a + n], atol=2e-5, rtol=2e-5)
        a += n
    assert (ours[a:] == 0).all()


@pytest.mark.parametrize("dtype", FP8, ids=_fp8_id)
def test_an_fp8_cache_without_scales_reads_scale_one(dtype):
    """None scales are 1.0 on every path (vLLM's default without calibration)."""
    gen = torch.Generator().manual_seed(8)
    meta, num_blocks = shuffled_paged_metadata(SCENARIOS["mixed"], 16, gen)
    T = meta.num_tokens
    q, k, v = torch.randn(T, 4, HEAD_SIZE, generator=gen), torch.randn(T, 2, HEAD_SIZE, generator=gen), \
        torch.randn(T, 2, HEAD_SIZE, generator=gen)
    cache = torch.randn(2, num_blocks, 16, 2, HEAD_SIZE, generator=gen).to(dtype)
    one = torch.tensor(1.0)
    for native in (True, False):
        a, b = cache.clone(), cache.clone()
        x = CpuAttentionBackend(native).forward(q, k, v, a, meta, 0.25)
        y = CpuAttentionBackend(native).forward(q, k, v, b, meta, 0.25, k_scale=one, v_scale=one)
        assert torch.equal(x, y) and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_build_without_avx512_stores_and_reads_fp8_caches_the_same(tmp_path):
    """CPUs without AVX-512 compile the plain-C paths of paged_attention.c: the same fp8 bytes from
    the KV store, and decode attention over the dequantized values to float32 rounding."""
    import ctypes
    import shutil
    import subprocess

    from kernels.attention.fp8 import dequantize_kv, quantize_kv
    from kernels.cpu.native import HERE, KV_TYPES, available
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not available()[0]:
        pytest.skip("no C compiler or native kernels")
    so = tmp_path / "paged_portable.so"
    subprocess.run([cc, "-O2", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC",
                    f"{HERE}/paged_attention.c", "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.kv_store.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr]
    lib.kv_store.restype = i64
    lib.paged_decode.argtypes = [ptr, ptr, i64, ptr, ptr, ptr] + [i64] * 7 + [ctypes.c_float, i64, ptr, ptr]
    lib.paged_decode.restype = None
    for dtype in FP8:
        x = _fp8_values(dtype, n=1 << 12)[:4096].view(64, 1, 64) * 0.5
        s = torch.tensor(0.5)
        got = torch.zeros(2, 64, 1, 1, 64, dtype=dtype)
        slots = torch.arange(64)
        assert lib.kv_store(x.data_ptr(), 64, x.data_ptr(), 64, slots.data_ptr(), 64, got.data_ptr(), KV_TYPES[dtype],
                            64, 64, s.data_ptr(), s.data_ptr()) == -1
        assert torch.equal(got[0].view(torch.uint8).view(-1), quantize_kv(x, dtype, s).view(torch.uint8).view(-1))
        q, cache, table, lt = _native_case([1, 17, 300, 64], 6, 2, 64, 16, seed=1)
        scales = (torch.tensor(0.02), torch.tensor(0.01))
        fp8 = _fp8_cache(cache, dtype, scales)
        out = torch.empty_like(q)
        lib.paged_decode(q.data_ptr(), fp8.data_ptr(), KV_TYPES[dtype], table.data_ptr(), lt.data_ptr(), out.data_ptr(),
                         4, 6, 2, 64, 16, fp8.shape[1], table.shape[1], 0.125, 0, scales[0].data_ptr(),
                         scales[1].data_ptr())
        deq = torch.stack([dequantize_kv(fp8[0], scales[0]), dequantize_kv(fp8[1], scales[1])])
        torch.testing.assert_close(out.double(), _reference_decode(q, deq, table, lt, 0.125), atol=1e-5, rtol=1e-5)
