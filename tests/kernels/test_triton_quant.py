"""The quantized matmuls of kernels/triton/quant.py against dequantize-then-matmul references,
and the GPU form of the quantized linear methods (models/quantization) run through them: on the
CPU under TRITON_INTERPRET=1, or compiled on CUDA when a GPU is present."""
from __future__ import annotations

import os
import re
import sys

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

from kernels.triton import quant  # noqa: E402
from models.layers import Linear, MergedLinear  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("fmt", [quant.FMT_FP8, quant.FMT_INT8])
def test_per_token_quant_matches_reference(fmt):
    x = _randn(5, 96) * torch.linspace(0.1, 10, 5, device=DEVICE)[:, None]
    q, s = quant.per_token_quant(x, fmt)
    q_ref, s_ref = quant.per_token_quant_ref(x, fmt)
    torch.testing.assert_close(s, s_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("fmt", [quant.FMT_FP8, quant.FMT_INT8])
def test_scaled_mm_matches_dequantized_matmul(fmt):
    a, sa = quant.per_token_quant(_randn(7, 160, seed=1), fmt)
    b, sb = quant.per_token_quant(_randn(70, 160, seed=2), fmt)
    got = quant.scaled_mm(a, b, sa, sb, fmt)
    rtol = 1e-4 if fmt == quant.FMT_FP8 else 1e-5       # Hopper's fp8 MMA adds in a narrower accumulator
    torch.testing.assert_close(got, quant.scaled_mm_ref(a, b, sa, sb, fmt), rtol=rtol, atol=1e-5)
    if DEVICE == "cuda":              # the widened-codes path the interpreter runs, on the GPU too
        widened = quant.scaled_mm(a, b, sa, sb, fmt, native=False)
        torch.testing.assert_close(widened, quant.scaled_mm_ref(a, b, sa, sb, fmt), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 16, 33, 64, 130])
def test_scaled_mm_and_int4_tiles_for_every_batch_size_write_the_model_dtype(M):
    """Each batch size's tile (decode's 16 rows up to prefill's 64) covers every row and column,
    and the product is written in the activations' dtype."""
    x = _randn(M, 256, seed=12).to(torch.bfloat16)
    w = _randn(96, 256, seed=13)
    a, sa = quant.per_token_quant(x, quant.FMT_INT8)
    b, sb = quant.per_token_quant(w, quant.FMT_INT8)
    got = quant.scaled_mm(a, b, sa, sb, quant.FMT_INT8, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), quant.scaled_mm_ref(a, b, sa, sb, quant.FMT_INT8), rtol=1e-2, atol=1e-2)
    q = torch.randint(0, 16, (256, 96), generator=torch.Generator().manual_seed(14))
    args = [t.to(DEVICE) for t in (quant.pack_int4(q), torch.full((2, 96), 8, dtype=torch.int8),
                                   torch.full((2, 96), 0.01, dtype=torch.float16), torch.arange(256) // 128)]
    args[3] = args[3].int()
    xf = x.float()
    got4 = quant.int4_linear(xf, *args, group_size=128, out_dtype=torch.bfloat16)
    assert got4.dtype == torch.bfloat16
    torch.testing.assert_close(got4.float(), quant.int4_linear_ref(xf, *args), rtol=1e-2, atol=1e-2)


def _int4_operands(K: int, N: int, G: int, act_order: bool, seed: int) -> list[torch.Tensor]:
    """Random packed codes, zeros, scales and g_idx (act-order: a permutation of the groups)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // G, N), generator=gen).to(torch.int8)
    scales = (torch.rand(K // G, N, generator=gen) * 0.02 + 0.001).half()
    g_idx = (torch.randperm(K, generator=gen) if act_order else torch.arange(K)) // G
    return [t.to(DEVICE) for t in (quant.pack_int4(q), zeros, scales, g_idx.int())]


@pytest.mark.parametrize("words_once", [False, True])
@pytest.mark.parametrize("act_order,grouped", [(False, False), (False, True), (True, False)])
def test_int4_matmul_matches_dequantized_matmul(act_order, grouped, words_once):
    """grouped: the kernel told the groups are in order reads one zero and scale per tile column
    (and scales after the dot); words_once: each packed word loaded once, its values shifted out."""
    args = _int4_operands(256, 72, 128, act_order, seed=3)
    x = _randn(5, 256, seed=4)
    got = quant.int4_linear(x, *args, group_size=128 if grouped else 0, words_once=words_once)
    torch.testing.assert_close(got, quant.int4_linear_ref(x, *args), rtol=1e-4, atol=1e-4)


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def _layer_with(method, tensors: dict, shards: dict | None, K: int = 128) -> torch.nn.Module:
    layer = MergedLinear(K, shards, torch.float32) if shards else Linear(K, 64, torch.float32)
    method.create_weights(layer)
    layer.quant_method = method
    for (name, shard), t in tensors.items():
        method.load_weight(layer, name, t, shard)
    return method.process_weights_after_loading(layer).to(DEVICE)


def test_gpu_int8_w8a8_layer_matches_dequantized_weights():
    from models.quantization.formats import Int8LinearMethod, quantize_int8
    w = _randn(64, 128, seed=5).cpu()
    codes, scale = quantize_int8(w, per_channel=True)
    layer = _layer_with(Int8LinearMethod("cuda", torch.float32, True),
                        {("weight", None): codes, ("weight_scale", None): scale[:, None]}, None)
    x = _randn(6, 128, seed=6)
    ref = x @ (codes.float() * scale[:, None]).to(DEVICE).T
    assert _relative_error(layer(x), ref) < 2e-2              # int8 activations per token: about 1%


def test_gpu_fp8_layer_with_fused_shards_matches_dequantized_weights():
    from models.quantization.formats import Fp8LinearMethod, quantize_fp8
    shards = {"gate": 32, "up": 32}
    tensors, deq = {}, []
    for i, s in enumerate(shards):
        w = quantize_fp8(_randn(32, 128, seed=7 + i).cpu() * (i + 1), per_channel=False)
        tensors[("weight", s)], tensors[("weight_scale", s)] = w.codes, w.scale[:1]
        deq.append(w.dequantize())
    layer = _layer_with(Fp8LinearMethod("cuda", torch.float32), tensors, shards)
    x = _randn(4, 128, seed=9)
    ref = x @ torch.cat(deq).to(DEVICE).T
    assert _relative_error(layer(x), ref) < 8e-2              # fp8 activations per token (3-bit mantissa)


def test_gpu_awq_layer_matches_dequantized_weights():
    from models.quantization.formats import AWQLinearMethod, awq_order, pack_int32
    K, N, G = 128, 64, 64
    gen = torch.Generator().manual_seed(10)
    q = torch.randint(0, 16, (K, N), generator=gen)
    zeros = torch.randint(0, 16, (K // G, N), generator=gen)
    scales = (torch.rand(K // G, N, generator=gen) * 0.02 + 0.001).half()
    tensors = {("qweight", None): pack_int32(awq_order(q), 4, 1), ("qzeros", None): pack_int32(awq_order(zeros), 4, 1),
               ("scales", None): scales}
    layer = _layer_with(AWQLinearMethod("cuda", torch.float32, G), tensors, None)
    g = torch.arange(K) // G
    w = ((q - zeros[g]).float() * scales.float()[g]).to(DEVICE)          # (K, N)
    x = _randn(3, K, seed=11)
    torch.testing.assert_close(layer(x), x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", [quant.FMT_FP8, quant.FMT_INT8])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_scaled_mm_cut_into_k_slices_matches_the_whole_product(fmt, splits):
    """Split-K: slices of whole K tiles (the last one shorter, K not a multiple of the tile),
    their partial sums added by the reduce kernel, the scales applied once."""
    a, sa = quant.per_token_quant(_randn(3, 520, seed=20), fmt)
    b, sb = quant.per_token_quant(_randn(40, 520, seed=21), fmt)
    whole = quant.scaled_mm(a, b, sa, sb, fmt, splits=1)
    got = quant.scaled_mm(a, b, sa, sb, fmt, torch.bfloat16, splits=splits)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), whole.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    got32 = quant.scaled_mm(a, b, sa, sb, fmt, splits=splits)
    torch.testing.assert_close(got32, quant.scaled_mm_ref(a, b, sa, sb, fmt), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_matmul_cut_into_k_slices_matches_the_dequantized_matmul(act_order):
    args = _int4_operands(512, 40, 128, act_order, seed=22)
    x = _randn(2, 512, seed=23)
    for splits in (2, 3):
        got = quant.int4_linear(x, *args, group_size=0 if act_order else 128, splits=splits)
        torch.testing.assert_close(got, quant.int4_linear_ref(x, *args), rtol=1e-4, atol=1e-4)


def test_split_k_is_chosen_only_where_the_tiles_leave_the_gpu_idle():
    cpu = torch.device("cpu")
    assert quant.split_k(1, 4096, 4096, cpu, 16, 64, 128) == 1          # off CUDA: never
    if DEVICE == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        n_narrow = 64 * max(1, sms // 2)                                   # half the device's tiles
        assert quant.split_k(1, n_narrow, 4096, dev, 16, 64, 128) >= 2
        assert quant.split_k(1, 64 * sms, 4096, dev, 16, 64, 128) == 1   # the tiles fill it
        assert quant.split_k(1, n_narrow, 256, dev, 16, 64, 128) == 1     # K too short to cut


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_level_3_inductor_fuses_the_activation_quantization_into_the_norm_before_it(dtype, tmp_path):
    """-O3: the 8-bit layer's per-token quantization in plain torch ops, so inductor computes the
    residual add, the RMSNorm and the codes of each row in one kernel (the norm's output never
    written out); the product is level 1's (the custom ops), its codes rounded the same way."""
    from torch._inductor.utils import run_and_get_code

    from actors.engine.compilation import CompilationConfig
    from actors.worker.compilation import apply_compilation
    from models.layers import RMSNorm
    from models.quantization.formats import Fp8LinearMethod, quantize_fp8

    fp8 = quantize_fp8(_randn(64, 128, seed=30).cpu(), per_channel=True)
    proj = _layer_with(Fp8LinearMethod("cuda", torch.float32), {("weight", None): fp8.codes,
                                                                 ("weight_scale", None): fp8.scale[:, None]}, None)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RMSNorm(128, 1e-6, dtype)
            self.norm.weight.data = torch.linspace(0.5, 1.5, 128, device=DEVICE).to(dtype)
            self.proj = proj

        def forward(self, h, residual):
            x, residual = self.norm(h, residual)
            return self.proj(x), residual

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    model = Model().to(DEVICE)
    h, residual = _randn(6, 128, seed=31).to(dtype), _randn(6, 128, seed=32).to(dtype)
    eager = model.layers[0](h.clone(), residual.clone())
    apply_compilation(model, CompilationConfig(level=3, cache_dir=str(tmp_path)), "test-fp8")
    assert proj.custom_ops is False
    limit = sys.getrecursionlimit()                  # dynamo raises it for the whole process
    try:
        (out, res), code = run_and_get_code(model.layers[0], h.clone(), residual.clone())
    finally:
        sys.setrecursionlimit(limit)
    assert torch.equal(res, eager[1])
    torch.testing.assert_close(out, eager[0], rtol=1e-5, atol=1e-5)
    kernels = re.findall(r"def (?:cpp|triton)_\w+|(?:cpp|triton)_fused_\w+", "\n".join(code))
    fused = {k for k in kernels if "rsqrt" in k and "amax" in k}
    assert fused, kernels
