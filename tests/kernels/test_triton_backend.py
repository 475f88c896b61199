"""TritonAttentionBackend end to end (KV store, then decode or prefill kernel) against the CPU
backend and the slow reference, on the CPU under TRITON_INTERPRET=1; plus its declared
capabilities and refusals."""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.attention import CpuAttentionBackend, build_attention_metadata, reference_paged_attention  # noqa: E402
from kernels.attention.base import AttentionRequirements  # noqa: E402
from kernels.attention.selector import select_backend  # noqa: E402
from kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kernels.triton.paged_prefill import paged_attention_ref  # noqa: E402
from paged_cases import DEVICE, assert_close, make_case, meta_on  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)

HEAD_SIZE = 16
SCENARIOS = {
    "decode": [(0, 1), (16, 1), (39, 1), (4, 1), (300, 1)],          # 300: split-K
    "prefill_cached_prefix": [(20, 13), (48, 5), (0, 16)],
    "mixed": [(0, 9), (30, 1), (15, 1), (7, 6), (64, 1)],
}
CASES = [("decode", (4, 4), 16, torch.float32), ("decode", (6, 2), 32, torch.bfloat16),
         ("decode", (8, 1), 16, torch.bfloat16),
         ("prefill_cached_prefix", (4, 4), 32, torch.bfloat16), ("prefill_cached_prefix", (6, 2), 16, torch.float32),
         ("mixed", (8, 1), 32, torch.float32), ("mixed", (6, 2), 16, torch.bfloat16)]


@pytest.fixture
def backend(monkeypatch) -> TritonAttentionBackend:
    monkeypatch.setattr(TritonAttentionBackend, "devices", ("cuda", "cpu"))
    return TritonAttentionBackend()


def _id(value: object) -> str | None:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return f"h{value[0]}kv{value[1]}" if isinstance(value, tuple) else None


@pytest.mark.parametrize("scenario, heads, block_size, dtype", CASES, ids=_id)
def test_backend_matches_cpu_backend_and_reference(backend, scenario, heads, block_size, dtype):
    case = make_case(SCENARIOS[scenario], block_size, *heads, HEAD_SIZE, dtype, num_padding=2)
    scale = HEAD_SIZE ** -0.5
    ours_cache = case.kv_cache.clone()
    out = backend.forward(case.query, case.key, case.value, ours_cache, case.meta, scale)

    cpu = [x.cpu() for x in (case.query, case.key, case.value)]
    cpu_meta = meta_on(case.meta, "cpu")
    ref_cache = case.kv_cache.cpu().clone()
    expected = reference_paged_attention(*cpu, ref_cache, cpu_meta, scale)
    assert torch.equal(ours_cache.cpu(), ref_cache)
    assert_close(out, expected)
    assert torch.equal(out[-2:].cpu(), torch.zeros_like(expected[-2:]))      # padding rows
    if dtype == torch.float32:
        cpu_out = CpuAttentionBackend().forward(*cpu, case.kv_cache.cpu().clone(), cpu_meta, scale)
        assert_close(out, cpu_out)


@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_backend_sliding_window(backend, scenario):
    case = make_case(SCENARIOS[scenario], 16, 6, 2, HEAD_SIZE, seed=1)
    m = case.meta
    cache = case.kv_cache.clone()
    out = backend.forward(case.query, case.key, case.value, cache, m, 0.25, sliding_window=12)
    expected = paged_attention_ref(case.query, cache, m.query_start_loc, m.seq_lens, m.block_table, 0.25, 12)
    assert_close(out, expected)


def test_decode_step_after_prefill_matches_one_prefill(backend):
    """The invariant the engine relies on: prefilling 20 tokens then decoding the 21st gives the
    21st token the same attention output as one prefill of all 21."""
    full = make_case([(0, 21)], 16, 4, 2, HEAD_SIZE, seed=2)
    one = backend.forward(full.query, full.key, full.value, full.kv_cache.clone(), full.meta, 0.3)
    pages = [full.meta.block_table[0].tolist()]
    prefill = meta_on(build_attention_metadata([20], [20], pages, 16), DEVICE)
    decode = meta_on(build_attention_metadata([1], [21], pages, 16), DEVICE)
    assert decode.is_pure_decode
    cache = full.kv_cache.clone()
    backend.forward(full.query[:20], full.key[:20], full.value[:20], cache, prefill, 0.3)
    last = backend.forward(full.query[20:], full.key[20:], full.value[20:], cache, decode, 0.3)
    assert_close(last, one[20:])


@pytest.mark.parametrize("scenario, window, dtype", [("decode", None, torch.float32), ("mixed", 12, torch.bfloat16),
                                                      ("prefill_cached_prefix", None, torch.float32)], ids=_id)
def test_capped_scores_match_the_reference_and_the_cap_matters(backend, scenario, window, dtype):
    """Gemma 2's logits_soft_cap in both kernels (decode with split-K among them): each scaled
    score s becomes C * tanh(s / C) before the mask and the softmax."""
    case = make_case(SCENARIOS[scenario], 16, 6, 2, HEAD_SIZE, dtype, num_padding=2, seed=4)
    scale, cap = 1.0, 0.5                       # scores of a few units: the cap changes them
    out = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, scale,
                          sliding_window=window, logits_soft_cap=cap)
    cpu = [x.cpu() for x in (case.query, case.key, case.value)]
    expected = reference_paged_attention(*cpu, case.kv_cache.cpu().clone(), meta_on(case.meta, "cpu"), scale,
                                         sliding_window=window, logits_soft_cap=cap)
    assert_close(out, expected)
    plain = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, scale,
                            sliding_window=window)
    assert (plain.float() - out.float()).abs().max() > 0.05


@pytest.mark.parametrize("scenario, window, dtype", [("decode", None, torch.float32), ("mixed", 12, torch.bfloat16),
                                                      ("prefill_cached_prefix", None, torch.float32)], ids=_id)
def test_attention_sinks_match_the_reference_and_matter(backend, scenario, window, dtype):
    """gpt-oss's sinks in both kernels' softmax denominators (decode with split-K among them)."""
    case = make_case(SCENARIOS[scenario], 16, 6, 2, HEAD_SIZE, dtype, num_padding=2, seed=6)
    sinks = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0], device=case.query.device)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, 0.25,
                          sliding_window=window, sinks=sinks)
    cpu = [x.cpu() for x in (case.query, case.key, case.value)]
    expected = reference_paged_attention(*cpu, case.kv_cache.cpu().clone(), meta_on(case.meta, "cpu"), 0.25,
                                         sliding_window=window, sinks=sinks.cpu())
    assert_close(out, expected)
    assert torch.equal(out[-2:].cpu(), torch.zeros_like(expected[-2:]))      # padding rows
    plain = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, 0.25,
                            sliding_window=window)
    assert (plain.float() - out.float()).abs().max() > 0.05


@pytest.mark.parametrize("scenario, window, dtype", [("decode", None, torch.float32), ("mixed", 12, torch.bfloat16),
                                                      ("prefill_cached_prefix", None, torch.float32)], ids=_id)
def test_alibi_matches_the_reference_and_matters(backend, scenario, window, dtype):
    """ALiBi's biases in both kernels' scores (decode with split-K among them)."""
    from models.layers import alibi_slopes
    case = make_case(SCENARIOS[scenario], 16, 6, 2, HEAD_SIZE, dtype, num_padding=2, seed=8)
    slopes = alibi_slopes(6).to(case.query.device)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, 0.25,
                          sliding_window=window, alibi_slopes=slopes)
    cpu = [x.cpu() for x in (case.query, case.key, case.value)]
    expected = reference_paged_attention(*cpu, case.kv_cache.cpu().clone(), meta_on(case.meta, "cpu"), 0.25,
                                         sliding_window=window, alibi_slopes=slopes.cpu())
    assert_close(out, expected)
    assert torch.equal(out[-2:].cpu(), torch.zeros_like(expected[-2:]))      # padding rows
    plain = backend.forward(case.query, case.key, case.value, case.kv_cache.clone(), case.meta, 0.25,
                            sliding_window=window)
    assert (plain.float() - out.float()).abs().max() > 0.05


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_backend_with_an_fp8_cache_matches_the_reference(backend, kv_dtype, scenario):
    """KV store then decode or prefill kernel over an fp8 cache with per-layer scales: the bytes
    the reference stores, and its attention over the dequantized cache."""
    from kernels.attention.fp8 import quantize_kv
    case = make_case(SCENARIOS[scenario], 16, 6, 2, HEAD_SIZE, num_padding=2, seed=3)
    k_scale = torch.tensor(0.011, device=DEVICE)
    v_scale = torch.tensor(0.006, device=DEVICE)
    cache = torch.stack([quantize_kv(case.kv_cache[0], kv_dtype, k_scale),
                         quantize_kv(case.kv_cache[1], kv_dtype, v_scale)])
    ours = cache.clone()
    out = backend.forward(case.query, case.key, case.value, ours, case.meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    ref_cache = cache.cpu().clone()
    expected = reference_paged_attention(case.query.cpu(), case.key.cpu(), case.value.cpu(), ref_cache,
                                         meta_on(case.meta, "cpu"), 0.25, k_scale=k_scale.cpu(), v_scale=v_scale.cpu())
    assert torch.equal(ours.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    assert_close(out, expected)


def _req(device: str = "cuda", **kw) -> AttentionRequirements:
    args = dict(dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, head_size=128, block_size=16,
                sliding_window=4096, device=device)
    return AttentionRequirements(**(args | kw))


def test_capabilities_and_refusals():
    cls = TritonAttentionBackend
    assert cls.refusal(_req()) is None
    assert cls.refusal(_req(dtype=torch.float32, kv_cache_dtype=torch.float32, head_size=80, block_size=64)) is None
    assert cls.cudagraph_support == "uniform_decode" and cls.supports_sliding_window
    assert cls.refusal(_req(logits_soft_cap=True)) is None          # Gemma 2's capped scores
    assert "head size 512" in cls.refusal(_req(head_size=512))
    assert "block size 8" in cls.refusal(_req(block_size=8))
    assert "must equal the model dtype" in cls.refusal(_req(kv_cache_dtype=torch.float16))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):           # an fp8 cache under any model dtype
        assert cls.refusal(_req(kv_cache_dtype=fp8)) is None
        assert cls.refusal(_req(dtype=torch.float32, kv_cache_dtype=fp8)) is None
    assert isinstance(select_backend(_req(), ["triton"]), TritonAttentionBackend)


def test_cpu_only_when_asked(monkeypatch):
    if "cpu" not in TritonAttentionBackend.devices:
        assert "runs on cuda" in TritonAttentionBackend.refusal(_req("cpu"))
        assert isinstance(select_backend(_req("cpu", sliding_window=None)), CpuAttentionBackend)
    monkeypatch.setattr(TritonAttentionBackend, "devices", ("cuda", "cpu"))
    assert TritonAttentionBackend.refusal(_req("cpu")) is None


def test_gemma2_through_the_triton_kernels_gives_transformers_logits(backend, tmp_path):
    """A tiny Gemma 2 (capped scores, sliding and global layers, capped logits) with the Triton
    backend: a prompt, then decode steps, equal transformers' logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from models.registry import load_model
    from models.resolve import resolve_model
    from kernels.attention import allocate_kv_caches
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, num_hidden_layers=3, sliding_window=8,
                                        max_position_embeddings=128, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=0.5, final_logit_softcapping=30.0, pad_token_id=0))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.config._attn_implementation = "eager"
    hf.eval().save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)), attn_backend=backend, device=DEVICE)
    tokens = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    caches = allocate_kv_caches(config, 8, 16, torch.float32, device=DEVICE)
    table, outs = [[1, 2]], []
    with torch.inference_mode():
        for start, n in ((0, 20), (20, 1), (21, 1), (22, 2)):
            meta = meta_on(build_attention_metadata([n], [start + n], table, 16), DEVICE)
            ids = torch.tensor(tokens[start:start + n], device=DEVICE)
            pos = torch.arange(start, start + n, device=DEVICE)
            outs.append(model.compute_logits(model(ids, pos, caches, meta)).float().cpu())
    torch.testing.assert_close(torch.cat(outs), expected, atol=2e-4, rtol=2e-4)
