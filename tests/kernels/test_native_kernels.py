"""The native CPU kernels. The panel matmul (kernels/cpu/gemm.c): float32 panels and the GGUF Q4_1 / Q8_0 blocks
times float32 activations equal the float32 product with the (dequantized) weights to float32
rounding, for any number of rows (the in-register path for few rows, the dequantized-panel path
above, several row blocks for long inputs) and any number of output features; the dequantized
values are exactly the gguf package's, whatever the float16 scales. The greedy argmax (sampling.c) answers as torch.argmax."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kernels.cpu.native import available
from kernels.cpu.panels import BLOCK_BYTES, PanelWeight, int8_available, matmul

pytestmark = pytest.mark.skipif(not available()[0], reason=f"native kernels: {available()[1]}")


def _gguf(qtype: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = quantize(w, Q[qtype])
    dense = torch.from_numpy(dequantize(raw, Q[qtype]).astype(np.float32))
    return np.ascontiguousarray(raw).view(np.uint8), dense


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-6) -> bool:
    return bool(((got.double() - ref).abs().max() / ref.abs().max()) < tol)


# float16 scales whose widening to float32 is easy to get wrong: subnormals, -0, a negative
# subnormal, the smallest normal, the largest finite values
SPECIAL_F16 = np.array([0x0001, 0x03FF, 0x8000, 0x8201, 0x0400, 0x7BFF, 0xFBFF], np.uint16)


def _special_scales(qtype: str, raw: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """raw (n, row_bytes) with the first block of rows 0-6 scaled by SPECIAL_F16 (and for Q4_1,
    rows 7-13 offset by them), and its dequantized weight."""
    out = raw.copy()
    blocks = out.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])
    s = SPECIAL_F16.view(np.uint8).reshape(-1, 2)
    blocks[:len(s), 0, 0:2] = s
    if qtype == "Q4_1":
        blocks[len(s):2 * len(s), 0, 2:4] = s
    return out, torch.from_numpy(dequantize(out, Q[qtype]).astype(np.float32))


def _assert_dequantized_exactly(w: PanelWeight, dense: torch.Tensor, rows: int) -> None:
    """Row r of x picks input feature r mod K: the products are the weight's columns."""
    k = dense.shape[1]
    picks = torch.zeros(rows, k)
    cols = torch.arange(rows) % k
    picks[torch.arange(rows), cols] = 1.0
    assert torch.equal(matmul(picks, w), dense[:, cols].T.contiguous())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 70])
@pytest.mark.parametrize("shape", [(96, 64), (200, 160), (33, 32)])
def test_gguf_panels_match_dequantized_float32(qtype, rows, shape):
    n, k = shape
    raw, dense = _gguf(qtype, n, k, rows)
    w = PanelWeight.pack_gguf(qtype, raw, n, k)
    x = torch.randn(rows, k)
    got = matmul(x, w)
    assert got.shape == (rows, n)
    assert _close(got, x.double() @ dense.double().T)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 40])          # the in-register and the panel paths
def test_gguf_dequantized_values_are_bit_exact(qtype, rows):
    n, k = 70, 96
    raw, dense = _special_scales(qtype, _gguf(qtype, n, k, 7)[0])
    _assert_dequantized_exactly(PanelWeight.pack_gguf(qtype, raw, n, k), dense, rows)


@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 64, 300])
@pytest.mark.parametrize("shape", [(96, 160), (31, 7), (65, 1)])
def test_float32_panels_match_plain_product(rows, shape):
    n, k = shape
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    got = matmul(x, PanelWeight.pack_f32(w))
    assert _close(got, x.double() @ w.double().T)


def test_a_float32_row_gives_the_same_bits_alone_in_a_pair_and_in_any_batch():
    """Exact mode's promise: each output sums its products in input order, whatever tile its
    row lands in (calls of up to 40 rows go 3 rows x the whole panel, larger ones in 6 x 16 tiles
    on AVX2 CPUs, 12 x 32 on AVX-512 ones)."""
    w = PanelWeight.pack_f32(torch.randn(200, 576))
    x = torch.randn(300, 576)
    full = matmul(x, w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 24, 40, 41, 64):
        assert torch.equal(matmul(x[:rows], w), full[:rows])
    assert torch.equal(matmul(x[41:43], w), full[41:43])


def _bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the bfloat16 panels compute: both operands rounded to bfloat16, exact products."""
    return x.bfloat16().double() @ w.bfloat16().double().T


@pytest.mark.parametrize("rows", [1, 2, 12, 13, 64, 300])
@pytest.mark.parametrize("shape", [(96, 160), (31, 7), (65, 1)])
def test_bfloat16_panels_multiply_the_bfloat16_rounded_values(rows, shape):
    n, k = shape
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    got = matmul(x, PanelWeight.pack_bf16(w))
    assert _close(got, _bf16_product(x, w), tol=1e-5)
    assert not _close(got, x.double() @ w.double().T, tol=1e-4)          # the rounding is real
    assert torch.equal(matmul(x[:1], PanelWeight.pack_bf16(w.bfloat16())), got[:1])   # bfloat16 weights as given


def test_a_bfloat16_row_gives_the_same_bits_alone_and_in_any_batch():
    """Whatever path a call takes (one row over the whole panel, the loop that widens each pair
    for up to 12 rows, 6 x 16 tiles past 40 rows on AVX2 CPUs; 12 x 32 tiles on AVX-512 ones),
    each output sums the same products in input order."""
    dense = torch.randn(200, 577)                             # odd K: a zero-padded last pair
    w = PanelWeight.pack_bf16(dense)
    x = torch.randn(300, 577)
    full = matmul(x, w)
    for rows in (1, 2, 3, 7, 12, 13, 40, 41, 47, 64):
        assert torch.equal(matmul(x[:rows], w), full[:rows]), rows
    assert torch.equal(matmul(x[41:42], w), full[41:42])
    assert _close(full, _bf16_product(x, dense), tol=1e-5)


def test_bfloat16_panels_halve_the_weight_bytes():
    w = torch.randn(64, 96)
    assert PanelWeight.pack_bf16(w).nbytes * 2 == PanelWeight.pack_f32(w).nbytes


def test_bfloat16_panels_refuse_other_dtypes():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        PanelWeight.pack_bf16(torch.randn(4, 4, dtype=torch.float64))


def test_long_inputs_span_several_row_blocks():
    w = torch.randn(40, 4096)                              # 4 MiB of rows every 256 rows
    x = torch.randn(600, 4096)
    ref = x.double() @ w.double().T                       # 4096-term sums: float32 rounding grows
    assert _close(matmul(x, PanelWeight.pack_f32(w)), ref, tol=1e-5)


def test_zero_rows_give_an_empty_result():
    assert matmul(torch.randn(0, 64), PanelWeight.pack_f32(torch.randn(8, 64))).shape == (0, 8)


def test_bad_shapes_are_refused_with_clear_errors():
    raw, _ = _gguf("Q4_1", 2, 64)
    with pytest.raises(ValueError, match="needs 80"):
        PanelWeight.pack_gguf("Q4_1", raw.reshape(-1)[:60], 2, 64)
    with pytest.raises(ValueError, match="no native kernel"):
        PanelWeight.pack_gguf("Q5_K", raw, 2, 64)
    with pytest.raises(ValueError, match=r"x must be \(T, 64\)"):
        matmul(torch.randn(1, 32), PanelWeight.pack_gguf("Q4_1", raw, 2, 64))
    with pytest.raises(ValueError, match="float32"):
        PanelWeight.pack_f32(torch.randn(4, 4, dtype=torch.float64))


def _build_gemm(tmp_path, flag: str):
    """gemm.c (with fused.c, which it calls) built with ``flag``, its panel_gemm declared."""
    import ctypes
    import shutil
    import subprocess

    from kernels.cpu.native import HERE
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    so = tmp_path / f"gemm{flag}.so"
    subprocess.run([cc, "-O2", "-march=native", flag, "-fopenmp", "-shared", "-fPIC",
                    f"{HERE}/gemm.c", f"{HERE}/fused.c", "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    lib.panel_gemm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.panel_gemm.restype = ctypes.c_int
    return lib


def test_portable_build_without_avx512_gives_the_same_products(tmp_path, monkeypatch):
    """CPUs without AVX-512 compile the plain-C paths of gemm.c: same results."""
    import kernels.cpu.panels as panels
    fn = _build_gemm(tmp_path, "-mno-avx512f").panel_gemm
    monkeypatch.setattr(panels, "_panel_gemm", lambda: fn)
    for qtype in ("Q4_1", "Q8_0"):
        raw, dense = _gguf(qtype, 70, 96, 3)
        w = PanelWeight.pack_gguf(qtype, raw, 70, 96)
        for rows in (1, 5, 40):
            x = torch.randn(rows, 96)
            assert _close(matmul(x, w), x.double() @ dense.double().T)
        raw, dense = _special_scales(qtype, raw)
        _assert_dequantized_exactly(PanelWeight.pack_gguf(qtype, raw, 70, 96), dense, 40)
    w = torch.randn(45, 33)
    x = torch.randn(13, 33)
    assert _close(matmul(x, PanelWeight.pack_f32(w)), x.double() @ w.double().T)
    assert _close(matmul(x, PanelWeight.pack_bf16(w)), _bf16_product(x, w), tol=1e-5)


def test_bfloat16_panels_without_avx512_bf16_give_the_same_products(tmp_path, monkeypatch):
    """Without the AVX512-BF16 dot products the same bfloat16 values are widened to float32."""
    import kernels.cpu.panels as panels
    lib = _build_gemm(tmp_path, "-mno-avx512bf16")
    assert lib.bf16_available() == 0
    fn = lib.panel_gemm
    w = torch.randn(70, 97)
    x = torch.randn(17, 97)
    fast = matmul(x, PanelWeight.pack_bf16(w))
    monkeypatch.setattr(panels, "_panel_gemm", lambda: fn)
    widened = matmul(x, PanelWeight.pack_bf16(w))
    assert _close(widened, _bf16_product(x, w), tol=1e-5)
    assert _close(widened, fast.double(), tol=1e-5)


def test_native_argmax_matches_torch_including_ties_nan_and_minus_infinity():
    from kernels.cpu.native import argmax_rows
    x = torch.randn(9, 49152)
    x[1, 100] = float("nan")
    x[1, 200] = float("nan")
    x[2] = float("-inf")
    x[3, 7] = x[3, 9000] = 50.0                        # a tie: the first index
    x[4, -1] = 99.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, :1000]), x[:, :1000].argmax(dim=-1))   # strided rows


@pytest.mark.skipif(not available()[0] or not int8_available(), reason="the int8 kernel needs AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(96, 64), (200, 160), (33, 32)])
def test_int8_activation_panels_are_close_and_batch_invariant(qtype, shape):
    """Two int8 parts keep about 14 bits of each activation block: products within 2e-4 of the
    float32 ones, and a row's result does not depend on the rows batched with it."""
    n, k = shape
    raw, dense = _gguf(qtype, n, k, 5)
    w = PanelWeight.pack_gguf(qtype, raw, n, k, int8_activations=True)
    assert w.kind == f"{qtype}_I8X2"
    x = torch.randn(37, k)
    x[3] = 0.0                                             # an all-zero row (zero scales)
    got = matmul(x, w)
    assert _close(got, x.double() @ dense.double().T, tol=2e-4)
    for rows in (1, 2, 5):
        assert torch.equal(matmul(x[:rows], w), got[:rows])
    assert torch.equal(matmul(x[10:11], w), got[10:11])


@pytest.mark.skipif(not int8_available(), reason="int8 activations need AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_int8_activation_sums_do_not_overflow_at_the_extreme_codes(qtype):
    """Every code at its extreme (Q4_1 nibbles of 15, Q8_0 codes of -128 and 127) times
    activations at full scale of either sign: the integer sums (the AVX2 kernel's int16 pair and
    block sums among them) stay exact, so the product is the float one."""
    n, k = 64, 96
    raw, _ = _gguf(qtype, n, k, 3)
    blocks = raw.reshape(n, k // 32, BLOCK_BYTES[qtype]).copy()
    blocks[:, :, 0:2] = np.array([0x3C00], np.uint16).view(np.uint8)         # d = 1.0
    if qtype == "Q4_1":
        blocks[:, :, 2:4] = 0                                                # m = 0
        blocks[:, :, 4:] = 0xFF                                              # every nibble 15
    else:
        blocks[0::2, :, 2:] = 0x80                                           # -128
        blocks[1::2, :, 2:] = 0x7F                                           # 127
    raw = np.ascontiguousarray(blocks.reshape(n, -1))
    dense = torch.from_numpy(dequantize(raw, Q[qtype]).astype(np.float32))
    w = PanelWeight.pack_gguf(qtype, raw, n, k, int8_activations=True)
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    x[3, :32] = -1.0
    got = matmul(x, w)
    want = x.double() @ dense.double().T
    assert (got.double() - want).abs().max() < 1e-3 * want.abs().max(), (got[:, :4], want[:, :4])


@pytest.mark.skipif(not int8_available(), reason="int8 activations need AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gated_silu_matmul_is_silu_and_mul_of_the_product_bit_for_bit(qtype):
    from kernels.cpu import fused
    from kernels.cpu.panels import gated_matmul
    n, k = 2 * 96, 160                                      # gate | up, 3 panels each
    raw, _ = _gguf(qtype, n, k, 9)
    w = PanelWeight.pack_gguf(qtype, raw, n, k, int8_activations=True)
    x = torch.randn(301, k) * 2
    x[4] = 0.0
    for rows in (1, 2, 3, 4, 7, 64, 301):
        got = gated_matmul(x[:rows], w)
        assert got.shape == (rows, n // 2)
        assert torch.equal(got, fused.silu_and_mul(matmul(x[:rows], w)))
    odd = PanelWeight.pack_gguf(qtype, raw[:160], 160, k, int8_activations=True)   # halves of 80
    assert gated_matmul(x, odd) is None
    assert gated_matmul(x, w, "gelu_tanh") is None          # the int8 kernels gate with SiLU only


@pytest.mark.skipif(not available()[0], reason="the native kernels need AVX2, FMA and a C compiler")
@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_float_gated_matmul_is_the_gated_activation_of_the_product_bit_for_bit(qtype, act):
    """float32 activations (bfloat16 weights: the activations rounded to bfloat16): any number of
    rows (the few-row path, tiles of rows, several row blocks of a call) gives exactly the
    two-step path's values, for each activation."""
    from kernels.cpu import fused
    from kernels.cpu.panels import gated_matmul
    n, k = 2 * 96, 160                                      # gate | up, 3 panels each
    raw, dense = _gguf("Q8_0" if qtype in ("F32", "BF16") else qtype, n, k, 11)
    packs = {"F32": PanelWeight.pack_f32, "BF16": PanelWeight.pack_bf16}
    w = packs[qtype](dense) if qtype in packs else PanelWeight.pack_gguf(qtype, raw, n, k)
    rows_all = 14000 if qtype == "BF16" else 7000          # two row blocks of the call
    x = torch.randn(rows_all, k) * 2
    x[4] = 0.0
    for rows in (1, 2, 3, 8, 9, 49, 301, rows_all):
        got = gated_matmul(x[:rows], w, act)
        assert got.shape == (rows, n // 2)
        assert torch.equal(got, fused.gated_activation(matmul(x[:rows], w), act))
    assert gated_matmul(x[:5], PanelWeight.pack_f32(dense[:160]), act) is None  # halves of 80


def test_portable_bfloat16_gated_silu_matmul_is_silu_and_mul_of_the_product_bit_for_bit(tmp_path, monkeypatch):
    """Without AVX-512 (the AVX2 kernels take a row block's rows as float32 at its two ends):
    the gated bfloat16 product is the two-step path's, bit for bit."""
    import ctypes

    import kernels.cpu.panels as panels
    from kernels.cpu import fused
    lib = _build_gemm(tmp_path, "-mno-avx512f")
    lib.panel_gated_act_gemm.argtypes = [ctypes.c_int] + lib.panel_gemm.argtypes
    lib.panel_gated_act_gemm.restype = ctypes.c_int
    monkeypatch.setattr(panels, "_panel_gemm", lambda: lib.panel_gemm)
    monkeypatch.setattr(panels, "_gated_act_gemm", lambda: lib.panel_gated_act_gemm)
    dense = torch.randn(2 * 64, 97)
    w = PanelWeight.pack_bf16(dense)
    x = torch.randn(120, 97)
    for rows in (1, 5, 40, 41, 120):
        got = panels.gated_matmul(x[:rows], w)
        assert torch.equal(got, fused.silu_and_mul(matmul(x[:rows], w)))
        assert _close(matmul(x[:rows], w), _bf16_product(x[:rows], dense), tol=1e-5)


@pytest.mark.parametrize("vocab,words", [(70, 2), (70, 3), (1000, 32), (49152, 1536)])
def test_native_bitmask_matches_the_reference(vocab, words):
    from kernels.cpu.native import apply_bitmask_
    from kernels.triton.bitmask import apply_bitmask_ref
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1                                           # a row with every word allowed
    got, want = logits.clone(), logits.clone()
    assert apply_bitmask_(got, bitmask)
    apply_bitmask_ref(want, bitmask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["F32", "BF16", "Q4_1", "Q8_0", "Q4_1_I8X2"])
@pytest.mark.parametrize("rows", [1, 5, 40, 300])      # the few-row paths, the panel path, several row blocks
def test_a_bias_added_in_the_kernel_gives_the_bits_of_an_add_afterwards(kind, rows):
    """``matmul(x, w, bias)`` (the kernel adds the bias to each tile it writes; the int8 kernels
    add it afterwards) equals the product followed by ``add_``, bit for bit, and the packed linear
    layer (with its bias) is that, for 2-D and batched inputs; with an activation too, the
    kernel's is ``fused.activation`` after the add, and a residual added in the kernel is the add
    afterwards, bit for bit."""
    n, k = 70, 96
    if kind in ("F32", "BF16"):
        dense = torch.randn(n, k)
        w = PanelWeight.pack_f32(dense) if kind == "F32" else PanelWeight.pack_bf16(dense)
    else:
        qtype = kind.removesuffix("_I8X2")
        raw, _ = _gguf(qtype, n, k, 7)
        w = PanelWeight.pack_gguf(qtype, raw, n, k, int8_activations=kind.endswith("_I8X2"))
    bias, x = torch.randn(n), torch.randn(rows, k)
    expected = matmul(x, w)
    expected.add_(bias)
    assert torch.equal(matmul(x, w, bias), expected)
    from models.packed import PanelLinear
    layer = PanelLinear(w, bias)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x.view(1, rows, k)).view(rows, n), expected)
    with pytest.raises(ValueError, match="contiguous float32"):
        matmul(x, w, torch.randn(n, dtype=torch.float64))
    from kernels.cpu import fused
    for act in fused.ACTIVATIONS:
        assert torch.equal(matmul(x, w, bias, act), fused.activation(expected, act)), act
        assert torch.equal(matmul(x, w, None, act), fused.activation(matmul(x, w), act)), act
        assert torch.equal(layer.act_forward(x, act), fused.activation(expected, act)), act
    residual = torch.randn(rows, n)
    assert torch.equal(matmul(x, w, bias, residual=residual), residual + expected)
    assert torch.equal(matmul(x, w, None, residual=residual), residual + matmul(x, w))
    assert torch.equal(layer.residual_forward(x, residual), residual + expected)
    with pytest.raises(ValueError, match="residual"):
        matmul(x, w, bias, residual=torch.randn(rows + 1, n))


@pytest.mark.parametrize("rows", [1, 5, 40, 41, 300, 30000])    # the few-row paths, tiles, two row blocks
def test_bfloat16_panels_chain_a_bfloat16_result_into_the_next_product_with_the_same_bits(rows):
    """``out_bf16``: a bfloat16 panel product (with its bias and activation, or gated) written in
    bfloat16 is the float32 result rounded as the next bfloat16 product rounds its input; fed
    to that product (with a bias and a residual) it gives the float32 chain's bits. Other kinds
    ignore the flag and take bfloat16 input as float32."""
    from kernels.cpu.panels import gated_matmul
    gen = torch.Generator().manual_seed(rows)
    up, down = PanelWeight.pack_bf16(torch.randn(192, 96, generator=gen)), PanelWeight.pack_bf16(torch.randn(96, 192, generator=gen))
    gate_up = PanelWeight.pack_bf16(torch.randn(2 * 192, 96, generator=gen))
    b_up, b_down = torch.randn(192, generator=gen), torch.randn(96, generator=gen)
    x, res = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    for first, first16 in ((matmul(x, up, b_up, "gelu"), matmul(x, up, b_up, "gelu", out_bf16=True)),
                           (gated_matmul(x, gate_up, "silu"), gated_matmul(x, gate_up, "silu", out_bf16=True))):
        assert first16.dtype == torch.bfloat16 and first.dtype == torch.float32
        assert torch.equal(first16, first.to(torch.bfloat16))
        assert torch.equal(matmul(first16, down, b_down, residual=res), matmul(first, down, b_down, residual=res))
        assert torch.equal(matmul(first16, down), matmul(first, down))
    f32 = PanelWeight.pack_f32(torch.randn(96, 192, generator=gen))
    h = matmul(x, up, b_up, "gelu", out_bf16=True)
    assert matmul(x, PanelWeight.pack_f32(torch.randn(192, 96)), out_bf16=True).dtype == torch.float32
    assert torch.equal(matmul(h, f32), matmul(h.float(), f32))


def test_portable_bfloat16_chain_gives_the_same_bits(tmp_path, monkeypatch):
    """Without AVX-512 (the AVX2 kernels take some row counts as float32): a bfloat16 result fed
    back in bfloat16 still gives the float32 chain's bits."""
    import ctypes

    import kernels.cpu.panels as panels
    lib = _build_gemm(tmp_path, "-mno-avx512f")
    lib.bf16_gemm_io.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
                                 + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2)
    lib.bf16_gemm_io.restype = ctypes.c_int
    lib.panel_gemm_act.argtypes = lib.panel_gemm.argtypes + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.panel_gemm_act.restype = ctypes.c_int
    monkeypatch.setattr(panels, "_bf16_gemm_io", lambda: lib.bf16_gemm_io)
    monkeypatch.setattr(panels, "_panel_gemm", lambda: lib.panel_gemm)
    monkeypatch.setattr(panels, "_panel_gemm_act", lambda: lib.panel_gemm_act)
    gen = torch.Generator().manual_seed(3)
    up, down = PanelWeight.pack_bf16(torch.randn(64, 96, generator=gen)), PanelWeight.pack_bf16(torch.randn(96, 64, generator=gen))
    for rows in (1, 5, 40, 41, 120):
        x = torch.randn(rows, 96, generator=gen)
        h16, h = matmul(x, up, None, "relu", out_bf16=True), matmul(x, up, None, "relu")
        assert torch.equal(h16, h.to(torch.bfloat16))
        assert torch.equal(matmul(h16, down), matmul(h, down))
