"""The one-call native decode stack (models/native_decode.py, kernels/cpu/decode_stack.c)
against the per-layer path it replaces: identical logits, bit for bit, for every weight kind
and KV cache dtype, and the steps and models it must leave to the per-layer path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.attention import CpuAttentionBackend, allocate_kv_caches, build_attention_metadata
from kernels.cpu.native import available
from models import native_decode
from models.config import ArchConfig
from models.llama import LlamaForCausalLM
from models.mistral import MistralForCausalLM
from models.packed import PanelLinear, prepack_linears
from models.phi3 import Phi3ForCausalLM
from models.qwen3 import Qwen3ForCausalLM
from helpers import run_steps

pytestmark = pytest.mark.skipif(not available()[0], reason=f"native kernels unavailable: {available()[1]}")

BLOCK_SIZE = 4


def _model(cls=LlamaForCausalLM, weights="f32", **overrides):
    config = ArchConfig(architecture=cls.__name__, vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_size=16, max_model_len=256,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_ids=(), **overrides)
    model = cls(config, CpuAttentionBackend()).eval()
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.15, generator=g)
    if weights in ("f32", "bf16"):
        prepack_linears(model, bfloat16=weights == "bf16")
    else:
        _gguf_linears(model, weights)
    return model, config


def _gguf_linears(model, weights: str) -> None:
    """Every decoder linear as GGUF panels ("Q4_1", "Q4_1_i8", "Q8_0_i8") of its own values."""
    from gguf import GGMLQuantizationType, quantize
    from kernels.cpu.panels import PanelWeight, int8_available
    qtype = weights[:4]
    if weights.endswith("_i8") and not int8_available():
        pytest.skip("int8 activations need AVX2 or AVX512-VNNI")
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            lin = getattr(owner, name)
            n, k = lin.weight.shape
            raw = quantize(lin.weight.detach().numpy().astype(np.float32), GGMLQuantizationType[qtype])
            packed = PanelWeight.pack_gguf(qtype, np.ascontiguousarray(raw).view(np.uint8), n, k,
                                           int8_activations=weights.endswith("_i8"))
            setattr(owner, name, PanelLinear(packed, lin.bias))


def _steps(model, config, kv_dtype=torch.float32, decode_steps=7):
    """Logits of three prompts prefilled together (one longer than the stack flattens), then
    decode steps of all three (crossing block boundaries), one row per sampled token."""
    caches = allocate_kv_caches(config, 64, BLOCK_SIZE, kv_dtype)
    tables = [list(range(1, 12)), list(range(12, 20)), list(range(20, 30))]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (native_decode.MAX_FLAT_QUERY + 4, 2, 6)]
    steps = [prompts] + [[torch.tensor([(7 * s + r) % 96]) for r in range(3)] for s in range(decode_steps)]
    return run_steps(model, caches, tables, steps, BLOCK_SIZE)


def _spy_on_the_stack(monkeypatch) -> list[bool]:
    """Whether the stack took each forward since (True) or left it to the layers (False)."""
    ran = []
    real_run = native_decode.NativeDecodeStack.run

    def run(self, *args):
        out = real_run(self, *args)
        ran.append(out is not None)
        return out
    monkeypatch.setattr(native_decode.NativeDecodeStack, "run", run)
    return ran


def _compare(model, config, monkeypatch, kv_dtype=torch.float32):
    assert native_decode.attach(model)
    ran = _spy_on_the_stack(monkeypatch)
    ours = _steps(model, config, kv_dtype)
    assert ran == [False] + [True] * 7           # the prefill step is left to the layers
    model.native_decode = None
    ref = _steps(model, config, kv_dtype)
    assert ref.std() > 0.3
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("weights", ["f32", "bf16", "Q4_1", "Q4_1_i8", "Q8_0_i8"])
def test_native_decode_stack_equals_the_per_layer_path(weights, monkeypatch):
    model, config = _model(weights=weights)
    _compare(model, config, monkeypatch)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_native_decode_stack_with_a_16_bit_kv_cache(kv_dtype, monkeypatch):
    model, config = _model()
    _compare(model, config, monkeypatch, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_native_decode_stack_with_an_fp8_kv_cache_and_per_layer_scales(kv_dtype, monkeypatch):
    """Each layer's own k_scale / v_scale, read by the stack through their addresses: bit for bit
    the per-layer path, and the scales matter (other scales, other logits)."""
    model, config = _model()
    for i, layer in enumerate(model.layers):
        layer.self_attn.k_scale.fill_(0.004 * (i + 1))
        layer.self_attn.v_scale.fill_(0.001 * (3 - i))
    _compare(model, config, monkeypatch, kv_dtype)
    scaled = _steps(model, config, kv_dtype)
    for layer in model.layers:
        layer.self_attn.k_scale.fill_(1.0)             # in place: the stack reads the new values
        layer.self_attn.v_scale.fill_(1.0)
    assert not torch.equal(_steps(model, config, kv_dtype), scaled)


def test_calculated_kv_scales_come_from_the_first_batch_which_the_layers_run(monkeypatch):
    """--calculate-kv-scales: the first batch (here one token per request, a pure-decode shape
    the stack would otherwise take) runs through the layers, each setting its scales to its keys'
    and values' amax / 200 and / 100 (vLLM's K_ and V_SCALE_CONSTANT); the stack takes the later
    steps with those scales."""
    from kernels.attention.cpu import CpuAttentionBackend as Backend
    from models.layers import calculate_kv_scales_on_next_batch
    model, config = _model()
    assert native_decode.attach(model)
    seen = []
    real_forward = Backend.forward

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None, k_scale=None, v_scale=None,
                logits_soft_cap=None):
        seen.append((k.abs().max() / 200, v.abs().max() / 100, k_scale.clone(), v_scale.clone()))
        return real_forward(self, q, k, v, kv_cache, meta, scale, sliding_window, k_scale, v_scale, logits_soft_cap)
    monkeypatch.setattr(Backend, "forward", forward)
    assert calculate_kv_scales_on_next_batch(model) == 3
    caches = allocate_kv_caches(config, 16, BLOCK_SIZE, torch.float8_e4m3fn)
    steps = [[torch.tensor([5]), torch.tensor([9])], [torch.tensor([1]), torch.tensor([2])]]
    run_steps(model, caches, [[1, 2], [3, 4]], steps, BLOCK_SIZE)
    assert len(seen) == 3                                # the second step: the stack, no layer forward
    for layer, (k_want, v_want, k_scale, v_scale) in zip(model.layers, seen):
        assert torch.equal(k_scale, k_want) and torch.equal(v_scale, v_want)
        assert torch.equal(layer.self_attn.k_scale, k_want) and not layer.self_attn.calculate_kv_scales


def test_native_decode_stack_with_qkv_bias_and_a_sliding_window(monkeypatch):
    model, config = _model(MistralForCausalLM, qkv_bias=True, o_bias=True, sliding_window=5)
    _compare(model, config, monkeypatch)


def test_native_decode_stack_takes_phi3(monkeypatch):
    """Phi-3's layers are Llama's (only its checkpoint's tensors come fused): the stack qualifies."""
    model, config = _model(Phi3ForCausalLM, sliding_window=5)
    _compare(model, config, monkeypatch)


def test_native_decode_stack_takes_nope_layers_a_partial_rotary_and_a_residual_multiplier(monkeypatch):
    """SmolLM3's layers without rotary (layer 1 here), Phi-4-mini's partial rotary (8 of 16 dims
    here) and Granite's residual multiplier (with its other multipliers, applied outside the
    stack): bit for bit the per-layer path, and each matters (without it, other logits)."""
    from models.granite import GraniteForCausalLM
    from models.smollm3 import SmolLM3ForCausalLM
    smollm3, config = _model(SmolLM3ForCausalLM, rope_layers=(True, False, True))
    _compare(smollm3, config, monkeypatch)
    granite, config = _model(GraniteForCausalLM, residual_multiplier=0.7, embedding_multiplier=1.5,
                             logits_scaling=1.25, query_pre_attn_scalar=25.0)
    _compare(granite, config, monkeypatch)
    phi4, config = _model(Phi3ForCausalLM, rotary_dim=8)
    _compare(phi4, config, monkeypatch)
    plain_smollm3, _ = _model(SmolLM3ForCausalLM)                 # the same weights, every layer turning
    plain_phi4, _ = _model(Phi3ForCausalLM)
    plain_granite, _ = _model(GraniteForCausalLM, embedding_multiplier=1.5, logits_scaling=1.25,
                              query_pre_attn_scalar=25.0)
    for model, plain in ((smollm3, plain_smollm3), (phi4, plain_phi4), (granite, plain_granite)):
        assert not torch.equal(_steps(plain, plain.config), _steps(model, model.config))


def test_models_the_stack_cannot_reproduce_keep_their_layers():
    qwen3, _ = _model(Qwen3ForCausalLM)                       # per-head q/k norms
    assert not native_decode.attach(qwen3) and qwen3.native_decode is None
    plain = LlamaForCausalLM(_model()[1], CpuAttentionBackend()).eval()   # weights not packed
    assert not native_decode.attach(plain)


@pytest.mark.parametrize("weights", ["f32", "Q4_1", "Q4_1_i8"])
def test_a_step_of_short_queries_runs_flattened_and_equals_decoding_token_by_token(weights, monkeypatch):
    """Speculative decoding's verification: requests bringing 1-5 tokens each (their last token
    and drafts) in one step. The stack takes it, each token a decode row over the keys up to its
    position, and its logits are bit for bit those of decoding the same tokens one step at a time
    (float32 weights; GGUF panels sum 1-2 rows in another order than more: within rounding)."""
    model, config = _model(weights=weights)
    assert native_decode.attach(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g) for n in (native_decode.MAX_FLAT_QUERY + 3, 7, 9)]
    queries = [torch.randint(0, 96, (n,), generator=g) for n in (5, 1, 3)]
    tables = [list(range(1, 12)), list(range(12, 20)), list(range(20, 30))]
    ran = _spy_on_the_stack(monkeypatch)
    caches = allocate_kv_caches(config, 64, BLOCK_SIZE, torch.float32)
    together = run_steps(model, caches, tables, [prompts, queries], BLOCK_SIZE)[sum(map(len, prompts)):]
    assert ran == [False, True]
    caches = allocate_kv_caches(config, 64, BLOCK_SIZE, torch.float32)
    run_steps(model, caches, tables, [prompts], BLOCK_SIZE)
    rows = {}
    for j in range(max(map(len, queries))):           # decode steps of the requests with a j-th token
        reqs = [r for r, q in enumerate(queries) if j < len(q)]
        meta = build_attention_metadata([1] * len(reqs), [len(prompts[r]) + j + 1 for r in reqs],
                                        [tables[r] for r in reqs], BLOCK_SIZE)
        ids = torch.stack([queries[r][j] for r in reqs])
        pos = torch.tensor([len(prompts[r]) + j for r in reqs])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos, caches, meta))
        rows.update({(r, j): logits[i] for i, r in enumerate(reqs)})
    assert ran[3:] == [True] * max(map(len, queries))
    assert together.std() > 0.3
    ref = torch.stack([rows[r, j] for r, q in enumerate(queries) for j in range(len(q))])
    if weights != "f32":
        torch.testing.assert_close(together, ref, rtol=0, atol=1e-3)
    else:
        assert torch.equal(together, ref)


def test_a_slot_past_the_cache_is_refused_with_a_clear_error():
    model, config = _model()
    assert native_decode.attach(model)
    caches = allocate_kv_caches(config, 4, BLOCK_SIZE, torch.float32)
    meta = build_attention_metadata([1], [3], [[1]], BLOCK_SIZE)
    meta.slot_mapping[0] = 4 * BLOCK_SIZE + 1
    with pytest.raises(IndexError, match="past the KV cache"), torch.inference_mode():
        model(torch.tensor([5]), torch.tensor([2]), caches, meta)


@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_a_profiled_step_accounts_its_time_to_every_phase(weights):
    """float32 and bfloat16 panels fuse the SiLU into the gate|up matmul (its time counted there,
    its own phase 0)."""
    model, config = _model(weights=weights)
    assert native_decode.attach(model)
    model.native_decode.start_profile()
    ref = _steps(model, config, decode_steps=3)
    seconds = model.native_decode.profile_seconds()
    assert set(seconds) == set(native_decode.PHASES)
    assert all(s > 0 for name, s in seconds.items() if name != "silu_and_mul")
    assert seconds["silu_and_mul"] == 0
    model.native_decode.profile = None
    assert torch.equal(_steps(model, config, decode_steps=3), ref)      # profiling changes nothing
